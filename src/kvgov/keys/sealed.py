"""The sealed chunk format and its streaming seal/open API.

Layout (all integers big-endian)::

    header (HEADER_SIZE = 256 bytes)
      magic "KVGS" | format version u8 (2) | flags u8 (0) | key id length u16 |
      key version u32 | segment size u32 | plaintext length u64 | nonce base (12) |
      cache key digest (32, SHA-256) | key id (utf-8) | zero padding
    segment 0 | segment 1 | ... | segment n-1     each = ciphertext (segment size, the last
                                                   one shorter) + 16-byte GCM tag

A chunk has ``max(1, ceil(plain_len / segment_size))`` segments (an empty chunk has one empty
final segment). Segment ``i`` is AES-256-GCM with nonce ``(nonce_base + i) mod 2**96``, the
nonce base random per chunk, and AAD = label | the whole header | tenant | context | ``i`` |
final flag. The header holds the key version and the cache key digest, so the AAD binds tenant,
cache key, key id and version, segment index and final flag: a block moved to another tenant,
cache key or key, truncated, reordered or flipped in any bit fails to open. The *context* is
what the caller stores beside the chunk and trusts when it reads it back (the data plane's
envelope head: plaintext length and item metadata, :mod:`kvgov.keys.sealformat`): an edit of
it fails every segment too. Format 1 (no context in the AAD) is refused with
:class:`~kvgov.errors.SealVersionError`.

Streaming: :class:`SealWriter` writes the header into a caller-provided destination and seals
each segment from a source view straight into its slice (``encrypt_into``), so the data plane
can seal segment ``i`` as soon as its bytes arrive; :class:`SealReader` opens per segment or
whole (``decrypt_into``). Nothing here allocates in proportion to the chunk. The ``_into``
calls release the GIL, so segments of one chunk may be sealed or opened from several threads.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import secrets
import struct
from dataclasses import dataclass, field

from cryptography.exceptions import InvalidTag

from kvgov.errors import KeyDestroyedError, SealError, SealVersionError
from kvgov.keys.handle import KeyHandle

MAGIC = b"KVGS"
FORMAT_VERSION = 2
HEADER_SIZE = 256
TAG_SIZE = 16
NONCE_SIZE = 12
DIGEST_SIZE = 32
MAX_SEGMENT_SIZE = 1 << 30
MAX_SEGMENTS = (1 << 32) - 1

_FIXED = struct.Struct(">4sBBHIIQ12s32s")
MAX_KEY_ID_BYTES = HEADER_SIZE - _FIXED.size
_SEGMENT_TAIL = struct.Struct(">IB")
_AAD_LABEL = b"kvgov/sealed/v2\x00"
#: the most bytes of context a chunk can be bound to (its length is a u16 in the AAD)
MAX_CONTEXT_BYTES = 0xFFFF
_NONCE_MOD = 1 << (8 * NONCE_SIZE)
#: on an authentication failure, at most this many more decryptions of the failed segment look
#: for its true flag and position (the nearest first): a corrupt chunk planted in a shared tier
#: costs each get that reads it a bounded amount, not two passes per segment of the chunk
DIAGNOSE_MAX_TRIES = 8


@functools.lru_cache(1 << 16)
def cache_key_digest(cache_key: bytes) -> bytes:
    """The 32-byte digest of a cache key that sealed chunks are bound to (SHA-256; remembered,
    as the data path seals and opens the same keys again and again)."""
    return hashlib.sha256(cache_key).digest()


def segment_count(plain_len: int, segment_size: int) -> int:
    return max(1, -(-plain_len // segment_size))


@functools.lru_cache(256)
def sealed_size(plain_len: int, segment_size: int) -> int:
    """Bytes a chunk of ``plain_len`` takes once sealed with ``segment_size`` segments
    (remembered: every put asks for its size twice, and the sizes a data path sees are few;
    an out-of-range geometry raises each time)."""
    _check_geometry(plain_len, segment_size)
    return HEADER_SIZE + plain_len + TAG_SIZE * segment_count(plain_len, segment_size)


def _check_geometry(plain_len: int, segment_size: int) -> None:
    if not 1 <= segment_size <= MAX_SEGMENT_SIZE:
        raise ValueError(f"segment size must be 1..{MAX_SEGMENT_SIZE} bytes")
    if plain_len < 0 or segment_count(plain_len, segment_size) > MAX_SEGMENTS:
        raise ValueError("plaintext length out of range for this segment size")


@dataclass(frozen=True, slots=True)
class SealedHeader:
    """A parsed header. Authenticated only once a segment opens (it is part of every AAD)."""

    key_id: str
    key_version: int
    segment_size: int
    plain_len: int
    nonce_base: bytes
    cache_digest: bytes
    #: how many segments, and the sealed chunk's size: computed once (every segment's seal or
    #: open asks)
    segments: int = field(init=False, repr=False, compare=False)
    sealed_size: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        segments = segment_count(self.plain_len, self.segment_size)
        object.__setattr__(self, "segments", segments)
        object.__setattr__(self, "sealed_size", HEADER_SIZE + self.plain_len + TAG_SIZE * segments)

    def plain_span(self, index: int) -> tuple[int, int]:
        """``(offset, length)`` of segment ``index`` in the plaintext."""
        if not 0 <= index < self.segments:
            raise IndexError(f"segment {index} out of range 0..{self.segments - 1}")
        start = index * self.segment_size
        return start, min(self.segment_size, self.plain_len - start)

    def sealed_span(self, index: int) -> tuple[int, int]:
        """``(offset, length)`` of segment ``index`` (ciphertext + tag) in the sealed chunk."""
        start, length = self.plain_span(index)
        return HEADER_SIZE + start + index * TAG_SIZE, length + TAG_SIZE

    def encode(self) -> bytes:
        kid = self.key_id.encode()
        if len(kid) > MAX_KEY_ID_BYTES:
            raise ValueError(f"key id longer than {MAX_KEY_ID_BYTES} bytes")
        fixed = _FIXED.pack(
            MAGIC,
            FORMAT_VERSION,
            0,
            len(kid),
            self.key_version,
            self.segment_size,
            self.plain_len,
            self.nonce_base,
            self.cache_digest,
        )
        return (fixed + kid).ljust(HEADER_SIZE, b"\x00")


def parse_header(sealed: bytes | bytearray | memoryview) -> SealedHeader:
    """Parse and sanity-check a header; :class:`SealError` says what is wrong."""
    view = memoryview(sealed)
    if len(view) < HEADER_SIZE:
        raise SealError(
            f"sealed chunk is truncated: {len(view)} bytes, shorter than its {HEADER_SIZE}-byte"
            " header"
        )
    magic, version, flags, kid_len, key_version, seg, plain_len, base, digest = _FIXED.unpack(
        view[: _FIXED.size]
    )
    if magic != MAGIC:
        raise SealError("bad header: not a kvgov sealed chunk (wrong magic)")
    if version != FORMAT_VERSION:
        raise SealVersionError(
            f"bad header: unsupported sealed format version {version}"
            f" (this kvgov reads version {FORMAT_VERSION} only; version 1 did not authenticate"
            " the length and metadata stored beside the chunk)"
        )
    rest = bytes(view[_FIXED.size + min(kid_len, MAX_KEY_ID_BYTES) : HEADER_SIZE])
    if flags != 0 or kid_len == 0 or kid_len > MAX_KEY_ID_BYTES or rest.strip(b"\x00"):
        raise SealError("bad header: reserved fields are not zero or the key id is malformed")
    if not 1 <= seg <= MAX_SEGMENT_SIZE or segment_count(plain_len, seg) > MAX_SEGMENTS:
        raise SealError("bad header: segment size or plaintext length out of range")
    try:
        key_id = bytes(view[_FIXED.size : _FIXED.size + kid_len]).decode()
    except UnicodeDecodeError as exc:
        raise SealError("bad header: key id is not utf-8") from exc
    return SealedHeader(key_id, key_version, seg, plain_len, base, digest)


class _Segments:
    """What sealing and opening share: the header bytes, the AAD prefix, the nonce base."""

    def __init__(
        self, header: SealedHeader, header_bytes: bytes, tenant: str, context: bytes
    ) -> None:
        self.header = header
        self._base = int.from_bytes(header.nonce_base, "big")
        tenant_b = tenant.encode()
        if len(context) > MAX_CONTEXT_BYTES:
            raise ValueError(f"context longer than {MAX_CONTEXT_BYTES} bytes")
        self._aad_prefix = b"".join(
            (
                _AAD_LABEL,
                header_bytes,
                len(tenant_b).to_bytes(2, "big"),
                tenant_b,
                len(context).to_bytes(2, "big"),
                context,
            )
        )
        self._last = header.segments - 1

    def nonce(self, index: int) -> bytes:
        return ((self._base + index) % _NONCE_MOD).to_bytes(NONCE_SIZE, "big")

    def aad(self, index: int, final: bool) -> bytes:
        return self._aad_prefix + _SEGMENT_TAIL.pack(index, 1 if final else 0)

    def is_final(self, index: int) -> bool:
        return index == self._last


class SealWriter:
    """Seals one chunk into ``dst`` (at least :func:`sealed_size` bytes, e.g. a pooled buffer).

    The header is written on construction; then call :meth:`seal_segment` for every segment
    as its plaintext arrives (any order, any thread, each segment once), or :meth:`seal_from`
    with the whole plaintext. Constructing a writer counts one chunk against the key's usage.
    ``context``: bytes kept beside the chunk that every segment is bound to (the reader must
    be given the same).
    """

    def __init__(
        self,
        key: KeyHandle,
        cache_key: bytes,
        plain_len: int,
        dst: bytearray | memoryview,
        *,
        segment_size: int,
        context: bytes = b"",
    ) -> None:
        _check_geometry(plain_len, segment_size)
        _ = key.aead  # raises KeyDestroyedError before anything is written
        header = SealedHeader(
            key_id=key.key_id,
            key_version=key.version,
            segment_size=segment_size,
            plain_len=plain_len,
            nonce_base=secrets.token_bytes(NONCE_SIZE),
            cache_digest=cache_key_digest(cache_key),
        )
        header_bytes = header.encode()
        view = memoryview(dst).cast("B")
        if view.readonly:
            raise ValueError("destination buffer is read-only")
        if len(view) < header.sealed_size:
            raise ValueError(f"destination holds {len(view)} bytes; {header.sealed_size} needed")
        self._dst = view[: header.sealed_size]
        self._dst[:HEADER_SIZE] = header_bytes
        self._seg = _Segments(header, header_bytes, key.tenant, bytes(context))
        self._sealed = bytearray(header.segments)
        self.key = key
        key.note_use()

    @property
    def header(self) -> SealedHeader:
        return self._seg.header

    @property
    def sealed_len(self) -> int:
        return self._seg.header.sealed_size

    @property
    def done(self) -> bool:
        return all(self._sealed)

    def seal_segment(self, index: int, src: bytes | bytearray | memoryview) -> None:
        """Seal plaintext segment ``index`` (exactly its length) into its slice of ``dst``."""
        header = self._seg.header
        _, length = header.plain_span(index)
        if len(src) != length:
            raise ValueError(f"segment {index} is {length} bytes, got {len(src)}")
        if self._sealed[index]:
            raise ValueError(f"segment {index} already sealed (a nonce is never reused)")
        # the handle's context, read per segment: once the key is shredded (or dropped by a
        # revalidation) a put in progress fails here instead of sealing under it
        aead = self.key.aead
        self._sealed[index] = 1
        off, slen = header.sealed_span(index)
        aead.encrypt_into(
            self._seg.nonce(index),
            src,
            self._seg.aad(index, self._seg.is_final(index)),
            self._dst[off : off + slen],
        )

    def seal_from(self, src: bytes | bytearray | memoryview) -> int:
        """Seal every segment from the whole plaintext; returns the sealed length."""
        view = memoryview(src).cast("B")
        if len(view) != self._seg.header.plain_len:
            raise ValueError(f"plaintext is {len(view)} bytes, header says otherwise")
        for i in range(self._seg.header.segments):
            start, length = self._seg.header.plain_span(i)
            self.seal_segment(i, view[start : start + length])
        return self.sealed_len


class SealReader:
    """Opens one sealed chunk for ``tenant`` and ``cache_key`` with ``key``.

    Construction checks the header against the key, tenant, cache key and length, raising a
    :class:`SealError` that names the mismatch; :meth:`open_segment` then authenticates and
    decrypts one segment into ``dst`` (zeroed again if authentication fails), checking the
    ``context`` the chunk was sealed with.
    """

    def __init__(
        self,
        sealed: bytes | bytearray | memoryview,
        key: KeyHandle,
        *,
        tenant: str,
        cache_key: bytes,
        context: bytes = b"",
    ) -> None:
        view = memoryview(sealed).cast("B")
        header = parse_header(view)
        if key.tenant != tenant:
            raise SealError(
                f"sealed under a key of another tenant: key {key.key_id!r} does not belong"
                f" to tenant {tenant!r}"
            )
        if header.key_id != key.key_id or header.key_version != key.version:
            raise SealError(
                f"sealed under key {header.key_id!r} v{header.key_version}, not"
                f" {key.key_id!r} v{key.version}"
            )
        if header.cache_digest != cache_key_digest(cache_key):
            raise SealError("sealed for another cache key (cache key digest differs)")
        if len(view) != header.sealed_size:
            what = "truncated" if len(view) < header.sealed_size else "longer than its header says"
            raise SealError(
                f"sealed chunk is {what}: {len(view)} bytes, header says {header.sealed_size}"
                f" ({header.segments} segments)"
            )
        _ = key.aead  # raises KeyDestroyedError for a destroyed key
        self._key = key
        self._view = view
        self._seg = _Segments(header, bytes(view[:HEADER_SIZE]), tenant, bytes(context))
        #: failures seen (``next`` is atomic): only the first is diagnosed, whichever thread
        self._failures = itertools.count()

    @property
    def header(self) -> SealedHeader:
        return self._seg.header

    def open_segment(self, index: int, dst: bytearray | memoryview) -> int:
        """Open segment ``index`` into ``dst`` (its plaintext length); returns that length."""
        header = self._seg.header
        _, length = header.plain_span(index)
        out = memoryview(dst).cast("B")
        if len(out) != length:
            raise ValueError(f"segment {index} is {length} bytes, destination {len(out)}")
        off, slen = header.sealed_span(index)
        data = self._view[off : off + slen]
        aead = self._key.aead  # per segment: a shred stops a streamed open in progress
        try:
            aead.decrypt_into(
                self._seg.nonce(index), data, self._seg.aad(index, self._seg.is_final(index)), out
            )
        except InvalidTag:
            out[:] = bytes(length)  # never hand back unauthenticated plaintext
            # one diagnosis per reader: a chunk failing in every segment, opened by several
            # pool jobs, costs one bounded diagnosis per get, not one per job
            why = self._diagnose(index, data) if next(self._failures) == 0 else None
            raise SealError(why or _failed(index, self._seg.header.segments)) from None
        return length

    def open_into(self, dst: bytearray | memoryview) -> int:
        """Open every segment into ``dst`` (at least ``plain_len`` bytes); returns plain_len."""
        header = self._seg.header
        out = memoryview(dst).cast("B")
        if len(out) < header.plain_len:
            raise ValueError(f"destination holds {len(out)} bytes; {header.plain_len} needed")
        try:
            for i in range(header.segments):
                start, length = header.plain_span(i)
                self.open_segment(i, out[start : start + length])
        except (SealError, KeyDestroyedError):  # nothing of a chunk that failed to open
            out[: header.plain_len] = bytes(header.plain_len)
            raise
        return header.plain_len

    def _diagnose(self, index: int, data: memoryview) -> str:
        """Why segment ``index`` failed: its flag flipped, or a nearby segment moved there.

        Error path only, and bounded: at most :data:`DIAGNOSE_MAX_TRIES` decryptions of this
        one segment, whatever the chunk's size, once per reader (the first failure), so a
        planted corrupt chunk cannot make a get pay for the whole chunk many times over.
        """
        n = self._seg.header.segments
        aead = self._key.aead
        scratch = bytearray(len(data) - TAG_SIZE)
        for j, final in self._diagnose_candidates(index, n):
            try:
                aead.decrypt_into(self._seg.nonce(j), data, self._seg.aad(j, final), scratch)
            except InvalidTag:
                continue
            if j != index:
                return (
                    f"sealed chunk segments are reordered: position {index} holds"
                    f" segment {j} of {n}"
                )
            return (
                f"sealed chunk was cut or spliced: segment {index} of {n} carries the"
                " wrong final-segment flag"
            )
        return _failed(index, n)

    def _diagnose_candidates(self, index: int, n: int) -> list[tuple[int, bool]]:
        """Where segment ``index``'s bytes may truly belong, the likeliest first, bounded."""
        tries = [(index, not self._seg.is_final(index))]
        for d in range(1, n):
            for j in (index - d, index + d):
                if 0 <= j < n:
                    tries.append((j, self._seg.is_final(j)))
            if len(tries) >= DIAGNOSE_MAX_TRIES:
                break
        return tries[:DIAGNOSE_MAX_TRIES]


def _failed(index: int, n: int) -> str:
    return (
        f"segment {index} of {n} failed authentication: a bit of the header, ciphertext,"
        " tag or context (the length and metadata stored beside it) was altered, or the"
        " chunk was sealed for another tenant, cache key or key"
    )


def seal(
    key: KeyHandle,
    cache_key: bytes,
    data: bytes | bytearray | memoryview,
    *,
    segment_size: int,
    context: bytes = b"",
) -> bytearray:
    """Seal ``data`` into a new buffer (convenience off the hot path)."""
    plain = memoryview(data).cast("B")
    out = bytearray(sealed_size(len(plain), segment_size))
    SealWriter(
        key, cache_key, len(plain), out, segment_size=segment_size, context=context
    ).seal_from(plain)
    return out


def open_into(
    sealed: bytes | bytearray | memoryview,
    dst: bytearray | memoryview,
    key: KeyHandle,
    *,
    tenant: str,
    cache_key: bytes,
    context: bytes = b"",
) -> int:
    """Open a whole sealed chunk into ``dst``; returns the plaintext length."""
    reader = SealReader(sealed, key, tenant=tenant, cache_key=cache_key, context=context)
    return reader.open_into(dst)


def open_sealed(
    sealed: bytes | bytearray | memoryview,
    key: KeyHandle,
    *,
    tenant: str,
    cache_key: bytes,
    context: bytes = b"",
) -> bytearray:
    """Open a sealed chunk into a new buffer (convenience off the hot path)."""
    reader = SealReader(sealed, key, tenant=tenant, cache_key=cache_key, context=context)
    out = bytearray(reader.header.plain_len)
    reader.open_into(out)
    return out

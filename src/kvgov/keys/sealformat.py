"""The stored-value envelope (format 2): one home for what a tier holds per KV entry.

Every value the data plane stores in a tier is::

    envelope head
      magic "KVGA" | format version u8 = 2 | flags u8 (bit 0: body is sealed) |
      metadata length u16 | plaintext length u64 |           (big-endian, 16 bytes)
      item metadata (canonical JSON, :func:`kvgov.wire.itemmeta.canonical_json`, <= 256 bytes)
    body
      the sealed chunk (:mod:`kvgov.keys.sealed`, format 2), or the plaintext (governance off)

Everything a GET trusts from the tier is authenticated: the head is the sealed chunk's
*context*, part of every segment's AAD, so an edited length, flag or metadata byte fails
authentication like a flipped ciphertext bit; and :meth:`Envelope.reader` checks the head's
plaintext length against the sealed header's before any crypto (a clear error, never a reply
that promises more or fewer bytes than the chunk holds). A body that is not sealed must be
exactly the plaintext length. Format 1 (magic ``"KVGE"``: a JSON head with the length in it,
outside the AAD) is refused with :class:`~kvgov.errors.SealVersionError`: it cannot be checked,
so the entry is dropped and recomputed (KV cache is a cache).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvgov.errors import CorruptValueError, SealVersionError
from kvgov.keys.sealed import HEADER_SIZE, SealReader
from kvgov.wire.itemmeta import MAX_ITEM_META_BYTES, canonical_json

if TYPE_CHECKING:
    from kvgov.keys.sealing import Sealing

MAGIC = b"KVGA"
#: the unauthenticated envelope of kvgov before format 2
LEGACY_MAGIC = b"KVGE"
VERSION = 2
HEAD = struct.Struct(">4sBBHQ")
#: the longest envelope head
MAX_HEAD_SIZE = HEAD.size + MAX_ITEM_META_BYTES
_SEALED = 0x01


def encode_head(meta: Mapping[str, Any], plain_len: int, *, sealed: bool) -> bytes:
    """The envelope head for a value of ``plain_len`` plaintext bytes with item metadata
    ``meta`` (already checked: :func:`kvgov.wire.itemmeta.check_item_meta`)."""
    body = canonical_json(meta) if meta else b""
    if len(body) > MAX_ITEM_META_BYTES:
        raise ValueError(f"item metadata longer than {MAX_ITEM_META_BYTES} bytes")
    return HEAD.pack(MAGIC, VERSION, _SEALED if sealed else 0, len(body), plain_len) + body


@dataclass(frozen=True, slots=True)
class Envelope:
    """A parsed envelope (its head not yet authenticated: see :meth:`reader`)."""

    #: the head's bytes: the sealed chunk's context
    head: bytes
    meta: dict[str, Any]
    plain_len: int
    sealed: bool
    #: the body (sealed chunk or plaintext), a view into the stored value
    body: memoryview

    def plain_body(self) -> memoryview:
        """The plaintext of an unsealed value; :class:`CorruptValueError` unless the body is
        exactly the length the head says."""
        if self.sealed:
            raise CorruptValueError("stored value is sealed, not plaintext")
        if self.body.nbytes != self.plain_len:
            raise CorruptValueError(
                f"stored value's body is {self.body.nbytes} bytes, its envelope says"
                f" {self.plain_len}"
            )
        return self.body

    def reader(
        self,
        keyring: Sealing,
        *,
        tenant: str,
        cache_key: bytes,
        sealed_with: tuple[str, int] | None = None,
    ) -> SealReader:
        """A reader of the sealed body, bound to this head; raises :class:`CorruptValueError`
        (a ``SealError`` for the sealed chunk's own checks) when the head and the sealed
        header disagree, or when the chunk is sealed under another key than ``sealed_with``
        (the key id and version the ledger recorded at put): an older value of the same cache
        key, sealed under a since-retired version, put back in a tier, authenticates under
        that version but is not the entry the index holds."""
        if not self.sealed:
            raise CorruptValueError("stored value is plaintext where a sealed one is required")
        reader = keyring.reader(self.body, tenant=tenant, cache_key=cache_key, context=self.head)
        if reader.header.plain_len != self.plain_len:
            raise CorruptValueError(
                f"stored envelope says {self.plain_len} bytes, its sealed chunk"
                f" {reader.header.plain_len}"
            )
        found = (reader.header.key_id, reader.header.key_version)
        if sealed_with is not None and found != sealed_with:
            raise CorruptValueError(
                f"stored value is sealed under key {found[0]!r} v{found[1]}, the entry was put"
                f" under {sealed_with[0]!r} v{sealed_with[1]} (rolled back or substituted)"
            )
        return reader


def parse(value: memoryview) -> Envelope:
    """Parse a stored value; :class:`CorruptValueError` (or :class:`SealVersionError` for a
    format-1 value) says what is wrong."""
    if value.nbytes >= 4 and bytes(value[:4]) == LEGACY_MAGIC:
        raise SealVersionError(
            "stored value is in envelope format 1 (its length and item metadata are not"
            " authenticated): refused; the entry is dropped and recomputed"
        )
    if value.nbytes < HEAD.size:
        raise CorruptValueError("stored value is too short for an envelope")
    magic, version, flags, meta_len, plain_len = HEAD.unpack_from(value)
    if magic != MAGIC:
        raise CorruptValueError("stored value is not a kvgov envelope (wrong magic)")
    if version != VERSION:
        raise SealVersionError(f"stored envelope format {version} is not read (only {VERSION})")
    if flags & ~_SEALED or meta_len > MAX_ITEM_META_BYTES:
        raise CorruptValueError("stored envelope has reserved flags set or oversize metadata")
    end = HEAD.size + meta_len
    if end > value.nbytes:
        raise CorruptValueError("stored envelope is truncated")
    meta: dict[str, Any] = {}
    if meta_len:
        try:
            parsed = json.loads(bytes(value[HEAD.size : end]))
        except ValueError as exc:
            raise CorruptValueError("stored envelope metadata is not JSON") from exc
        if not isinstance(parsed, dict):
            raise CorruptValueError("stored envelope metadata is not an object")
        meta = parsed
    sealed = bool(flags & _SEALED)
    if sealed and value.nbytes - end < HEADER_SIZE:
        raise CorruptValueError("stored value is too short for its sealed chunk")
    return Envelope(bytes(value[:end]), meta, plain_len, sealed, value[end:])

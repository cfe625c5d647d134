"""The keyring's sealing half: stream writers and readers under its keys, and whole-buffer
conveniences. Mixed into :class:`kvgov.keys.keyring.Keyring`, which provides the keys
(``current`` for new data, ``get`` for the version a chunk names) and the segment size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvgov.errors import SealError
from kvgov.keys.handle import KeyHandle
from kvgov.keys.ids import tenant_of
from kvgov.keys.sealed import SealReader, SealWriter, parse_header, sealed_size


class Sealing:
    """Seal and open under the keyring's keys."""

    if TYPE_CHECKING:  # provided by the keyring
        segment_size: int

        def current(self, tenant: str, user: str | None = None) -> KeyHandle: ...

        def get(self, key_id: str, version: int) -> KeyHandle: ...

    def sealer(
        self,
        tenant: str,
        cache_key: bytes,
        plain_len: int,
        dst: bytearray | memoryview,
        *,
        user: str | None = None,
        segment_size: int | None = None,
        context: bytes = b"",
    ) -> SealWriter:
        """A :class:`SealWriter` under the scope's active key (``writer.key`` says which),
        bound to ``context`` (bytes kept beside the chunk, e.g. its envelope head)."""
        return SealWriter(
            self.current(tenant, user),
            cache_key,
            plain_len,
            dst,
            segment_size=segment_size or self.segment_size,
            context=context,
        )

    def reader(
        self,
        sealed: bytes | bytearray | memoryview,
        *,
        tenant: str,
        cache_key: bytes,
        context: bytes = b"",
    ) -> SealReader:
        """A :class:`SealReader` with the key named in the chunk's header, refusing a key of
        another tenant before looking it up; :class:`KeyDestroyedError` if it was shredded."""
        header = parse_header(sealed)
        owner = tenant_of(header.key_id)
        if owner != tenant:
            raise SealError(
                f"sealed under a key of another tenant: key {header.key_id!r} does not belong"
                f" to tenant {tenant!r}"
            )
        key = self.get(header.key_id, header.key_version)
        return SealReader(sealed, key, tenant=tenant, cache_key=cache_key, context=context)

    def seal(
        self,
        tenant: str,
        cache_key: bytes,
        data: bytes | bytearray | memoryview,
        *,
        user: str | None = None,
        segment_size: int | None = None,
        context: bytes = b"",
    ) -> bytearray:
        """Seal into a new buffer (convenience; the data path uses :meth:`sealer`)."""
        plain = memoryview(data).cast("B")
        seg = segment_size or self.segment_size
        out = bytearray(sealed_size(len(plain), seg))
        self.sealer(
            tenant, cache_key, len(plain), out, user=user, segment_size=seg, context=context
        ).seal_from(plain)
        return out

    def open_into(
        self,
        sealed: bytes | bytearray | memoryview,
        dst: bytearray | memoryview,
        *,
        tenant: str,
        cache_key: bytes,
        context: bytes = b"",
    ) -> int:
        reader = self.reader(sealed, tenant=tenant, cache_key=cache_key, context=context)
        return reader.open_into(dst)

    def open(
        self,
        sealed: bytes | bytearray | memoryview,
        *,
        tenant: str,
        cache_key: bytes,
        context: bytes = b"",
    ) -> bytearray:
        """Open into a new buffer (convenience; the data path uses :meth:`open_into`)."""
        reader = self.reader(sealed, tenant=tenant, cache_key=cache_key, context=context)
        out = bytearray(reader.header.plain_len)
        reader.open_into(out)
        return out

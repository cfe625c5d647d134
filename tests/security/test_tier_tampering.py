"""Tampering with the tiers at rest: whoever can write the filesystem tier's files or the Redis
keys (a host account, a shared Redis) moves sealed chunks between keys and tenants, flips
bits, or edits the small envelope around the ciphertext. A GET must never serve such a value
as a hit: the sealed chunk's AAD binds tenant, cache key and key version, and every segment is
authenticated before any of its bytes go out.

Attack (issue 14, first paragraph: "ciphertext moved or flipped in the tiers" held; "what got
through" 6: the envelope's length and metadata sit outside the AEAD). The tests on the
envelope's length/metadata, and those asking that a detected corruption be *recorded* in the
ledger, failed until the envelope was authenticated (issue 14, "what to build" 7: sealed
format 2, ``kvgov.keys.sealformat``).
"""

from __future__ import annotations

import json
import os
import re
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from kvgov.connectors.tiers.filesystem import FilesystemTier
from kvgov.connectors.tiers.fsformat import HEADER as FS_HEADER
from kvgov.connectors.tiers.fsformat import encode_header
from kvgov.keys.sealed import HEADER_SIZE as SEALED_HEADER
from kvgov.proxy.app import Sidecar
from kvgov.types import EventKind
from kvgov.wire import RequestContext, WireClient, WireError
from tests.conftest import REDIS_URL
from tests.security import doors
from tests.security.doors import key, run

pytestmark = [pytest.mark.postgres]

ACME = RequestContext(request_id="t-1", tenant="acme")
GLOBEX = RequestContext(request_id="t-2", tenant="globex")
SIZE = 20_000  # one sealed segment; "_n":20000 in the envelope


# -- the two tiers an attacker can write, behind one small interface --------------------------


class Store:
    """Raw read/write of what a tier holds under a key digest (the attacker's access)."""

    def read(self, digest: str) -> bytes:
        raise NotImplementedError

    def write(self, digest: str, value: bytes) -> None:
        raise NotImplementedError


class FsStore(Store):
    def __init__(self, tier: FilesystemTier) -> None:
        self.tier = tier

    def _parts(self, digest: str) -> tuple[float | None, bytes]:
        data = self.tier.path_of(digest).read_bytes()
        _magic, _v, flags, key_len, expiry, size = FS_HEADER.unpack_from(data)
        value = data[FS_HEADER.size + key_len :]
        assert len(value) == size
        return (expiry if flags & 1 else None), value

    def read(self, digest: str) -> bytes:
        return self._parts(digest)[1]

    def write(self, digest: str, value: bytes) -> None:
        """Replace the file, with a header naming ``digest`` (the file format is not a secret:
        an attacker forges a consistent header)."""
        expiry, _ = self._parts(digest)
        path = self.tier.path_of(digest)
        path.write_bytes(encode_header(digest, len(value), expiry) + value)


class RedisStore(Store):
    def __init__(self, prefix: str) -> None:
        import redis

        self.prefix = prefix
        self.client = redis.Redis.from_url(REDIS_URL)

    def read(self, digest: str) -> bytes:
        value = self.client.get(self.prefix + digest)
        assert isinstance(value, bytes)
        return value

    def write(self, digest: str, value: bytes) -> None:
        self.client.set(self.prefix + digest, value, keepttl=True)


@pytest.fixture(params=["filesystem", pytest.param("redis", marks=pytest.mark.redis)])
def tier(request: pytest.FixtureRequest) -> Iterator[str]:
    yield request.param


@asynccontextmanager
async def governed(
    tmp_path: Path, prod_db: doors.ProdDatabase, tier: str
) -> AsyncIterator[tuple[Sidecar, Store]]:
    """A production sidecar whose only tier is ``tier`` (no memory copy to hide the tamper)."""
    prefix = f"kvgov-test:{uuid.uuid4().hex[:10]}:"
    tiers: dict[str, Any] = {"chain": [tier]}
    if tier == "redis":
        tiers |= {"redis_url": REDIS_URL, "redis_prefix": prefix}
    try:
        async with doors.tiered_sidecar(tmp_path, prod_db, tiers) as sc:
            if tier == "redis":
                yield sc, RedisStore(prefix)
            else:
                fs = sc.pipeline.tiers.tier("filesystem")
                assert isinstance(fs, FilesystemTier)
                yield sc, FsStore(fs)
    finally:
        if tier == "redis":
            import redis

            client = redis.Redis.from_url(REDIS_URL)
            try:
                stale = list(client.scan_iter(match=prefix + "*"))
                if stale:
                    client.delete(*stale)
            finally:
                client.close()


def client(sc: Sidecar, token: str) -> WireClient:
    """An engine that gives up on a reply after 3 s (a reply promising bytes that never come
    must not hang the test)."""
    return WireClient(
        f"tcp://127.0.0.1:{sc.server.tcp_port}", engine_id="x", token=token, timeout=3
    )


def fetch(sc: Sidecar, token: str, raw_key: str, ctx: RequestContext) -> Any:
    """What the engine ends up with: ``("hit", bytes, meta)``, ``("miss",)`` or ``("error",)``
    (the sidecar refused mid-reply: the connector treats it as a miss)."""
    c = client(sc, token)
    try:
        got = c.get(raw_key, ctx)
    except WireError:
        return ("error",)
    finally:
        c.close()
    if got is None:
        return ("miss",)
    return ("hit", got[0], dict(got[1].meta))


async def put(sc: Sidecar, token: str, raw_key: str, value: bytes, ctx: RequestContext) -> str:
    c = client(sc, token)
    try:
        assert (await run(c.put, raw_key, value, ctx)).ok
    finally:
        c.close()
    assert sc.writer is not None
    await sc.writer.flush()
    return sc.pipeline.pseudonymizer.key_digest(raw_key)


async def after_tamper(sc: Sidecar, digest: str) -> Callable[[], Any]:
    """The ledger events about ``digest`` from now on (call the result after the attack)."""
    assert sc.writer is not None
    await sc.writer.flush()
    seen = {e.seq for e in doors.all_events(sc)}

    async def new() -> list[Any]:
        assert sc.writer is not None
        await sc.writer.flush()
        return [e for e in doors.all_events(sc) if e.seq not in seen and e.key_digest == digest]

    return new


def corruption_recorded(events: list[Any]) -> bool:
    """A ledger event that says the stored value was found corrupt (not merely a miss)."""
    return any(
        e.outcome == "error" or re.search(r"corrupt|unreadable|tamper|seal", e.reason or "")
        for e in events
    )


def flip(value: bytes, at: int) -> bytes:
    return value[:at] + bytes([value[at] ^ 0x01]) + value[at + 1 :]


#: the stored-value envelopes around the sealed chunk: format 1 (``KVGE`` | u32 LE meta length
#: | JSON meta holding ``_n``, the length) and format 2 (``KVGA`` | version | flags | u16 BE
#: meta length | u64 BE length | canonical JSON meta); the tests edit either
_V1, _V2 = b"KVGE", b"KVGA"


def _meta_span(value: bytes) -> tuple[int, int]:
    """Where the envelope's JSON metadata lies (start, end = where the body starts)."""
    if value[:4] == _V1:
        return 8, 8 + int.from_bytes(value[4:8], "little")
    assert value[:4] == _V2, value[:4]
    return 16, 16 + int.from_bytes(value[6:8], "big")


def body_offset(value: bytes) -> int:
    """Where the sealed chunk starts inside a stored envelope."""
    return _meta_span(value)[1]


def _edit_json(value: bytes, edit: Callable[[dict[str, Any]], None]) -> bytes:
    """Rewrite the envelope's JSON keeping its length (so nothing else in the value moves)."""
    start, end = _meta_span(value)
    text = value[start:end].decode()
    meta = json.loads(text) if text else {}
    edit(meta)
    new = json.dumps(meta, separators=(",", ":"), sort_keys=value[:4] == _V2)
    assert len(new) == len(text), (text, new)
    return value[:start] + new.encode() + value[end:]


def with_length(value: bytes, length: int) -> bytes:
    """The envelope announcing ``length`` plaintext bytes."""
    if value[:4] == _V2:
        return value[:8] + length.to_bytes(8, "big") + value[16:]

    def edit(meta: dict[str, Any]) -> None:
        meta["_n"] = length

    return _edit_json(value, edit)


def with_meta(value: bytes, edit: Callable[[dict[str, Any]], None]) -> bytes:
    """The envelope with the engine's item metadata edited."""
    return _edit_json(value, edit)


# -- moved and flipped ciphertext: a miss today -------------------------------------------------


async def test_ciphertext_moved_to_another_key_is_never_a_hit(
    tmp_path: Path, prod_db: doors.ProdDatabase, tier: str
) -> None:
    async with governed(tmp_path, prod_db, tier) as (sc, store):
        v1, v2 = os.urandom(SIZE), os.urandom(SIZE)
        d1 = await put(sc, "tok-acme", key(1, "acme"), v1, ACME)
        d2 = await put(sc, "tok-acme", key(2, "acme"), v2, ACME)
        events = await after_tamper(sc, d2)
        store.write(d2, store.read(d1))  # key 1's sealed value under key 2
        assert await run(fetch, sc, "tok-acme", key(2, "acme"), ACME) in (("miss",), ("error",))
        assert await run(fetch, sc, "tok-acme", key(2, "acme"), ACME) in (("miss",), ("error",))
        assert (await run(fetch, sc, "tok-acme", key(1, "acme"), ACME))[1] == v1
        seen = await events()
        assert [e for e in seen if e.kind == EventKind.KV_GET] == []
        assert corruption_recorded(seen), "the moved chunk was missed, not detected"


async def test_ciphertext_moved_to_another_tenant_is_never_a_hit(
    tmp_path: Path, prod_db: doors.ProdDatabase, tier: str
) -> None:
    """acme's sealed chunk placed under globex's key: globex's engine never gets acme's
    bytes (the chunk names acme's key; the AAD binds acme and acme's cache key)."""
    async with governed(tmp_path, prod_db, tier) as (sc, store):
        secret = os.urandom(SIZE)
        da = await put(sc, "tok-acme", key(3, "acme"), secret, ACME)
        dg = await put(sc, "tok-globex", key(3, "globex"), os.urandom(SIZE), GLOBEX)
        events = await after_tamper(sc, dg)
        store.write(dg, store.read(da))
        got = await run(fetch, sc, "tok-globex", key(3, "globex"), GLOBEX)
        assert got in (("miss",), ("error",))
        seen = await events()
        assert [e for e in seen if e.kind == EventKind.KV_GET] == []
        assert corruption_recorded(seen)
        assert (await run(fetch, sc, "tok-acme", key(3, "acme"), ACME))[1] == secret


@pytest.mark.parametrize("where", ["sealed-header", "ciphertext", "tag"])
async def test_flipped_ciphertext_is_never_a_hit_and_is_dropped(
    tmp_path: Path, prod_db: doors.ProdDatabase, tier: str, where: str
) -> None:
    async with governed(tmp_path, prod_db, tier) as (sc, store):
        d = await put(sc, "tok-acme", key(4, "acme"), os.urandom(SIZE), ACME)
        events = await after_tamper(sc, d)
        value = store.read(d)
        start = body_offset(value)
        at = {
            "sealed-header": start + 20,  # inside the key version / geometry fields
            "ciphertext": start + SEALED_HEADER + SIZE // 2,
            "tag": len(value) - 3,
        }[where]
        store.write(d, flip(value, at))
        for _ in range(2):
            got = await run(fetch, sc, "tok-acme", key(4, "acme"), ACME)
            assert got in (("miss",), ("error",)), got[:1]
        # detected and recorded; a segment found bad only while being sent was recorded as a
        # kv:get before the send began: the kv:delete (unreadable) follows it in the chain
        seen = await events()
        assert corruption_recorded(seen)
        gets = [e.seq for e in seen if e.kind == EventKind.KV_GET]
        dropped = [e.seq for e in seen if e.kind == EventKind.KV_DELETE]
        assert all(dropped and min(dropped) > g for g in gets)


async def test_a_flipped_segment_is_dropped_and_recorded(
    tmp_path: Path, prod_db: doors.ProdDatabase, tier: str
) -> None:
    """A segment that fails authentication while being sent: the entry is removed from the
    index and the tier and recorded (``kv:delete``, ``unreadable:...``)."""
    async with governed(tmp_path, prod_db, tier) as (sc, store):
        d = await put(sc, "tok-acme", key(5, "acme"), os.urandom(SIZE), ACME)
        events = await after_tamper(sc, d)
        value = store.read(d)
        store.write(d, flip(value, body_offset(value) + SEALED_HEADER + 7))
        assert await run(fetch, sc, "tok-acme", key(5, "acme"), ACME) in (("miss",), ("error",))
        assert sc.pipeline.index.get(d) is None
        assert corruption_recorded(await events())


# -- the envelope outside the AEAD: expected to fail until it is authenticated ------------------


@pytest.mark.parametrize("length", [SIZE // 2, SIZE * 2 + 7_000])
async def test_an_edited_envelope_length_is_never_served(
    tmp_path: Path, prod_db: doors.ProdDatabase, tier: str, length: int
) -> None:
    """Fewer bytes announced than sent: a truncated prefix served as a hit and a desynchronised
    stream; more: a reply promising bytes that never come. Either must be a miss, recorded."""
    async with governed(tmp_path, prod_db, tier) as (sc, store):
        value = os.urandom(SIZE)
        d = await put(sc, "tok-acme", key(8, "acme"), value, ACME)
        events = await after_tamper(sc, d)
        assert len(str(length)) == len(str(SIZE))  # a JSON length keeps its width
        store.write(d, with_length(store.read(d), length))
        got = await run(fetch, sc, "tok-acme", key(8, "acme"), ACME)
        assert got[0] != "hit", "an edited length was served"
        assert corruption_recorded(await events())


async def test_edited_entry_metadata_is_never_served(
    tmp_path: Path, prod_db: doors.ProdDatabase, tier: str
) -> None:
    """The engine's per-entry metadata (LMCache fmt/dtype/shape) edited at rest: a GET that
    returns it would make the engine misread the bytes. It must come back as stored, or miss."""
    async with governed(tmp_path, prod_db, tier) as (sc, store):
        value = os.urandom(SIZE)
        c = client(sc, "tok-acme")
        try:
            meta = {"fmt": 1, "shape": [2, 8]}
            ack = await run(lambda: c.put(key(9, "acme"), value, ACME, meta=meta))
            assert ack.ok
        finally:
            c.close()
        d = sc.pipeline.pseudonymizer.key_digest(key(9, "acme"))
        events = await after_tamper(sc, d)

        def set_fmt(meta: dict[str, Any]) -> None:
            meta["fmt"] = 7
            meta["shape"] = [8, 2]

        store.write(d, with_meta(store.read(d), set_fmt))
        got = await run(fetch, sc, "tok-acme", key(9, "acme"), ACME)
        if got[0] == "hit":
            assert got[2] == {"fmt": 1, "shape": [2, 8]}
        assert corruption_recorded(await events())

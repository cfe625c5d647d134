"""What a tier holds is authenticated: an edited, truncated, flipped or moved stored value is a
miss, never bytes on the wire, and the client's stream stays in step.

Attack (issue 14, "what got through" 6): the envelope around a sealed chunk (its length and
item metadata) sat outside the AEAD and was trusted at GET. Editing the length in a
filesystem-tier file made a GET reply announce fewer bytes than were then sent (the client took
a truncated prefix as a hit and the stream desynchronised); in Redis a larger length made the
reply promise bytes that never came. And a value that failed to open was a plain miss, neither
recorded nor dropped.

Here someone with write access to a tier (the memory tier's process, the filesystem tier's
directory, the Redis server) rewrites a stored value behind the sidecar's back, per tier: the
envelope's length shorter and longer, its metadata, its sealed flag, a ciphertext bit, its
tail cut off, the value moved to another key or another tenant, or put back in the old
unauthenticated format. For each: the GET is a miss in the middle of a GET frame whose other
keys come back byte for byte, the next GET on the same connection works, the corruption is
recorded (``kv:delete``, reason ``unreadable:<code>``), ``kvgov_dataplane_unreadable_total``
moves, and the entry is gone from the index and the tier.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from kvgov.connectors.tiers.filesystem import FilesystemTier
from kvgov.keys import sealformat
from kvgov.proxy.app import Sidecar, build_sidecar
from kvgov.proxy.dataplane.plans import INLINE_ALL
from kvgov.types import EventKind, Outcome
from kvgov.wire import RequestContext, WireClient
from tests.security import doors
from tests.security.doors import LmClient, engine, events, key, run

pytestmark = pytest.mark.postgres

MIB = 1 << 20
DEMO = RequestContext(request_id="env-demo", tenant="demo")
ACME = RequestContext(request_id="env-acme", tenant="acme")
META = {"fmt": 1, "dtype": "bfloat16", "shape": [2, 4, 16, 8]}
#: a value opened on the event loop, and one opened in the crypto pool (4 segments)
SIZES = [200_000, 3 * MIB + 11]
_PLAIN_LEN = slice(8, 16)  # the envelope head's plaintext length (u64, big-endian)


def _with_plain_len(value: bytes, delta: int) -> bytes:
    n = struct.unpack(">Q", value[_PLAIN_LEN])[0]
    return value[:8] + struct.pack(">Q", n + delta) + value[16:]


def _edit_meta(value: bytes) -> bytes:
    env = sealformat.parse(memoryview(value))
    edited = env.head.replace(b'"fmt":1', b'"fmt":2')  # same length: only the AEAD can tell
    assert edited != env.head
    return edited + value[len(env.head) :]


def _clear_sealed_flag(value: bytes) -> bytes:
    return value[:5] + bytes([value[5] & ~1]) + value[6:]


def _flip_ciphertext_bit(value: bytes) -> bytes:
    data = bytearray(value)
    data[len(data) // 2] ^= 0x01
    return bytes(data)


def _legacy(value: bytes) -> bytes:
    """The same sealed chunk in the format-1 envelope (JSON head with the length in it)."""
    env = sealformat.parse(memoryview(value))
    head = json.dumps({**env.meta, "_n": env.plain_len, "_sealed": True}).encode()
    return b"KVGE" + struct.pack("<I", len(head)) + head + bytes(env.body)


#: (name, edit of the stored value, expected error code); moves are below
EDITS: list[tuple[str, Callable[[bytes], bytes], str]] = [
    ("length shorter", lambda v: _with_plain_len(v, -100), "corrupt_value"),
    ("length longer", lambda v: _with_plain_len(v, +100), "corrupt_value"),
    ("metadata edited", _edit_meta, "seal_error"),
    ("sealed flag cleared", _clear_sealed_flag, "corrupt_value"),
    ("ciphertext bit flipped", _flip_ciphertext_bit, "seal_error"),
    ("tail cut off", lambda v: v[:-100], "seal_error"),
    ("format 1 envelope", _legacy, "seal_version"),
]


@asynccontextmanager
async def _sidecar(
    tmp_path: Path, db: doors.ProdDatabase, tier: str, request: pytest.FixtureRequest, **dp: Any
) -> AsyncIterator[Sidecar]:
    tiers: dict[str, Any] = {"chain": [tier]}
    if tier == "redis":
        tiers["redis_url"] = request.getfixturevalue("redis_url")
        tiers["redis_prefix"] = request.getfixturevalue("redis_prefix")
    sc = await build_sidecar(doors.tiered_settings(tmp_path, db, tiers, **dp))
    await sc.start()
    try:
        yield sc
    finally:
        await sc.stop()


class Rig:
    """A sidecar with one tier, an engine of demo and one of acme, and the attacker's hands on
    the tier."""

    def __init__(self, sc: Sidecar, tier: str) -> None:
        self.sc = sc
        self.tier = sc.tiers.tier(tier)
        self.demo: WireClient = engine(sc, "tok-demo")
        self.acme: WireClient = engine(sc, "tok-acme")

    def close(self) -> None:
        self.demo.close()
        self.acme.close()

    def digest(self, raw_key: str) -> str:
        return self.sc.pipeline.pseudonymizer.key_digest(raw_key)

    async def put(
        self, client: WireClient, raw_key: str, value: bytes, ctx: RequestContext
    ) -> None:
        ack = await run(client.put, raw_key, value, ctx, META)
        assert ack.ok, ack

    async def stored(self, raw_key: str) -> bytes:
        value = await self.tier.get(self.digest(raw_key))
        assert value is not None
        return value

    async def rewrite(self, raw_key: str, value: bytes) -> None:
        """The attacker's write, straight into the tier (the sidecar's index is unaware)."""
        await self.tier.put(self.digest(raw_key), value)

    def unreadable(self, code: str) -> float:
        registry = self.sc.pipeline.metrics.registry
        return registry.get_sample_value("kvgov_dataplane_unreadable_total", {"reason": code}) or 0

    async def assert_refused(
        self, what: str, bad: str, good: str, good_value: bytes, code: str
    ) -> None:
        before = self.unreadable(code)
        # one GET frame: the bad key between two good ones; all in step, byte for byte
        many = await run(self.demo.get_many, [good, bad, good], DEMO)
        got = [None if b is None else bytes(b) for _, b in many]
        assert got == [good_value, None, good_value], what
        # the same connection serves on
        again = await run(self.demo.get, good, DEMO)
        assert again is not None and again[0] == good_value, what
        assert await run(self.demo.get, bad, DEMO) is None, what
        # recorded, counted, dropped
        assert self.unreadable(code) == before + 1, what
        assert self.sc.pipeline.index.get(self.digest(bad)) is None, what
        assert await self.tier.get(self.digest(bad)) is None, what
        assert self.sc.writer is not None
        await self.sc.writer.flush()
        reasons = [
            e.reason
            for e in events(self.sc, EventKind.KV_DELETE)
            if e.key_digest == self.digest(bad) and e.outcome == Outcome.ERROR
        ]
        assert reasons == [f"unreadable:{code}"], what


TIERS = ["memory", "filesystem", pytest.param("redis", marks=pytest.mark.redis)]


@pytest.mark.parametrize("tier", TIERS)
async def test_every_edit_of_a_stored_value_is_a_recorded_miss(
    tmp_path: Path, prod_db: doors.ProdDatabase, tier: str, request: pytest.FixtureRequest
) -> None:
    async with _sidecar(tmp_path, prod_db, tier, request, inline_crypto_bytes=MIB) as sc:
        rig = Rig(sc, tier)
        try:
            chunk = 0x100
            for size in SIZES:
                good, good_value = key(chunk, "demo"), os.urandom(size)
                await rig.put(rig.demo, good, good_value, DEMO)
                chunk += 1
                for what, edit, code in EDITS:
                    bad = key(chunk, "demo")
                    chunk += 1
                    await rig.put(rig.demo, bad, os.urandom(size), DEMO)
                    await rig.rewrite(bad, edit(await rig.stored(bad)))
                    await rig.assert_refused(f"{what} ({size} B)", bad, good, good_value, code)

                # moved to another key of the same tenant
                src, dst = key(chunk, "demo"), key(chunk + 1, "demo")
                chunk += 2
                await rig.put(rig.demo, src, os.urandom(size), DEMO)
                await rig.put(rig.demo, dst, os.urandom(size), DEMO)
                await rig.rewrite(dst, await rig.stored(src))
                await rig.assert_refused(
                    f"moved key ({size} B)", dst, good, good_value, "seal_error"
                )

                # moved from another tenant (acme's chunk under demo's key)
                theirs, ours = key(chunk, "acme"), key(chunk + 1, "demo")
                chunk += 2
                await rig.put(rig.acme, theirs, os.urandom(size), ACME)
                await rig.put(rig.demo, ours, os.urandom(size), DEMO)
                await rig.rewrite(ours, await rig.stored(theirs))
                await rig.assert_refused(
                    f"moved tenant ({size} B)", ours, good, good_value, "seal_error"
                )
                # acme's own copy is untouched
                hit = await run(rig.acme.get, theirs, ACME)
                assert hit is not None
        finally:
            rig.close()


async def test_filesystem_file_edits_are_recorded_misses(
    tmp_path: Path, prod_db: doors.ProdDatabase, request: pytest.FixtureRequest
) -> None:
    """The issue's own repro: the bytes of a tier file edited in place (the tier file's length
    field, and the envelope's inside it), not through the tier's API."""
    async with _sidecar(tmp_path, prod_db, "filesystem", request) as sc:
        rig = Rig(sc, "filesystem")
        tier = rig.tier
        assert isinstance(tier, FilesystemTier)
        try:
            good, good_value = key(0x200, "demo"), os.urandom(300_000)
            await rig.put(rig.demo, good, good_value, DEMO)
            file_len = slice(16, 24)  # the tier file header's value length (u64, little-endian)
            for chunk, what in ((0x201, "file length"), (0x202, "envelope length")):
                bad = key(chunk, "demo")
                await rig.put(rig.demo, bad, os.urandom(300_000), DEMO)
                path = tier.path_of(rig.digest(bad))
                data = bytearray(path.read_bytes())
                if what == "file length":
                    n = struct.unpack("<Q", data[file_len])[0]
                    data[file_len] = struct.pack("<Q", n - 1000)
                    del data[-1000:]  # and the file cut to match: it parses
                else:
                    start = 24 + len(rig.digest(bad)) + _PLAIN_LEN.start
                    n = struct.unpack(">Q", data[start : start + 8])[0]
                    data[start : start + 8] = struct.pack(">Q", n - 1000)
                path.write_bytes(bytes(data))
                await rig.assert_refused(what, bad, good, good_value, "corrupt_value")
                assert not path.exists()
        finally:
            rig.close()


async def test_lm_stream_stays_usable_after_a_corrupt_value(
    tmp_path: Path, prod_db: doors.ProdDatabase, request: pytest.FixtureRequest
) -> None:
    """On ``lm://`` a refused value is a FAIL reply; the connection serves the next GET."""
    lm = {"lm_port": 0, "lm_engine_id": "lm-acme", "lm_tenants": ["acme"]}
    async with _sidecar(tmp_path, prod_db, "memory", request, **lm) as sc:
        assert sc.lm_server is not None and sc.lm_server.port is not None
        client = await run(LmClient, sc.lm_server.port)
        rig = Rig(sc, "memory")
        try:
            good, bad = key(0x300, "acme"), key(0x301, "acme")
            good_value = os.urandom(2 * MIB)
            await run(client.put, good, good_value)
            await run(client.put, bad, os.urandom(2 * MIB))
            assert await run(client.get, good) == good_value
            for what, edit, code in EDITS[:2]:
                before = rig.unreadable(code)
                await rig.rewrite(bad, edit(await rig.stored(bad)))
                assert await run(client.get, bad) is None, what
                assert await run(client.get, good) == good_value, what
                assert rig.unreadable(code) == before + 1, what
                await run(client.put, bad, os.urandom(2 * MIB))  # stored anew
                assert await run(client.exists, bad)
        finally:
            client.close()
            rig.close()


@pytest.mark.parametrize("inline", [MIB, INLINE_ALL], ids=["sender-thread", "event-loop"])
@pytest.mark.parametrize("late_miss", [True, False], ids=["late-miss", "without-feature"])
async def test_a_memory_hit_failing_as_it_is_sent_is_withdrawn_never_its_bytes(
    tmp_path: Path,
    prod_db: doors.ProdDatabase,
    request: pytest.FixtureRequest,
    late_miss: bool,
    inline: int,
) -> None:
    """A hit the memory tier lends is announced once its first segment is authenticated and
    the rest are opened as they are sent, to a client that agreed to ``late_miss``: a later
    segment found edited then goes out as zeros, never as its bytes, after the authenticated
    segments before it, and GET_END withdraws the hit; the frame's other hits are whole and
    the connection serves on. A client that did not agree gets every hit authenticated
    before the reply, so the same edit is a plain miss in the reply itself."""
    from kvgov.wire.codec import ErrorCode, FrameType

    async with _sidecar(tmp_path, prod_db, "memory", request, inline_crypto_bytes=inline) as sc:
        rig = Rig(sc, "memory")
        raw = doors.RawWire(sc.server.tcp_port)
        try:
            good, good_value = key(0x300, "demo"), os.urandom(3 * MIB + 11)
            bad, bad_value = key(0x301, "demo"), os.urandom(3 * MIB + 11)
            await rig.put(rig.demo, good, good_value, DEMO)
            await rig.put(rig.demo, bad, bad_value, DEMO)
            # the last segment's tag: segments 0-2 (1 MiB each) stay authentic
            await rig.rewrite(bad, _flip_last_byte(await rig.stored(bad)))
            features = ["late_miss"] if late_miss else []
            hello = await run(lambda: raw.hello("tok-demo", features=features))
            assert hello.meta["features"] == features

            def get(keys: list[str]) -> tuple[doors.Frame, doors.Frame | None]:
                raw.send(FrameType.GET, 7, {"keys": keys, "ctx": DEMO.to_meta()})
                reply = raw.read()
                return reply, raw.read() if reply.meta.get("tail") else None

            reply, end = await run(get, [good, bad, good])
            assert reply.type == FrameType.GET and reply.stream_id == 7
            codes = [item["code"] for item in reply.meta["items"]]
            if late_miss:
                assert codes == [0, 0, 0]
                n = len(good_value)
                assert reply.payload[:n] == good_value == reply.payload[2 * n :]
                assert reply.payload[n : 2 * n] == bad_value[: 3 * MIB] + bytes(11)
                assert end is not None and end.type == FrameType.GET_END
                assert end.stream_id == 7 and end.meta == {"missed": [1]}
            else:
                assert codes == [0, ErrorCode.NOT_FOUND, 0] and end is None
                assert reply.payload == good_value + good_value
            # recorded, counted, dropped; the connection serves on
            assert rig.unreadable("seal_error") == 1
            assert sc.pipeline.index.get(rig.digest(bad)) is None
            again, _ = await run(get, [good])
            assert again.payload == good_value
        finally:
            raw.close()
            rig.close()


def _flip_last_byte(value: bytes) -> bytes:
    return value[:-1] + bytes([value[-1] ^ 0x5A])

"""The sidecar on every tier, over real sockets: memory, filesystem, Redis and the memory ->
filesystem chain (promotion after a memory miss), byte for byte, with no plaintext at rest.

Also the sidecar's control side: EVICT sent to a wire client registered as an engine comes back
as EVICT_ACK in ``Sidecar.evict_on_engines``' result, and the heartbeat task keeps
``sidecars.last_seen_at`` fresh. Real Postgres ledger, real Rego policy, real keyring, real
files and a real Redis.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from kvgov.config import Settings
from kvgov.connectors.tiers.memory import MemoryTier
from kvgov.db.models import LedgerEvent
from kvgov.db.models import Sidecar as SidecarRow
from kvgov.proxy.app import Sidecar
from kvgov.types import EventKind
from kvgov.wire import EvictRequest, RequestContext, WireClient
from kvgov.wire.codec import FrameType, decode_header, encode_frame
from tests.integration.live import loopback_settings, start_sidecar

pytestmark = pytest.mark.postgres

T = TypeVar("T")
MIB = 1 << 20
#: recognisable plaintext; any 23-byte window of it found at rest means plaintext leaked
PATTERN = b"KVGOV-PLAINTEXT-PATTERN"
#: long enough that it cannot turn up in ciphertext by chance
USER = "user-7f3a9c2e41d05b86"


def _key(h: str, tenant: str = "demo", user: str | None = USER) -> str:
    key = f"meta-llama/Llama-3.1-8B@1@0@{h}@bfloat16@tenant%{tenant}"
    return key + (f"@user%{user}" if user else "")


def _values() -> dict[str, bytes]:
    """Sizes around the 1 MiB sealing segment: one byte, exactly one segment, several."""
    return {
        "a1": PATTERN[:1],
        "b2": (PATTERN * (MIB // len(PATTERN) + 1))[:MIB],
        "c3": PATTERN * ((3 * MIB + 7) // len(PATTERN)) + os.urandom(11),
        "d4": os.urandom(4096),
    }


def _settings(tmp: Path, pg_url: str, tiers: dict[str, Any], **extra: Any) -> Settings:
    return loopback_settings(
        tmp / "data", pg_url, tiers={"filesystem_fsync": False, **tiers}, **extra
    )


Starter = Callable[[Settings], Awaitable[Sidecar]]


@pytest.fixture
async def start() -> AsyncIterator[Starter]:
    """Start sidecars; stop what is still running afterwards."""
    running: list[Sidecar] = []

    async def _start(settings: Settings) -> Sidecar:
        sidecar = await start_sidecar(settings)
        running.append(sidecar)
        return sidecar

    yield _start
    for sidecar in running:
        if sidecar.ready:
            await sidecar.stop()
    running.clear()


async def _run(fn: Callable[..., T], *args: Any) -> T:
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


def _client(sc: Sidecar, engine: str = "vllm-demo-0") -> WireClient:
    return WireClient(f"tcp://127.0.0.1:{sc.server.tcp_port}", engine_id=engine, timeout=10)


def _count(sc: Sidecar, kind: EventKind) -> int:
    with Session(sc.engine) as s:
        stmt = select(func.count()).select_from(LedgerEvent).where(LedgerEvent.kind == kind)
        return int(s.scalar(stmt) or 0)


def _assert_no_plaintext(blobs: dict[str, bytes], values: dict[str, bytes]) -> None:
    """No blob at rest holds the pattern, a random value's bytes, the raw key or the user id."""
    assert blobs, "nothing was stored"
    needles = [PATTERN, USER.encode(), b"Llama-3.1-8B"]
    needles += [v[:64] for v in values.values() if len(v) >= 64 and PATTERN not in v]
    for where, blob in blobs.items():
        for needle in needles:
            assert needle not in blob, f"plaintext {needle[:16]!r} found in {where}"


def _files(root: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _redis_values(url: str, prefix: str) -> dict[str, bytes]:
    import redis

    client = redis.Redis.from_url(url)
    try:
        out: dict[str, bytes] = {}
        for k in client.scan_iter(match=prefix + "*", count=1000):
            value = client.get(k)
            if value is not None:
                out[k.decode()] = bytes(value)
        return out
    finally:
        client.close()


CHAINS = [
    pytest.param(["memory"], id="memory"),
    pytest.param(["filesystem"], id="filesystem"),
    pytest.param(["redis"], id="redis", marks=pytest.mark.redis),
    pytest.param(["memory", "filesystem"], id="memory+filesystem"),
]


@pytest.mark.parametrize("chain", CHAINS)
async def test_round_trip_on_every_tier(
    chain: list[str], tmp_path: Path, pg_url: str, start: Starter, request: pytest.FixtureRequest
) -> None:
    tiers: dict[str, Any] = {"chain": chain}
    if "redis" in chain:
        tiers["redis_url"] = request.getfixturevalue("redis_url")
        tiers["redis_prefix"] = request.getfixturevalue("redis_prefix")
    settings = _settings(tmp_path, pg_url, tiers)
    sc = await start(settings)
    values = _values()
    ctx = RequestContext(request_id="req-tiers", user=USER)
    client = _client(sc)
    try:
        acks = await _run(
            lambda: client.put_many([(_key(h), v, {"h": h}) for h, v in values.items()], ctx)
        )
        assert [a.ok for a in acks] == [True] * len(values)
        # every configured tier holds every value (write-through)
        for h in values:
            digest = sc.pipeline.pseudonymizer.key_digest(_key(h))
            assert await sc.tiers.where(digest) == chain
        if "memory" in chain:  # large values are sealed straight into the tier's own buffer
            memory = sc.tiers.tier("memory")
            assert isinstance(memory, MemoryTier)
            assert memory.reserved_bytes == 0
            held = {}
            for h in values:
                value = await memory.get(sc.pipeline.pseudonymizer.key_digest(_key(h)))
                assert value is not None
                held[h] = value
            _assert_no_plaintext(held, values)
        for h, v in values.items():
            buf = bytearray(len(v) + 13)
            hit = await _run(client.get_into, _key(h), buf, ctx)
            assert hit is not None
            assert hit.length == len(v)
            assert hit.meta == {"h": h}
            assert bytes(buf[: hit.length]) == v
        many = await _run(client.get_many, [_key(h) for h in values], ctx)
        assert [bytes(b) for _, b in many] == list(values.values())
        assert await _run(client.exists_many, [_key("a1"), _key("ff")], ctx) == [True, False]
        assert sc.writer is not None
        await sc.writer.flush()
        assert _count(sc, EventKind.KV_PUT) == len(values)
        assert _count(sc, EventKind.KV_GET) == 2 * len(values)
        assert _count(sc, EventKind.KV_EXISTS) == 2
    finally:
        client.close()
        await sc.stop()
    if "filesystem" in chain:
        _assert_no_plaintext(_files(settings.filesystem_tier_path), values)
    if "redis" in chain:
        _assert_no_plaintext(_redis_values(tiers["redis_url"], tiers["redis_prefix"]), values)


async def test_chain_promotes_after_a_memory_miss(
    tmp_path: Path, pg_url: str, start: Starter
) -> None:
    settings = _settings(tmp_path, pg_url, {"chain": ["memory", "filesystem"]})
    sc = await start(settings)
    ctx = RequestContext(user=USER)
    data = PATTERN * 100_000 + os.urandom(5)
    digest = sc.pipeline.pseudonymizer.key_digest(_key("e5"))
    client = _client(sc)
    try:
        assert (await _run(client.put, _key("e5"), data, ctx)).ok
        memory = sc.tiers.tier("memory")
        assert await memory.delete(digest)  # the memory tier forgets it (think: LRU eviction)
        assert await sc.tiers.where(digest) == ["filesystem"]
        at_rest = await sc.tiers.tier("filesystem").get(digest)
        hit = await _run(client.get, _key("e5"), ctx)  # served from disk ...
        assert hit is not None
        assert hit[0] == data
        assert await sc.tiers.where(digest) == ["memory", "filesystem"]  # ... and promoted
        assert await memory.get(digest) == at_rest  # the ciphertext, as it was on disk
        hit = await _run(client.get, _key("e5"), ctx)  # now a memory hit, same bytes
        assert hit is not None
        assert hit[0] == data
    finally:
        client.close()
        await sc.stop()
    _assert_no_plaintext(_files(settings.filesystem_tier_path), {"e5": data})


# -- the control connection: EVICT / EVICT_ACK --------------------------------------------------


async def test_evict_reaches_a_registered_engine_and_its_ack_comes_back(
    tmp_path: Path, pg_url: str, start: Starter
) -> None:
    sc = await start(_settings(tmp_path, pg_url, {"chain": ["memory"]}))
    client = _client(sc, engine="vllm-demo-7")
    received: list[EvictRequest] = []
    lock = threading.Lock()

    def on_evict(request: EvictRequest) -> list[str]:
        with lock:
            received.append(request)
        # the engine holds only the first key: it finds it by the digest the sidecar named
        return [digest for _key_, digest in request.matching([_key("aa"), _key("zz")])]

    channel = client.control(on_evict, reconnect_delay=0.1)
    silent: socket.socket | None = None
    try:
        ctx = RequestContext(user=USER)
        acks = await _run(lambda: client.put_many([(_key("aa"), b"x"), (_key("bb"), b"y")], ctx))
        assert all(a.ok for a in acks)
        assert await _run(channel.connected.wait, 10)
        digests = [sc.pipeline.pseudonymizer.key_digest(_key(h)) for h in ("aa", "bb")]
        results = await sc.evict_on_engines(digests, 5.0, tenant="demo")
        assert len(results) == 1
        assert results[0].engine == "vllm-demo-7"
        assert results[0].acked is True
        assert results[0].removed == 1
        assert results[0].error is None
        assert received[0].digests == set(digests)  # digests, never raw keys
        assert channel.evictions == 1

        # digests of entries nobody holds: acknowledged, nothing removed
        results = await sc.evict_on_engines(["0" * 64, "f" * 64], 5.0, tenant="demo")
        assert [(r.engine, r.acked, r.removed, r.error) for r in results] == [
            ("vllm-demo-7", True, 0, None)
        ]

        # a control connection that never answers: not acked, the others are still reported
        port = sc.server.tcp_port
        assert port is not None
        silent = socket.create_connection(("127.0.0.1", port))
        hello = {"version": 1, "engine": "vllm-mute", "role": "control"}
        silent.sendall(encode_frame(FrameType.HELLO, 1, hello))
        silent.settimeout(5)
        head = decode_header(await _run(silent.recv, 24))
        assert head.type is FrameType.HELLO
        await _run(silent.recv, head.meta_len)
        results = await sc.evict_on_engines(digests[:1], 0.5, tenant="demo")
        by_engine = {r.engine: r for r in results}
        assert by_engine["vllm-demo-7"].acked is True
        assert by_engine["vllm-mute"].acked is False
        assert by_engine["vllm-mute"].error == "TimeoutError"
    finally:
        if silent is not None:
            silent.close()
        channel.close()
        client.close()


# -- heartbeat --------------------------------------------------------------------------------


def _last_seen(sc: Sidecar) -> float:
    with Session(sc.engine) as s:
        row = s.get(SidecarRow, sc.sidecar_id)
        assert row is not None
        return row.last_seen_at.timestamp()


async def test_heartbeat_refreshes_last_seen_at(
    tmp_path: Path, pg_url: str, start: Starter
) -> None:
    # the purge executor beats only at start with a one-minute poll: what moves is the heartbeat
    settings = _settings(
        tmp_path,
        pg_url,
        {"chain": ["memory"]},
        purge={"sidecar_live_s": 0.4, "poll_interval_s": 60.0},
    )
    sc = await start(settings)
    first = await _run(_last_seen, sc)
    deadline = time.monotonic() + 10
    while await _run(_last_seen, sc) <= first:
        assert time.monotonic() < deadline, "last_seen_at never moved"
        await asyncio.sleep(0.05)

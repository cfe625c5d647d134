"""Pipelined puts, unrecordable puts and capacity evictions, over real sockets against a real
sidecar (Postgres ledger, Rego policy, keyring, memory tier)."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from kvgov.errors import LedgerError
from kvgov.ledger.events import Appended, Event, EventSink
from kvgov.proxy.app import Sidecar
from kvgov.types import EntryState, EventKind
from kvgov.wire import ErrorCode, RequestContext, WireClient
from tests.integration.live import loopback_settings, start_sidecar

pytestmark = pytest.mark.postgres

MIB = 1 << 20
CTX = RequestContext(request_id="req-pipe", user="u42")


def _key(h: str, user: str | None = "u42") -> str:
    key = f"meta-llama/Llama-3.1-8B@1@0@{h}@bfloat16@tenant%demo"
    return key + (f"@user%{user}" if user else "")


async def _start(tmp: Path, pg_url: str, *, memory_mib: int = 64) -> Sidecar:
    return await start_sidecar(
        loopback_settings(
            tmp / "data",
            pg_url,
            lm=True,
            tiers={"chain": ["memory"], "memory_max_bytes": memory_mib * MIB},
        )
    )


@pytest.fixture
async def sidecar(tmp_path: Path, pg_url: str) -> AsyncIterator[Sidecar]:
    sc = await _start(tmp_path, pg_url)
    try:
        yield sc
    finally:
        await sc.stop()


def _client(sc: Sidecar) -> WireClient:
    return WireClient(f"tcp://127.0.0.1:{sc.server.tcp_port}", engine_id="vllm-0", timeout=10)


async def _run(fn, *args):  # type: ignore[no-untyped-def]
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


def _events(sc: Sidecar, kind: EventKind) -> int:
    from kvgov.db.models import LedgerEvent

    with Session(sc.engine) as s:
        query = select(func.count()).select_from(LedgerEvent).where(LedgerEvent.kind == kind)
        return int(s.scalar(query) or 0)


def _entry_state(sc: Sidecar, digest: str) -> EntryState | None:
    from kvgov.db.models import CacheEntry

    with Session(sc.engine) as s:
        row = s.get(CacheEntry, digest)
        return None if row is None else row.state


async def test_pipelined_puts_ack_in_order_and_round_trip(sidecar: Sidecar) -> None:
    """Many PUT frames in flight on one connection: one ack per item, in order, every value
    stored byte for byte (multi-segment ones too), and a key put twice keeps the first value:
    the second is acknowledged without rewriting it (cached bytes are immutable while live)."""
    values = {f"{i:016x}": os.urandom((i % 3) * MIB + 1000 * i + 1) for i in range(12)}
    items = [(_key(h), v) for h, v in values.items()]
    items.append((_key(f"{3:016x}"), os.urandom(MIB + 7)))  # in flight or stored: kept
    client = _client(sidecar)
    try:
        acks = await _run(lambda: client.put_stream(items, CTX, depth=8))
        assert [a.key for a in acks] == [k for k, _ in items]
        assert all(a.ok for a in acks)
        for h, value in values.items():
            got = await _run(client.get, _key(h), CTX)
            assert got is not None
            assert got[0] == value
    finally:
        client.close()
    assert sidecar.writer is not None
    await sidecar.writer.flush()
    assert _events(sidecar, EventKind.KV_PUT) == len(items) - 1
    assert _events(sidecar, EventKind.KV_PUT_KEPT) == 1


class RefusePuts:
    """Fault-injection stand-in for a database that refuses ``kv:put`` rows: the real writer
    records every other event; ``kv:put`` events fail as a refused batch would."""

    def __init__(self, inner: EventSink) -> None:
        self.inner = inner

    def submit(self, event: Event) -> asyncio.Future[Appended]:
        if event.kind is EventKind.KV_PUT:
            fut: asyncio.Future[Appended] = asyncio.get_running_loop().create_future()
            fut.set_exception(LedgerError("event refused by the database (injected)"))
            return fut
        return self.inner.submit(event)

    async def append(self, event: Event) -> Appended:
        return await self.submit(event)


async def test_unrecordable_put_is_not_left_in_the_tiers(sidecar: Sidecar) -> None:
    pipeline = sidecar.pipeline
    assert pipeline.sink is not None
    pipeline.sink = RefusePuts(pipeline.sink)
    client = _client(sidecar)
    key = _key("00000000000000aa")
    digest = pipeline.pseudonymizer.key_digest(key)
    try:
        ack = await _run(client.put, key, os.urandom(MIB + 3), CTX)
        assert ack.error is ErrorCode.INTERNAL
        assert await _run(client.get, key, CTX) is None
    finally:
        client.close()
    assert pipeline.index.get(digest) is None
    assert not await pipeline.tiers.contains(digest)


async def test_unrecordable_lm_put_is_removed(sidecar: Sidecar) -> None:
    pipeline = sidecar.pipeline
    assert pipeline.sink is not None and sidecar.lm_server is not None
    pipeline.sink = RefusePuts(pipeline.sink)
    port = sidecar.lm_server.port
    key = _key("00000000000000bb", user=None)
    raw = key.encode().ljust(150)  # as LMCache pads it
    req = struct.Struct("=iiiiiiiii150s")

    def put() -> None:
        data = os.urandom(MIB)
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(req.pack(1, len(data), 1, 3, 0, 2, 4, 256, 128, raw) + data)
            s.sendall(req.pack(5, 0, 0, 0, 0, 0, 0, 0, 0, b"".ljust(150)))  # HEALTH: processed
            assert struct.unpack("=iiiiiiiii", s.recv(36))[0] == 200

    await _run(put)
    digest = pipeline.pseudonymizer.key_digest(key)
    for _ in range(200):  # the record fails in the background, shortly after the store
        if not await pipeline.tiers.contains(digest):
            break
        await asyncio.sleep(0.01)
    assert not await pipeline.tiers.contains(digest)
    assert pipeline.index.get(digest) is None


async def test_memory_evictions_are_recorded(tmp_path: Path, pg_url: str) -> None:
    sc = await _start(tmp_path, pg_url, memory_mib=4)
    client = _client(sc)
    keys = [_key(f"{i:016x}") for i in range(6)]
    try:
        for key in keys:  # ~1 MiB sealed each: a 4 MiB tier keeps the last three or so
            ack = await _run(client.put, key, os.urandom(MIB - 4096), CTX)
            assert ack.ok
        assert await _run(client.get, keys[-1], CTX) is not None
        assert await _run(client.get, keys[0], CTX) is None  # evicted: a miss
        assert sc.writer is not None
        await sc.writer.flush()
        evicted = _events(sc, EventKind.KV_EVICT)
        assert evicted >= 2
        first = sc.pipeline.pseudonymizer.key_digest(keys[0])
        assert sc.pipeline.index.get(first) is None
        assert _entry_state(sc, first) is EntryState.DELETED
        last = sc.pipeline.pseudonymizer.key_digest(keys[-1])
        assert _entry_state(sc, last) is EntryState.LIVE
    finally:
        client.close()
        await sc.stop()

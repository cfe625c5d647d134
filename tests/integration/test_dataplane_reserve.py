"""Puts sealed straight into the memory tier's buffer, under memory pressure, over real sockets
against a real sidecar (Postgres ledger, Rego policy, keyring): more concurrent puts than the
tier has room for. A put whose reservation is refused (the room is all set aside for puts in
progress) is stored by copy, evicting as a put does; nothing is lost that was acknowledged
and still fits, no reservation outlives its put, the tier never holds more than its bound,
and every eviction is in the ledger."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from kvgov.connectors.tiers.memory import MemoryTier
from kvgov.db.models import LedgerEvent
from kvgov.proxy.app import Sidecar
from kvgov.types import EventKind
from kvgov.wire import RequestContext, WireClient
from tests.integration.live import loopback_settings, running_sidecar

pytestmark = pytest.mark.postgres

MIB = 1 << 20
TIER = 12 * MIB  # two sealed 4 MiB chunks: fewer than the puts in progress
CLIENTS = 6
PUTS = 4
CTX = RequestContext(request_id="req-reserve", user="u3")


def _key(client: int, i: int) -> str:
    return f"meta-llama/Llama-3.1-8B@1@0@{client:04x}{i:04x}@bfloat16@tenant%demo@user%u3"


@pytest.fixture
async def sidecar(tmp_path: Path, pg_url: str) -> AsyncIterator[Sidecar]:
    settings = loopback_settings(
        tmp_path / "data",
        pg_url,
        pool_mib=128,
        tiers={"chain": ["memory"], "memory_max_bytes": TIER},
    )
    async with running_sidecar(settings) as sc:
        yield sc


def _put_all(port: int, values: dict[str, bytes], errors: list[str]) -> None:
    barrier = threading.Barrier(CLIENTS)

    def one(c: int) -> None:
        with WireClient(f"tcp://127.0.0.1:{port}", engine_id=f"e{c}", timeout=30) as client:
            client.hello()
            barrier.wait()
            for i in range(PUTS):
                key = _key(c, i)
                if not client.put(key, values[key], CTX).ok:
                    errors.append(f"put {key} refused")

    threads = [threading.Thread(target=one, args=(c,)) for c in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if any(t.is_alive() for t in threads):
        errors.append("a client is stuck")


async def test_more_concurrent_puts_than_the_tier_holds(sidecar: Sidecar) -> None:
    port = sidecar.server.tcp_port
    assert port is not None
    memory = sidecar.tiers.tier("memory")
    assert isinstance(memory, MemoryTier)
    values = {_key(c, i): os.urandom(4 * MIB) for c in range(CLIENTS) for i in range(PUTS)}
    errors: list[str] = []
    await asyncio.to_thread(_put_all, port, values, errors)
    assert errors == []

    assert memory.reserved_bytes == 0
    stats = await memory.stats()
    assert stats.bytes + memory.pooled_bytes <= TIER
    assert stats.evictions >= len(values) - TIER // (4 * MIB)  # most had to go
    assert sidecar.pipeline.pool.in_use_bytes == 0

    # what is still held reads back byte for byte; what was evicted is a clean miss
    with WireClient(f"tcp://127.0.0.1:{port}", engine_id="reader", timeout=30) as client:
        hits = 0
        for key, value in values.items():
            got = await asyncio.to_thread(client.get, key, CTX)
            if got is not None:
                assert got[0] == value
                hits += 1
    assert hits == stats.entries > 0

    assert sidecar.writer is not None
    await sidecar.writer.flush()
    with Session(sidecar.engine) as s:

        def count(kind: EventKind) -> int:
            stmt = select(func.count()).select_from(LedgerEvent).where(LedgerEvent.kind == kind)
            return int(s.scalar(stmt) or 0)

        assert count(EventKind.KV_PUT) == len(values)
        assert count(EventKind.KV_EVICT) == stats.evictions

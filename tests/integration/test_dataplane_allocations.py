"""A governed sidecar in its steady state (Postgres ledger, Rego policy, keyring; its memory
tier full, so each put evicts the oldest entry and reuses its buffer) allocates nothing
chunk-sized per put or get: a put is received into a pooled lease and sealed into the tier's
recycled buffer, a get is opened from the tier's buffer into a pooled lease and sent from it.
A ``bytes(view)`` of a chunk anywhere on either path would show here as a peak of a chunk's
size (the client, in this process too, writes from and reads into buffers it made first)."""

from __future__ import annotations

import asyncio
import os
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvgov.proxy.app import Sidecar
from kvgov.wire import RequestContext, WireClient
from tests.integration.live import loopback_settings, running_sidecar

pytestmark = pytest.mark.postgres

MIB = 1 << 20
CHUNK = 4 * MIB
TIER = 8 * (CHUNK + MIB)  # eight sealed chunks and room to spare, not nine
CTX = RequestContext(request_id="req-alloc", user="u5")


def _key(run: int, i: int) -> str:
    return f"meta-llama/Llama-3.1-8B@1@0@{run:04x}{i:04x}@bfloat16@tenant%demo@user%u5"


@pytest.fixture
async def sidecar(tmp_path: Path, pg_url: str) -> AsyncIterator[Sidecar]:
    settings = loopback_settings(
        tmp_path / "data", pg_url, tiers={"chain": ["memory"], "memory_max_bytes": TIER}
    )
    async with running_sidecar(settings) as sc:
        yield sc


def _traffic(port: int, data: bytes, dst: memoryview, run: int, n: int) -> list[str]:
    errors: list[str] = []
    with WireClient(f"tcp://127.0.0.1:{port}", engine_id="e-alloc", timeout=30) as client:
        for i in range(n):
            if not client.put(_key(run, i), data, CTX).ok:
                errors.append(f"put {i} refused")
            got = client.get_into(_key(run, i), dst, CTX)
            if got is None or got.length != len(data) or dst[: len(data)] != data:
                errors.append(f"get {i} missed or differed")
    return errors


async def test_steady_state_governed_puts_and_gets_allocate_nothing_chunk_sized(
    sidecar: Sidecar,
) -> None:
    port = sidecar.server.tcp_port
    assert port is not None
    data = os.urandom(CHUNK)
    dst = memoryview(bytearray(CHUNK))
    # fill the tier (every buffer it will recycle exists), warm policy, keys and buffers
    assert await asyncio.to_thread(_traffic, port, data, dst, 0, 12) == []
    tracemalloc.start()
    try:
        errors = await asyncio.to_thread(_traffic, port, data, dst, 1, 16)
        _now, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert errors == []
    assert peak < CHUNK // 4, f"peak {peak} bytes traced over 16 puts and 16 gets"
    stats = await sidecar.tiers.tier("memory").stats()
    assert stats.evictions >= 16  # the measured puts each displaced an entry

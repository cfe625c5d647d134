"""The buffer pool never lets connections hold part of it while waiting for the rest.

A multi-item PUT frame (and a batched GET) takes all its buffers at once
(``BufferPool.acquire_many``). Before, each item took its buffer as it came: several
connections each holding one buffer of their frame and waiting for a second one waited for
each other for ever. Real sockets, a real sidecar (Postgres ledger, Rego policy, keyring,
memory tier) with a 16 MiB pool; every frame alone fits, together they do not.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvgov.config import Settings
from kvgov.proxy.app import Sidecar
from kvgov.proxy.dataplane.buffers import BufferPool, size_class
from kvgov.wire import RequestContext, WireClient
from tests.integration.live import running_sidecar

MIB = 1 << 20
POOL = 16 * MIB
#: a 5 MiB item takes a 6 MiB buffer once sealed: two per frame (12 MiB) fit the pool, while
#: three connections holding one each (18 MiB) would not
ITEM = 5 * MIB
CTX = RequestContext(request_id="req-pool", user="u7")


def _key(conn: int, item: int, rnd: int) -> str:
    return f"m@1@0@{conn:04x}{item:04x}{rnd:08x}@bfloat16@tenant%demo@user%u7"


@pytest.fixture
async def sidecar(tmp_path: Path, pg_url: str) -> AsyncIterator[Sidecar]:
    settings = Settings(
        data_dir=tmp_path / "data",
        database={"url": pg_url},
        dataplane={
            "host": "127.0.0.1",
            "port": 0,
            "lm_port": -1,
            "buffer_pool_bytes": POOL,
            # one engine may use the whole pool here (tests/security: the share)
            "buffer_pool_engine_share": 1.0,
        },
        tiers={"chain": ["memory"], "memory_max_bytes": 256 * MIB},
    )
    async with running_sidecar(settings) as sc:
        yield sc


def _run_together(port: int, work: list[list[tuple[str, bytes]]], gets: bool) -> list[object]:
    """One connection per item list, started together; each sends ONE frame with its items."""
    barrier = threading.Barrier(len(work))
    out: list[object] = [None] * len(work)

    def one(i: int) -> None:
        with WireClient(f"tcp://127.0.0.1:{port}", engine_id=f"e{i}", timeout=20) as c:
            c.hello()
            barrier.wait()
            if gets:
                out[i] = c.get_many([k for k, _ in work[i]], CTX)
            else:
                out[i] = c.put_many(work[i], CTX)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(work))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a connection is stuck"
    return out


@pytest.mark.postgres
async def test_concurrent_batched_puts_and_gets_beyond_the_pool_complete(
    sidecar: Sidecar,
) -> None:
    assert sidecar.server.tcp_port is not None
    pool = sidecar.pipeline.pool
    assert pool.max_bytes == POOL
    assert 2 * sidecar.pipeline.lease_bound(ITEM, {}) <= POOL < 3 * size_class(ITEM + 1)
    port = sidecar.server.tcp_port
    for rnd in range(3):
        work = [[(_key(c, i, rnd), os.urandom(ITEM)) for i in range(2)] for c in range(3)]
        acks = await asyncio.to_thread(_run_together, port, work, False)
        for frame in acks:
            assert isinstance(frame, list) and all(a.ok for a in frame)
        got = await asyncio.to_thread(_run_together, port, work, True)
        for items, frame in zip(work, got, strict=True):
            assert isinstance(frame, list)
            assert [bytes(v) for _, v in frame] == [v for _, v in items]
    # a hit's buffer is released once its sender thread's job is back on the loop, which can
    # be just after the client has read the last byte
    for _ in range(500):
        if pool.in_use_bytes == 0:
            break
        await asyncio.sleep(0.01)
    assert pool.in_use_bytes == 0


async def test_acquire_many_takes_all_or_waits_in_order() -> None:
    pool = BufferPool(8 * MIB)
    first = await pool.acquire(4 * MIB)
    both = asyncio.create_task(pool.acquire_many([4 * MIB, 4 * MIB]))
    await asyncio.sleep(0)
    later = asyncio.create_task(pool.acquire(MIB))  # fits now, but waits its turn
    await asyncio.sleep(0.01)
    assert not both.done() and not later.done()
    assert pool.in_use_bytes == 4 * MIB  # the waiter holds nothing meanwhile
    first.release()
    leases = await asyncio.wait_for(both, 5)
    assert [lease.view.nbytes for lease in leases] == [4 * MIB, 4 * MIB]
    assert not later.done()
    for lease in leases:
        lease.release()
    small = await asyncio.wait_for(later, 5)
    assert small.view.nbytes == MIB
    small.release()
    with pytest.raises(Exception, match="do not fit"):
        await pool.acquire_many([6 * MIB, 4 * MIB])

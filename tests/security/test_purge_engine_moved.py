"""An engine that moved between sidecars is reached by the one it is connected to now.

Attack (no attacker needed, an honest receipt): engine vllm-acme stored alice's chunk through
sidecar A (A's chain has its ``kv:put``), then moved to sidecar B (a reschedule, a rollout).
At alice's purge, ``engines@A`` must answer for it and finds no control connection: it names it
``unreachable``. ``engines@B`` sends it the EVICT (it held acme's data somewhere) and it
acknowledges. The receipt said ``incomplete``, naming vllm-acme unreachable and acknowledged at
once, although the engine evicted.

Now an ACK of another ``engines@T`` step of the same job counts for ``engines@S`` when it
covered the same digests (the chained summaries carry a hash of the digests each step sent):
the engine is not named unreachable and the receipt is ``completed``. An engine no step
reached is still named.
"""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import pytest

from kvgov.db.purge_views import JobView, PurgeRequest
from kvgov.proxy.app import Sidecar
from kvgov.types import PurgeState
from kvgov.wire import EvictRequest, RequestContext
from tests.security import doors
from tests.security.doors import engine, key, run

pytestmark = pytest.mark.postgres


class LocalTier:
    """The engine's local CPU tier: what its EVICT callback removes from."""

    def __init__(self) -> None:
        self.chunks: dict[str, bytes] = {}
        self.lock = threading.Lock()

    def on_evict(self, request: EvictRequest) -> list[str]:
        with self.lock:
            gone = request.matching(list(self.chunks))
            for raw, _ in gone:
                self.chunks.pop(raw)
            return [d for _, d in gone]


async def _store_through(sc: Sidecar, local: LocalTier, chunk: int) -> str:
    """vllm-acme stores a chunk of alice through ``sc`` and keeps it locally too."""
    acme = engine(sc, "tok-acme")
    try:
        raw = key(chunk, "acme", user="alice")
        value = os.urandom(4096)
        ctx = RequestContext(request_id=f"r-{chunk:x}", tenant="acme", user="alice")
        assert (await run(acme.put, raw, value, ctx)).ok
        local.chunks[raw] = value
        return raw
    finally:
        acme.close()


async def _purge_alice(sc: Sidecar) -> JobView:
    assert sc.purge is not None
    service = sc.purge.service
    job = await service.create(PurgeRequest(tenant="acme", user="alice", requested_by="test"))
    return await asyncio.wait_for(service.wait(job.id), 60)


async def test_an_engine_acknowledged_by_its_new_sidecar_is_not_named_unreachable(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    async with (
        doors.sidecar(tmp_path / "a", prod_db) as a,
        doors.sidecar(tmp_path / "b", prod_db) as b,
    ):
        assert a.sidecar_id != b.sidecar_id
        local = LocalTier()
        raw = await _store_through(a, local, 0xF1)  # it held alice's chunk through A ...
        acme = engine(b, "tok-acme")  # ... and now its control channel is B's
        channel = acme.control(local.on_evict, reconnect_delay=0.1)
        try:
            assert await run(channel.connected.wait, 10)
            job = await _purge_alice(a)
        finally:
            channel.close()
            acme.close()
        receipt = doors.receipt(job)
        assert raw not in local.chunks  # B's EVICT reached its local tier
        assert receipt["engines"]["acknowledged"] == ["vllm-acme"]
        assert receipt["engines"]["unreachable"] == [], (
            f"receipt {receipt['state']} names vllm-acme unreachable "
            f"({receipt['engines']['unreachable']}) although engines@{b.sidecar_id} sent it the "
            "same digests and it acknowledged"
        )
        assert job.state is PurgeState.COMPLETED, receipt["incomplete"]
        assert receipt["incomplete"] == []
        # the steps' own rows keep what each saw: A's still names the engine
        steps = {s.label: s for s in job.steps}
        assert steps[f"engines@{a.sidecar_id}"].state is PurgeState.INCOMPLETE
        assert steps[f"engines@{b.sidecar_id}"].state is PurgeState.COMPLETED


async def test_an_engine_no_sidecar_reached_is_still_named_unreachable(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    """Control: the engine held alice's chunk through A and is connected nowhere now."""
    async with (
        doors.sidecar(tmp_path / "a", prod_db) as a,
        doors.sidecar(tmp_path / "b", prod_db) as b,
    ):
        assert a.sidecar_id != b.sidecar_id
        local = LocalTier()
        raw = await _store_through(a, local, 0xF2)
        job = await _purge_alice(a)
        receipt = doors.receipt(job)
        assert raw in local.chunks
        assert job.state is PurgeState.INCOMPLETE
        assert receipt["engines"]["acknowledged"] == []
        assert [u["engine"] for u in receipt["engines"]["unreachable"]] == ["vllm-acme"]

"""A purge names every engine it could not reach (review r10, F1).

Attack: an engine that stored the purged user's chunk, and keeps a copy in its local CPU/disk
tier, has no control connection while ``engines@S`` runs (it is reconnecting or restarting, a
network blip, ``control: false``). EVICT went only to the control connections open at that
moment, so the engine was sent nothing and named nowhere: ``engines@S`` ended ``completed``
with ``acknowledged=[]`` and ``unreachable=[]``, and the signed receipt said ``completed``
while the engine kept (and served) the user's chunks. The ``lm://`` engine, which has no
control channel at all, was never named either.

Now every engine the ledger saw store or read the tenant's data through this sidecar (its
chain) and that got no EVICT is named under ``unreachable`` (``no_control_connection``; the
``lm://`` engine ``no_control_channel``) and the purge is ``incomplete``. An engine whose
channel is up is still acknowledged and the purge ``completed`` (no false ``incomplete``).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.orm import Session

from kvgov.services.purge import scope
from kvgov.types import PurgeState
from kvgov.wire import EvictRequest, RequestContext
from tests.security import doors
from tests.security.doors import LmClient, engine, key, run

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


def _unreachable(receipt: dict[str, Any]) -> dict[str, str | None]:
    return {u["engine"]: u["error"] for u in receipt["engines"]["unreachable"]}


async def test_an_engine_whose_control_channel_is_down_is_named_unreachable(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    """The engine stored alice's chunk (the ledger says so: ``kv:put`` by ``engine:vllm-acme``)
    and keeps a copy in its local tier; its control channel is down while the purge runs."""
    async with doors.sidecar(tmp_path, prod_db) as sc:
        acme = engine(sc, "tok-acme")
        local = LocalTier()
        channel = acme.control(local.on_evict, reconnect_delay=0.1)
        try:
            assert await run(channel.connected.wait, 10)
            ctx = RequestContext(request_id="r-1", tenant="acme", user="alice")
            raw = key(0x51, "acme", user="alice")
            value = os.urandom(4096)
            assert (await run(acme.put, raw, value, ctx)).ok
            local.chunks[raw] = value  # LMCache keeps the chunk in its local tier too
            # the channel goes down (the engine restarts it, a network blip, control: false)
            await run(channel.close)
            job = await doors.purge(sc, "acme", "alice")
            receipt = doors.receipt(job)
            engines = receipt["engines"]
            named = set(engines["acknowledged"]) | {
                u if isinstance(u, str) else u.get("engine") for u in engines["unreachable"]
            }
            state = job.state
            assert raw not in local.chunks or (
                state is not PurgeState.COMPLETED and "vllm-acme" in named
            ), (
                f"receipt {state} (engines {engines}) while engine vllm-acme, which stored "
                "the purged user's chunk, still holds it and was never sent EVICT"
            )
            assert receipt["state"] == "incomplete"
            assert _unreachable(receipt) == {"vllm-acme": "no_control_connection"}
            assert engines["acknowledged"] == []
            assert any("vllm-acme" in line for line in receipt["incomplete"])
        finally:
            channel.close()
            acme.close()


async def test_an_engine_whose_channel_is_up_is_acknowledged_and_the_purge_completes(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    """No false ``incomplete``: the holder is connected, evicts, and is the only one named;
    an engine that held the tenant's data through another sidecar's chain is not this
    sidecar's to name."""
    async with doors.sidecar(tmp_path, prod_db) as sc:
        acme = engine(sc, "tok-acme")
        local = LocalTier()
        channel = acme.control(local.on_evict, reconnect_delay=0.1)
        try:
            assert await run(channel.connected.wait, 10)
            ctx = RequestContext(request_id="r-2", tenant="acme", user="alice")
            raw = key(0x61, "acme", user="alice")
            value = os.urandom(4096)
            assert (await run(acme.put, raw, value, ctx)).ok
            local.chunks[raw] = value
            job = await doors.purge(sc, "acme", "alice")
            receipt = doors.receipt(job)
            assert job.state is PurgeState.COMPLETED, receipt["incomplete"]
            assert receipt["engines"] == {"acknowledged": ["vllm-acme"], "unreachable": []}
            assert raw not in local.chunks  # the EVICT reached the local tier
            with Session(sc.engine) as s:
                ours = scope.engines_that_held(s, "acme", chain_id=sc.settings.chain_id)
                theirs = scope.engines_that_held(s, "acme", chain_id="another-sidecar")
            assert ours.here == {"vllm-acme"}
            assert theirs.anywhere == {"vllm-acme"}  # still sent EVICT wherever connected
            assert theirs.here == frozenset()
        finally:
            channel.close()
            acme.close()


async def test_the_lm_engine_that_held_the_tenants_data_is_named_unreachable(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    """The ``lm://`` engine stored acme's chunk; it has no control channel, so kvgov cannot
    evict its LMCache local tier: a tenant purge names it and is not ``completed``. A user
    purge whose scope it never touched is not held up by it."""
    lm_settings: dict[str, Any] = {"lm_port": 0, "lm_engine_id": "lm-acme", "lm_tenants": ["acme"]}
    async with doors.sidecar(tmp_path, prod_db, **lm_settings) as sc:
        assert sc.lm_server is not None and sc.lm_server.port is not None
        lm = LmClient(sc.lm_server.port)
        try:
            raw = key(0x71, "acme")
            await run(lm.put, raw, os.urandom(4096))
            assert await run(doors.wait_for, lambda: lm.exists(raw), 10)
        finally:
            lm.close()
        # no false incomplete: bob's purge has nothing the lm:// engine stored or read
        bob = await doors.purge(sc, "acme", "bob")
        assert bob.state is PurgeState.COMPLETED, doors.receipt(bob)["incomplete"]
        job = await doors.purge(sc, "acme", None)
        receipt = doors.receipt(job)
        assert job.state is PurgeState.INCOMPLETE, receipt
        assert _unreachable(receipt) == {"lm:lm-acme": "no_control_channel"}
        assert any("lm:lm-acme" in line for line in receipt["incomplete"])

"""EVICT goes only to engines that may hold the purged tenant's data.

Attack (issue 14, "what got through" 8): a purge fanned EVICT out to every connected engine,
so an engine allowed only for acme received the key digests of a globex purge (what globex
cached, and when it was erased).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from kvgov.db.purge_views import PurgeRequest
from kvgov.types import PurgeState
from kvgov.wire import EvictRequest, RequestContext
from tests.security import doors
from tests.security.doors import engine, key, run

pytestmark = pytest.mark.postgres


class Engine:
    """An engine's control channel, recording every EVICT it is sent."""

    def __init__(self, client: object) -> None:
        self.client = client
        self.lock = threading.Lock()
        self.seen: list[EvictRequest] = []

    def on_evict(self, request: EvictRequest) -> list[str]:
        with self.lock:
            self.seen.append(request)
        return []


async def test_a_globex_purge_sends_nothing_to_an_acme_engine(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    async with doors.sidecar(tmp_path, prod_db) as sc:
        acme, globex = engine(sc, "tok-acme"), engine(sc, "tok-globex")
        watchers = {"acme": Engine(acme), "globex": Engine(globex)}
        channels = [
            acme.control(watchers["acme"].on_evict, reconnect_delay=0.1),
            globex.control(watchers["globex"].on_evict, reconnect_delay=0.1),
        ]
        try:
            for channel in channels:
                assert await run(channel.connected.wait, 10)
            ctx = RequestContext(request_id="g-9", tenant="globex", user="gus")
            assert (await run(globex.put, key(20, "globex", user="gus"), os.urandom(4096), ctx)).ok
            acme_ctx = RequestContext(request_id="a-9", tenant="acme")
            assert (await run(acme.put, key(21, "acme"), os.urandom(4096), acme_ctx)).ok
            assert sc.purge is not None
            service = sc.purge.service
            job = await service.create(
                PurgeRequest(tenant="globex", user="gus", requested_by="test")
            )
            done = await service.wait(job.id)
            assert done.state is PurgeState.COMPLETED
            assert watchers["acme"].seen == []
            assert len(watchers["globex"].seen) == 1
            digest = sc.pipeline.pseudonymizer.key_digest(key(20, "globex", user="gus"))
            assert watchers["globex"].seen[0].digests == {digest}
        finally:
            for channel in channels:
                channel.close()
            acme.close()
            globex.close()

"""A denial flood is summarised, not chained one event per probe: at most
``dataplane.denials_recorded_per_connection`` denials per connection and second (and
``denials_recorded_per_s`` in all) are recorded one event each; the rest are counted and
summarised in one ``kv:denied`` event (``reason: suppressed``, ``attrs.suppressed``: how
many) per connection and second. Every denial still counts in
``kvgov_dataplane_denials_total``.

Attack (issue 14, "what got through" 5): 3,000 anonymous ``lm://`` EXISTs of absent keys added
3,000 chained ledger events.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from kvgov.types import EventKind
from tests.security import doors
from tests.security.doors import LmClient, engine, events, key, known_dataplane, run

pytestmark = pytest.mark.postgres

PROBES = 3000


def _accounted(sc: object) -> tuple[int, int]:
    """(denials recorded one each, denials summarised) in the ledger."""
    rows = events(sc, EventKind.KV_DENIED)  # type: ignore[arg-type]
    single = [r for r in rows if r.reason != "suppressed"]
    summed = sum(int(r.attrs.get("suppressed", 0)) for r in rows if r.reason == "suppressed")
    return len(single), summed


async def _settled(sc: object, total: int) -> tuple[int, int]:
    """Wait (bounded) until every denial is in the ledger, one by one or summarised."""
    got = (0, 0)
    for _ in range(100):
        got = await run(_accounted, sc)
        if sum(got) >= total:
            return got
        await asyncio.sleep(0.1)
    return got


async def test_lm_exist_flood_is_summarised(tmp_path: Path, prod_db: doors.ProdDatabase) -> None:
    # the lm:// engine serves "demo", whose "*" engines list does not admit it: every probe
    # of a demo key is denied
    lm = {"lm_port": 0, "lm_engine_id": "lm-acme", "lm_tenants": ["demo"]}
    async with doors.sidecar(tmp_path, prod_db, **lm) as sc:
        client = LmClient(sc.lm_server.port)
        started = time.monotonic()
        try:
            for i in range(PROBES):
                assert not await run(client.exists, key(i, "demo"))
        finally:
            client.close()
        seconds = time.monotonic() - started
        single, summed = await _settled(sc, PROBES)
        denials = sc.metrics.registry.get_sample_value(
            "kvgov_dataplane_denials_total", {"op": "exists", "reason": "engine_not_allowed"}
        )
        assert denials == PROBES  # every one counted
        cap = known_dataplane(denials_recorded_per_connection=32).get(
            "denials_recorded_per_connection", PROBES
        )
        assert single <= cap * (int(seconds) + 2)
        assert single < PROBES // 10
        assert single + summed == PROBES  # nothing lost: the rest is in the summaries
        summaries = [r for r in events(sc, EventKind.KV_DENIED) if r.reason == "suppressed"]
        assert len(summaries) <= int(seconds) + 2
        assert all(r.principal == "lm:lm-acme" for r in summaries)


async def test_wire_probe_flood_over_many_connections_is_capped_per_second(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    """The global cap holds when the probes are spread over many connections."""
    caps = known_dataplane(denials_recorded_per_connection=1000, denials_recorded_per_s=50)
    async with doors.sidecar(tmp_path, prod_db, **caps) as sc:
        clients = [engine(sc, "tok-acme") for _ in range(10)]
        started = time.monotonic()
        try:
            for round_ in range(3):
                for n, client in enumerate(clients):
                    keys = [key(10_000 * n + 100 * round_ + i, "globex") for i in range(100)]
                    assert not any(await run(client.exists_many, keys))
        finally:
            for client in clients:
                client.close()
        seconds = time.monotonic() - started
        single, summed = await _settled(sc, 3000)
        assert single <= 50 * (int(seconds) + 2)
        assert single < 3000 // 2
        assert single + summed == 3000

"""No presence oracle across tenants: the policy decides before anything looks at whether the
key is stored, so a probe for another tenant's key is answered, recorded and counted the same
whether the key is there or not.

Attack (issue 14, "what got through" 3): when the key was absent the pipeline answered before
policy ran; when present, a denial was recorded and ``kvgov_dataplane_denials_total`` moved. An
engine without ``ctx.tenant``, or ``lm://``, learned whether another tenant had cached a prompt
from the metric, from the ledger's denials, or from latency. (Latency is compared, not
asserted, by ``bench/oracle.py``.)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from kvgov.config import DataPlaneSettings
from kvgov.proxy.app import Sidecar
from kvgov.types import EventKind
from kvgov.wire import RequestContext
from tests.security import doors
from tests.security.doors import LmClient, engine, key, run

pytestmark = pytest.mark.postgres

NO_TENANT = RequestContext(request_id="probe")  # the engine does not say whose request it is


def _samples(sc: Sidecar, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    out = {}
    for metric in sc.metrics.registry.collect():
        for s in metric.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def _delta(before: dict[Any, float], after: dict[Any, float]) -> dict[Any, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


class Observed:
    """What a probe changes that an outsider could read: metrics and the ledger's denials."""

    def __init__(self, sc: Sidecar) -> None:
        self.sc = sc

    async def around(self, probe: Any) -> tuple[Any, dict[Any, float], list[tuple[str, str]]]:
        assert self.sc.writer is not None
        await self.sc.writer.flush()
        denials = {e.seq for e in doors.events(self.sc, EventKind.KV_DENIED)}
        ops = _samples(self.sc, "kvgov_dataplane_ops_total")
        denied = _samples(self.sc, "kvgov_dataplane_denials_total")
        answer = await probe()
        await self.sc.writer.flush()
        new = [
            (e.reason or "", e.tenant or "")
            for e in doors.events(self.sc, EventKind.KV_DENIED)
            if e.seq not in denials
        ]
        moved = {
            **_delta(ops, _samples(self.sc, "kvgov_dataplane_ops_total")),
            **_delta(denied, _samples(self.sc, "kvgov_dataplane_denials_total")),
        }
        return answer, moved, sorted(new)


async def test_wire_probe_of_another_tenant_looks_the_same_present_or_absent(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    async with doors.sidecar(tmp_path, prod_db) as sc:
        globex, acme = engine(sc, "tok-globex"), engine(sc, "tok-acme")
        try:
            present, absent = key(10, "globex"), key(11, "globex")
            ctx = RequestContext(request_id="g-1", tenant="globex")
            assert (await run(globex.put, present, os.urandom(10_000), ctx)).ok
            seen = Observed(sc)
            for op in (acme.exists, acme.get):
                on_present = await seen.around(lambda op=op: run(op, present, NO_TENANT))
                on_absent = await seen.around(lambda op=op: run(op, absent, NO_TENANT))
                assert on_present[0] in (False, None)
                assert on_present == on_absent  # same answer, same metrics, same denials
                assert on_present[2], "the probe is recorded as a denial either way"
            # in one frame, side by side
            frame = await seen.around(lambda: run(acme.exists_many, [present, absent], NO_TENANT))
            assert frame[0] == [False, False]
            assert len(frame[2]) == 2
            assert frame[2][0] == frame[2][1]
        finally:
            globex.close()
            acme.close()


async def test_lm_probe_of_another_tenant_looks_the_same_present_or_absent(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    lm_settings: dict[str, Any] = {"lm_port": 0, "lm_engine_id": "lm-acme"}
    if "lm_tenants" in DataPlaneSettings.model_fields:
        lm_settings["lm_tenants"] = ["acme"]
    async with doors.sidecar(tmp_path, prod_db, **lm_settings) as sc:
        globex = engine(sc, "tok-globex")
        assert sc.lm_server is not None
        lm = LmClient(sc.lm_server.port)
        try:
            present, absent = key(12, "globex"), key(13, "globex")
            ctx = RequestContext(request_id="g-2", tenant="globex")
            assert (await run(globex.put, present, os.urandom(10_000), ctx)).ok
            seen = Observed(sc)
            for op in (lm.exists, lm.get):
                on_present = await seen.around(lambda op=op: run(op, present))
                on_absent = await seen.around(lambda op=op: run(op, absent))
                assert on_present[0] in (False, None)
                assert on_present == on_absent
        finally:
            lm.close()
            globex.close()

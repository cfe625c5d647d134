"""A ledger row dated ``infinity`` must not stop a purge, the purge list or ``audit verify``.

The attack (found beside review r14's F1/F2): the runtime database role (every sidecar's) may
INSERT ``ledger_events`` rows. Postgres's ``timestamptz`` holds ``infinity`` and years past
9999, Python's ``datetime`` does not, and psycopg raised ``DataError`` on every read of such a
row. One ``purge:step`` row naming a job, dated ``infinity``, on a chain of the attacker's own:
every receipt cross-check of the job read it, so the job never finished (its ledger step failed
on every pass, on every sidecar), and the purge list and ``audit verify`` failed on it too.

Now (:mod:`kvgov.db.boundedtime`) every Postgres connection reads a timestamp past Python's
range as its edge (``9999-12-31``, ``0001-01-01``): decoding never raises, and the row, whose
hashed ``occurred_at`` is not the one stored, proves nothing. Postgres as the runtime role.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session
from typer.testing import CliRunner

from kvgov.cli.main import build_app
from kvgov.db.boundedtime import FAR_FUTURE, FAR_PAST
from kvgov.db.purge_views import PurgeRequest, PurgeState
from kvgov.db.tokens import TokenRepository
from kvgov.proxy.api.app import create_control_app
from kvgov.types import Role
from tests.security import doors
from tests.security.test_deep_json_rows import _plant

pytestmark = pytest.mark.postgres


@pytest.mark.parametrize("when", ["infinity", "-infinity", "20000-01-01 00:00:00+00"])
async def test_a_row_dated_past_pythons_range_stops_no_purge_and_no_reader(
    tmp_path: Path, prod_db: doors.ProdDatabase, when: str
) -> None:
    answers: dict[str, httpx.Response] = {}
    async with doors.sidecar(tmp_path, prod_db) as sc:
        assert sc.purge is not None and sc.engine is not None
        service = sc.purge.service
        job = await service.create(PurgeRequest(tenant="acme", user="alice", requested_by="t"))
        attrs = json.dumps({"purge_id": job.id, "step": "tiers", "attempt": 1})
        chain = _plant(sc.engine, job.id, job.tenant, attrs=attrs, at=when)
        sc.purge.wake()
        try:
            done = await asyncio.wait_for(service.wait(job.id), 60)
        except TimeoutError:
            done = None
        with Session(sc.engine) as s:
            _, raw = TokenRepository(s).create(Role.AUDITOR, tenant=None)
            s.commit()
        auditor = {"Authorization": f"Bearer {raw}"}
        transport = httpx.ASGITransport(app=create_control_app(sc.control_plane()))
        async with httpx.AsyncClient(transport=transport, base_url="http://kvgov.test") as c:
            for path in ("/v1/purges", f"/v1/purges/{job.id}", "/v1/audit/verify"):
                answers[path] = await c.get(path, headers=auditor)
        with sc.engine.connect() as conn:
            read = conn.execute(
                text("SELECT occurred_at FROM ledger_events WHERE chain_id = :c"), {"c": chain}
            ).scalar_one()
        data_dir = sc.settings.data_dir
    assert done is not None, (
        f"purge {job.id} never finished: one purge:step row naming it dated {when!r} (the"
        " runtime role's) failed every read of its events"
    )
    assert done.state is PurgeState.COMPLETED, done.state  # the forged row counted for nothing
    assert read in (FAR_FUTURE, FAR_PAST)
    failed = {p: r.status_code for p, r in answers.items() if r.status_code != 200}
    assert not failed, f"the API failed over a row dated {when!r}: {failed}"
    verdict = answers["/v1/audit/verify"].json()
    junk = next(ch for ch in verdict["chains"] if ch["chain_id"] == chain)
    assert junk["ok"] is False, junk
    env = {"KVGOV_DATABASE_URL": prod_db.url, "KVGOV_DATA_DIR": str(data_dir)}
    result = CliRunner().invoke(build_app(), ["audit", "verify"], env=env)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(
        result.exception
    )
    assert result.exit_code == 1 and f"BROKEN {chain}" in result.output, result.output

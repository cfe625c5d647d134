"""Attacks on the purge receipt's cross-check with the chain (review 6, F1-F3).

1. The runtime role that may UPDATE ``purge_steps`` may also INSERT into ``chains`` and
   ``ledger_events``, and the chain hash is unkeyed: it inflates a step's row and chains one
   matching ``purge:step`` event (attempt 99) on a chain of its own. ``chained_steps`` took
   any row whose own hash covered its columns, and the receipt was signed ``completed`` with the
   forged figures. Now an event counts only on a chain a trusted key vouches for.
2. The runtime role may INSERT into ``purge_receipts``: a receipt row inserted for an open job
   made ``finish_job`` refuse the real finish, which was swallowed; the job stayed ``running``
   and its ledger step ran again at each lease's end (erasing, chaining, checkpointing), while
   ``kvgov purge`` waited for ever. Now the job is closed ``failed``.
3. No attacker: a step that outlived its lease ran twice, the slower attempt wrote its row last,
   and the receipt (checked against the later attempt's event) was signed ``incomplete``. Now
   only the attempt holding the step writes its outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import insert, select

from kvgov.db.models import Chain, LedgerEvent, PurgeReceipt
from kvgov.db.purge_views import PurgeRequest, StepName
from kvgov.ledger.chain import ENCODING_VERSION, ChainedFields, link
from kvgov.services.purge.documents import read_detail
from tests.integration.test_purge_service import Env
from tests.security import test_receipt_forgery as forgery
from tests.security.test_receipt_forgery import (
    _inflate_tiers_step,
    _receipt,
)

# the purge world and the runtime role of the receipt's other attacks (their fixtures)
env = forgery.env
runtime_role = forgery.runtime_role


def _forge_step_event(env: Env, role: str, job: Any, step: str, detail: dict[str, Any]) -> None:
    """INSERT, as the runtime role, a self-consistent purge:step event on a new chain."""
    chain = f"forged/{os.urandom(4).hex()}"
    now = datetime.now(UTC).replace(microsecond=0)
    attrs = {
        "purge_id": job.id,
        "step": step,
        "sidecar_id": None,
        "attempt": 99,
        "summary": read_detail(StepName(step), detail).summary(),
    }
    fields = ChainedFields(
        chain_id=chain,
        seq=1,
        prev_hash="00" * 32,
        occurred_at=now,
        kind="purge:step",
        tenant=job.tenant,
        actor=job.subject,
        request_id=None,
        key_digest=None,
        tier=None,
        nbytes=None,
        outcome="ok",
        reason="completed",
        decision_id=None,
        policy_revision=None,
        principal="sidecar",
        attrs=attrs,
        payload_digest=None,
    )
    with env.engine.begin() as conn:
        conn.exec_driver_sql(f'SET LOCAL ROLE "{role}"')
        conn.execute(
            insert(Chain.__table__).values(
                chain_id=chain, public_key=os.urandom(32), created_at=now, description=None
            )
        )
        conn.execute(
            insert(LedgerEvent.__table__).values(
                chain_id=chain,
                seq=1,
                prev_hash=fields.prev_hash,
                hash=link(fields),
                encoding_version=ENCODING_VERSION,
                occurred_at=now,
                kind="purge:step",
                tenant=job.tenant,
                actor=job.subject,
                outcome="ok",
                reason="completed",
                principal="sidecar",
                attrs=attrs,
            )
        )


@pytest.mark.postgres
async def test_a_forged_step_event_makes_an_inflated_row_signed_completed(
    env: Env, runtime_role: str
) -> None:
    service, job, _, forged = await _inflate_tiers_step(env, runtime_role)
    _forge_step_event(env, runtime_role, job, "tiers", forged)
    job = await asyncio.wait_for(service.wait(job.id), 30)
    r = _receipt(env, job)  # a genuine signature of the fleet's key
    from kvgov.ledger.chain import public_key_bytes
    from kvgov.ledger.verify import verify

    rep = verify(env.engine)
    integrity = [(c.chain_id, [(f.problem, f.detail) for f in c.findings]) for c in rep.chains]
    trusted = verify(env.engine, trusted_keys=[public_key_bytes(env.key)]).ok
    assert not (r["state"] == "completed" and r["entries_purged"] == 120), (
        f"signed {r['state']!r} with entries_purged={r['entries_purged']}, tiers={r['tiers']};"
        f" audit verify ok without trusted keys: {integrity}, with them: {trusted}"
    )


@pytest.mark.postgres
async def test_a_receipt_inserted_first_leaves_the_job_open_and_its_ledger_step_rerun(
    env: Env, runtime_role: str
) -> None:
    await env.seed("acme", "alice")
    service = env.service(step_lease_s=0.3)
    job = await service.create(PurgeRequest(tenant="acme", user="alice"))
    with env.engine.begin() as conn:
        conn.exec_driver_sql(f'SET LOCAL ROLE "{runtime_role}"')
        conn.execute(
            insert(PurgeReceipt.__table__).values(
                job_id=job.id,
                receipt={"receipt": {"state": "completed"}},
                signature=b"x",
                created_at=datetime.now(UTC),
            )
        )
    finished = None
    with contextlib.suppress(TimeoutError):
        finished = await asyncio.wait_for(service.wait(job.id), 6)
    with env.engine.connect() as conn:
        rows = conn.execute(
            select(LedgerEvent.attrs).where(LedgerEvent.kind == "purge:step")
        ).scalars()
        runs = sum(1 for a in rows if a.get("purge_id") == job.id and a.get("step") == "ledger")
    state = (await service.get(job.id)).state
    assert finished is not None and runs == 1, (
        f"job {state}, not finished after 6 s; its ledger step ran {runs} times"
    )


@pytest.mark.postgres
async def test_a_step_run_twice_after_its_lease_is_not_read_as_tampered(env: Env) -> None:
    """No attacker: a global step outlives ``purge.step_lease_s`` (120 s; a large tenant's
    tiers or keys), another executor takes it again (attempt 2), and the first one finishes
    last. The row holds attempt 1's detail, ``chained_steps`` picks attempt 2's event: the
    honest purge's receipt is signed ``incomplete``."""
    from kvgov.db import purge_jobs as jobs
    from kvgov.db.engine import make_sessionmaker, utcnow
    from kvgov.services.purge.steps import run_step

    await env.seed("acme", "alice")
    service = env.service(step_lease_s=0.2)
    job = await service.create(PurgeRequest(tenant="acme", user="alice"))
    sessions = make_sessionmaker(env.engine)

    def claim() -> Any:
        with sessions.begin() as s:
            return jobs.claim_step(
                s, sidecar_id=None, now=utcnow(), lease_s=0.2, job_timeout_s=30, job_id=job.id
            )

    first = claim()
    await asyncio.sleep(0.3)
    second = claim()
    assert first[1].name is StepName.KEYS and second[1].id == first[1].id
    state1, detail1 = await run_step(service.ctx, *first)  # the slow one
    state2, detail2 = await run_step(service.ctx, *second)
    # the slow one writes last: its write is dropped, the row keeps attempt 2's outcome
    for claimed, st, d in ((second, state2, detail2), (first, state1, detail1)):
        with sessions.begin() as s:
            jobs.finish_step(
                s,
                claimed[1].id,
                st,
                d.model_dump(mode="json"),
                now=utcnow(),
                attempt=claimed[1].attempts,
            )
    job = await asyncio.wait_for(service.wait(job.id), 30)
    r = _receipt(env, job)
    assert r["state"] == "completed", r["incomplete"]

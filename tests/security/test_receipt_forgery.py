"""Attack: a purge receipt, signed by the fleet's key, that says what the chain does not.

Each finished purge step stores its detail in the mutable row ``purge_steps.detail`` and chains
a tamper-evident ``purge:step`` event whose payload is that detail's ``summary()`` and whose
``reason`` is the step's state. The receipt was built from the rows alone. Whoever holds the
runtime database role (every sidecar has it: UPDATE on ``purge_steps``) edited a step before the
final ``ledger`` step ran, and the fleet's key signed the edit as ``completed``:

* an inflated count (120 entries deleted where the chained event says 6);
* a step marked done that never ran (``keys``: "keys destroyed", no event, nothing shredded);
* a step that ran ``incomplete`` flipped to ``completed`` (a GPU reset that did not happen).

Now every step the receipt calls done must match its chained ``purge:step`` event (same state,
same summary): a step whose row disagrees, or that has no event, makes the receipt
``incomplete``, names the step, and its forged figures are not in the signed document. A
finished job cannot be finished (and re-signed) a second time. Controls: an untampered purge
still yields a ``completed`` receipt that verifies.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from kvgov.db import purge_jobs as jobs
from kvgov.db.engine import make_sessionmaker, utcnow
from kvgov.db.grants import apply_grants
from kvgov.db.purge_views import PurgeRequest, StepName
from kvgov.errors import PurgeError
from kvgov.ledger.chain import public_key_bytes
from kvgov.services.purge.receipts import canonical, verify_receipt
from kvgov.services.purge.service import PurgeService, build_receipt
from kvgov.types import PurgeState
from tests.integration.test_purge_service import Env, N, world


@pytest.fixture
async def env(pg_url: str, tmp_path: Path) -> AsyncIterator[Env]:
    async with world(pg_url, tmp_path) as e:
        yield e


@pytest.fixture
async def sqlite_env(sqlite_url: str, tmp_path: Path) -> AsyncIterator[Env]:
    """On SQLite, the embedded default: ``kvgov demo`` purges there."""
    async with world(sqlite_url, tmp_path) as e:
        yield e


@pytest.fixture
def runtime_role(env: Env) -> Iterator[str]:
    """A role with exactly the runtime privileges on the test database (what a sidecar has)."""
    role = f"kvgov_rt_{uuid.uuid4().hex[:10]}"
    with env.engine.begin() as conn:
        conn.exec_driver_sql(f'CREATE ROLE "{role}" NOLOGIN')
        apply_grants(conn, role)
    try:
        yield role
    finally:
        with env.engine.begin() as conn:
            conn.exec_driver_sql(f'DROP OWNED BY "{role}"')
            conn.exec_driver_sql(f'DROP ROLE "{role}"')


def _tamper(env: Env, role: str | None, job_id: str, step: str, **values: Any) -> None:
    """UPDATE one step of the job as the runtime role (``state`` and/or ``detail``; SQLite,
    with ``role`` None, has no roles: whoever can write the file)."""
    sets = ", ".join(f"{k} = :{k}" for k in values)
    params = {k: json.dumps(v) if k == "detail" else v for k, v in values.items()}
    with env.engine.begin() as conn:
        if role is not None:
            conn.exec_driver_sql(f'SET LOCAL ROLE "{role}"')
        done = conn.execute(
            text(f"UPDATE purge_steps SET {sets} WHERE job_id = :job AND name = :step"),
            {**params, "job": job_id, "step": step},
        )
        assert done.rowcount == 1


async def _run_until_ledger(service: PurgeService, job_id: str) -> None:
    """Run every step but the final ``ledger`` one (it is claimed last, by step id)."""
    while True:
        job = await service.get(job_id)
        pending = [s for s in job.steps if not s.terminal and s.name is not StepName.LEDGER]
        if not pending:
            return
        assert await service.run_one(job_id) is not None


def _step(job: Any, name: str) -> Any:
    return next(s for s in job.steps if s.name == name)


async def _inflate_tiers_step(
    env: Env, role: str | None
) -> tuple[PurgeService, Any, dict[str, Any], dict[str, Any]]:
    """Seed alice, run her purge up to its ledger step, and UPDATE its ``tiers`` step's row as
    ``role`` to claim 120 entries deleted; return the service, the job, the honest detail and the
    forged one (for the forgery tests that go on from there)."""
    await env.seed("acme", "alice")
    service = env.service()
    job = await service.create(PurgeRequest(tenant="acme", user="alice"))
    await _run_until_ledger(service, job.id)
    honest = _step(await service.get(job.id), "tiers").detail
    forged = {
        **honest,
        "deleted": {"memory": 120, "filesystem": 120},
        "entries_in_scope": 120,
        "newly_purged": 120,
    }
    _tamper(env, role, job.id, "tiers", detail=forged)
    return service, job, honest, forged


def _receipt(env: Env, job: Any) -> dict[str, Any]:
    assert job.receipt is not None
    check = verify_receipt(job.receipt, [public_key_bytes(env.key)])
    assert check.ok, check.reason  # a genuine signature: what the officer checks
    return dict(job.receipt["receipt"])


@pytest.mark.postgres
async def test_inflated_count_is_not_signed_as_completed(
    env: Env, runtime_role: str, caplog: pytest.LogCaptureFixture
) -> None:
    service, job, honest, _ = await _inflate_tiers_step(env, runtime_role)
    assert honest["newly_purged"] == N

    with caplog.at_level(logging.ERROR):
        job = await asyncio.wait_for(service.wait(job.id), 30)
    r = _receipt(env, job)
    assert r["state"] != "completed"
    assert job.state is not PurgeState.COMPLETED
    assert r["entries_purged"] != 120
    assert 120 not in r["tiers"].values()
    assert any(line.startswith("tiers") for line in r["incomplete"]), r["incomplete"]
    mismatch = [rec for rec in caplog.records if rec.getMessage() == "purge.receipt.mismatch"]
    assert mismatch
    logged = " ".join(str(vars(rec)) for rec in mismatch)
    assert job.subject is not None and job.subject not in logged
    assert "alice" not in logged


@pytest.mark.postgres
async def test_a_step_marked_done_without_running_is_not_done(env: Env, runtime_role: str) -> None:
    await env.seed("acme", "alice")
    alice = env.pseudo.user("acme", "alice")
    service = env.service()
    job = await service.create(PurgeRequest(tenant="acme", user="alice"))
    # before any executor takes it: "keys destroyed", and no key is ever shredded
    _tamper(
        env,
        runtime_role,
        job.id,
        "keys",
        state="completed",
        detail={"executed_by": "test", "destroyed": [{"key_id": f"u:acme:{alice}", "version": 1}]},
    )
    job = await asyncio.wait_for(service.wait(job.id), 30)
    r = _receipt(env, job)
    assert r["state"] != "completed"
    assert r["keys_destroyed"] == []
    assert any(line.startswith("keys") for line in r["incomplete"]), r["incomplete"]


@pytest.mark.postgres
async def test_an_incomplete_step_flipped_to_completed_is_not_done(
    env: Env, runtime_role: str
) -> None:
    await env.seed("acme", "alice")
    # a vLLM engine that does not answer: the GPU step ends incomplete, and its event says so
    service = env.service(vllm_engines=["http://127.0.0.1:9"])
    job = await service.create(PurgeRequest(tenant="acme", user="alice"))
    await _run_until_ledger(service, job.id)
    assert _step(await service.get(job.id), "gpu").state is PurgeState.INCOMPLETE
    _tamper(
        env,
        runtime_role,
        job.id,
        "gpu",
        state="completed",
        detail={
            "executed_by": "test",
            "results": [{"engine": "http://127.0.0.1:9", "ok": True, "status": 200, "error": None}],
        },
    )
    job = await asyncio.wait_for(service.wait(job.id), 30)
    r = _receipt(env, job)
    assert r["state"] != "completed"
    assert all(not g["ok"] for g in r["gpu_reset"]), r["gpu_reset"]
    assert any(line.startswith("gpu") for line in r["incomplete"]), r["incomplete"]


@pytest.mark.postgres
async def test_a_detail_no_executor_writes_is_not_signed(env: Env, runtime_role: str) -> None:
    await env.seed("acme", "alice")
    service = env.service()
    job = await service.create(PurgeRequest(tenant="acme", user="alice"))
    await _run_until_ledger(service, job.id)
    tiers = _step(await service.get(job.id), "tiers").detail
    _tamper(env, runtime_role, job.id, "tiers", detail={**tiers, "note": "all gone, trust me"})
    job = await asyncio.wait_for(service.wait(job.id), 30)
    r = _receipt(env, job)
    assert r["state"] != "completed"
    assert any(line.startswith("tiers") for line in r["incomplete"]), r["incomplete"]


@pytest.mark.postgres
async def test_a_finished_job_is_not_finished_twice(env: Env, runtime_role: str) -> None:
    await env.seed("acme", "alice")
    service = env.service()
    job = await service.create(PurgeRequest(tenant="acme", user="alice"))
    job = await asyncio.wait_for(service.wait(job.id), 30)
    assert job.state is PurgeState.COMPLETED
    first_receipt, first_result = job.receipt, job.result
    # reopen the finished job, inflate a step, and let its final step run (and finish) again
    tiers = _step(job, "tiers").detail
    _tamper(env, runtime_role, job.id, "tiers", detail={**tiers, "deleted": {"memory": 120}})
    _tamper(env, runtime_role, job.id, "ledger", state="pending")
    with env.engine.begin() as conn:
        conn.exec_driver_sql(f'SET LOCAL ROLE "{runtime_role}"')
        conn.execute(
            text("UPDATE purge_jobs SET state = 'running', finished_at = NULL WHERE id = :j"),
            {"j": job.id},
        )
    await service.run_until_idle(job.id)
    again = await service.get(job.id)
    assert again.receipt == first_receipt
    assert again.result == first_result  # the forged figure was not written as its result
    # closed, not left running for its final step to be claimed (and run) again for ever
    assert again.state is PurgeState.FAILED and again.finished_at is not None
    assert await service.run_one(job.id) is None
    # and directly: a job with a receipt is not finished a second time
    with make_sessionmaker(env.engine).begin() as s, pytest.raises(PurgeError):
        jobs.finish_job(
            s,
            job.id,
            state=PurgeState.INCOMPLETE,
            result={"state": "incomplete"},
            receipt={},
            signature=b"",
            now=utcnow(),
        )


@pytest.mark.postgres
async def test_control_an_untampered_purge_is_completed_and_verifies(env: Env) -> None:
    await env.seed("acme", "alice")
    service = env.service()
    job = await service.create(PurgeRequest(tenant="acme", user="alice"))
    job = await asyncio.wait_for(service.wait(job.id), 30)
    r = _receipt(env, job)
    assert job.state is PurgeState.COMPLETED
    assert r["state"] == "completed"
    assert r["incomplete"] == []
    assert r["entries_purged"] == N
    assert r["tiers"] == {"memory": N, "filesystem": N}
    assert len(r["keys_destroyed"]) == 1
    # byte for byte the document the receipt builder makes from the stored rows (what was
    # signed before the cross-check): an untampered purge's receipt is unchanged
    rebuilt = build_receipt(job, PurgeState.COMPLETED, finished_at=r["finished_at"])
    assert canonical(rebuilt.document()) == canonical(r)


async def test_sqlite_inflated_count_is_not_signed_as_completed_and_control(
    sqlite_env: Env,
) -> None:
    env = sqlite_env
    await env.seed("acme", "alice")
    await env.seed("acme", "bob")
    service = env.service()
    honest = await service.create(PurgeRequest(tenant="acme", user="bob"))
    honest = await asyncio.wait_for(service.wait(honest.id), 30)
    assert _receipt(env, honest)["state"] == "completed"  # the control

    job = await service.create(PurgeRequest(tenant="acme", user="alice"))
    await _run_until_ledger(service, job.id)
    tiers = _step(await service.get(job.id), "tiers").detail
    _tamper(env, None, job.id, "tiers", detail={**tiers, "newly_purged": 120})
    job = await asyncio.wait_for(service.wait(job.id), 30)
    r = _receipt(env, job)
    assert r["state"] != "completed"
    assert r["entries_purged"] != 120
    assert any(line.startswith("tiers") for line in r["incomplete"]), r["incomplete"]


@pytest.mark.postgres
async def test_a_gpu_reset_added_to_a_completed_step_is_not_signed(
    env: Env, runtime_role: str
) -> None:
    """The GPU step completed (no vLLM engine configured: nothing to reset); the row is given
    an engine "reset" that never was. Its chained summary was empty, so only the state was
    compared, and the forged reset was signed."""
    await env.seed("acme", "alice")
    service = env.service()
    job = await service.create(PurgeRequest(tenant="acme", user="alice"))
    await _run_until_ledger(service, job.id)
    gpu = _step(await service.get(job.id), "gpu")
    assert gpu.state is PurgeState.COMPLETED
    forged = {
        **gpu.detail,
        "results": [{"engine": "http://10.0.0.9:8000", "ok": True, "status": 200, "error": None}],
    }
    _tamper(env, runtime_role, job.id, "gpu", detail=forged)
    job = await asyncio.wait_for(service.wait(job.id), 30)
    r = _receipt(env, job)
    assert r["state"] != "completed"
    assert all(g["engine"] != "http://10.0.0.9:8000" for g in r["gpu_reset"]), r["gpu_reset"]
    assert any(line.startswith("gpu") for line in r["incomplete"]), r["incomplete"]


@pytest.mark.postgres
async def test_a_destroyed_key_swapped_for_another_is_not_signed(
    env: Env, runtime_role: str
) -> None:
    """The keys step shredded alice's key; the row is made to name another key (the same
    count). Its chained summary held the count only, and the swap was signed."""
    await env.seed("acme", "alice")
    service = env.service()
    job = await service.create(PurgeRequest(tenant="acme", user="alice"))
    await _run_until_ledger(service, job.id)
    keys = _step(await service.get(job.id), "keys").detail
    assert len(keys["destroyed"]) == 1
    swapped = {**keys, "destroyed": [{"key_id": "u:acme:someone-else", "version": 7}]}
    _tamper(env, runtime_role, job.id, "keys", detail=swapped)
    job = await asyncio.wait_for(service.wait(job.id), 30)
    r = _receipt(env, job)
    assert r["state"] != "completed"
    assert "u:acme:someone-else" not in json.dumps(r["keys_destroyed"])
    assert any(line.startswith("keys") for line in r["incomplete"]), r["incomplete"]

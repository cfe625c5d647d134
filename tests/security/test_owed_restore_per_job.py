"""One forged job must not hide the EVICTs a restarted sidecar owes (review r14, F2).

:meth:`kvgov.proxy.app.Sidecar._restore_owed` rebuilt the debts in one read of every
``engines@S`` row of the sidecar, ``detail`` included, and went on to each job in the same
call. The runtime role (every sidecar's) may INSERT into ``purge_jobs``, ``purge_steps`` and
``ledger_events``. A step row whose ``detail`` is JSON nested a few thousand deep raised
:class:`RecursionError` in psycopg's ``json.loads``: none of the ``(SQLAlchemyError, OSError,
KvgovError)`` the restore retried, so the task died silently at every start, every honest debt
of the sidecar was hidden (the engine's local tier kept the purged chunks), and
:meth:`Sidecar.stop` raised the error again before the writer's close. A row any read of a job
fails on for good (a ``purge:step`` event naming the forged job dated ``infinity``: psycopg
refuses the timestamp with a ``DataError``, an ``SQLAlchemyError``) turned the restore into a
retry loop that never restored anything either.

Now the JSON reads as a marker (:mod:`kvgov.boundedjson`), a timestamp past Python's range
as its edge (:mod:`kvgov.db.boundedtime`), and the restore reads job ids first and each job's
debt in a transaction and a guard of its own (:mod:`kvgov.proxy.purge.restore`): a job that
cannot be read, for whatever reason is left, costs only itself.

Postgres, as the runtime role a sidecar has.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DataError
from sqlalchemy.orm import Session

from kvgov.db.engine import utcnow
from kvgov.proxy.app import build_sidecar
from kvgov.services.purge import service as purge_service
from kvgov.services.purge.debts import OwedJob
from tests.security import doors
from tests.security.doors import engine, run
from tests.security.test_purge_late_evict import LocalTier, _down_during_purge, _late

pytestmark = pytest.mark.postgres

#: nesting deep enough for Python's JSON decoder, shallow enough for Postgres' jsonb
DEPTH = 5000


def _plant(sc_engine: object, sidecar_id: str) -> None:
    """As the runtime role: a job and its ``engines@S`` step for sidecar S, the step's detail
    nested ``DEPTH`` deep."""
    now = utcnow()
    job = str(uuid.uuid4())
    with sc_engine.begin() as conn:  # type: ignore[attr-defined]
        conn.execute(
            text(
                "INSERT INTO purge_jobs (id, kind, tenant, subject, state, dry_run, "
                "requested_by, created_at, updated_at) VALUES (:id, 'tenant', 'acme', NULL, "
                "'running', false, 'x', :now, :now)"
            ),
            {"id": job, "now": now},
        )
        conn.execute(
            text(
                "INSERT INTO purge_steps (job_id, name, sidecar_id, state, attempts, detail) "
                "VALUES (:j, 'engines', :s, 'incomplete', 1, CAST(:d AS jsonb))"
            ),
            {"j": job, "s": sidecar_id, "d": "[" * DEPTH + "]" * DEPTH},
        )


async def test_a_forged_step_row_does_not_stop_the_restored_evictions(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    local = LocalTier()
    sc = await build_sidecar(doors.settings(tmp_path, prod_db))
    await sc.start()
    try:
        acme, raws, (job,) = await _down_during_purge(sc, local, {0xE1: "alice"})
        acme.close()
        assert sc.engine is not None
        _plant(sc.engine, sc.sidecar_id)  # the attacker, while the sidecar runs
    finally:
        await sc.stop()
    (raw,) = raws
    sc = await build_sidecar(doors.settings(tmp_path, prod_db))  # a rollout restarts it
    await sc.start()
    delivered = False
    stop_error: BaseException | None = None
    try:
        acme = engine(sc, "tok-acme")
        channel = acme.control(local.on_evict, reconnect_delay=0.1)
        try:
            assert await run(channel.connected.wait, 10)
            delivered = await doors.until(lambda: raw not in local.chunks, 8)
            delivered = delivered and await doors.until(lambda: bool(_late(sc, job.id)), 5)
        finally:
            channel.close()
            acme.close()
    finally:
        try:
            await sc.stop()
        except BaseException as exc:
            stop_error = exc
    assert delivered, (
        f"one forged purge_steps row (detail nested {DEPTH} deep) hid every debt of the "
        f"restarted sidecar: vllm-acme still holds alice's chunk purged by {job.id} "
        f"(and Sidecar.stop() raised {type(stop_error).__name__})"
    )
    assert stop_error is None, f"Sidecar.stop() raised {type(stop_error).__name__}"


def _plant_unreadable_job(sc_engine: object, sidecar_id: str) -> str:
    """As the runtime role: a job, its ``engines@S`` step for sidecar S, and on a chain of
    its own a ``purge:step`` event naming the job dated ``infinity`` (valid for Postgres; no
    read of the job's chained steps got past it until timestamps were bounded,
    ``tests/security/test_out_of_range_timestamps.py``: the test below makes its reads fail
    on purpose)."""
    now = utcnow()
    job, chain = str(uuid.uuid4()), f"junk-{uuid.uuid4().hex[:8]}"
    with sc_engine.begin() as conn:  # type: ignore[attr-defined]
        conn.execute(
            text(
                "INSERT INTO purge_jobs (id, kind, tenant, subject, state, dry_run, "
                "requested_by, created_at, updated_at) VALUES (:id, 'tenant', 'acme', NULL, "
                "'running', false, 'x', :now, :now)"
            ),
            {"id": job, "now": now},
        )
        conn.execute(
            text(
                "INSERT INTO purge_steps (job_id, name, sidecar_id, state, attempts, detail) "
                "VALUES (:j, 'engines', :s, 'incomplete', 1, NULL)"
            ),
            {"j": job, "s": sidecar_id},
        )
        conn.execute(
            text("INSERT INTO chains (chain_id, public_key, created_at) VALUES (:c, :k, :t)"),
            {"c": chain, "k": b"\0" * 32, "t": now},
        )
        conn.execute(
            text(
                "INSERT INTO ledger_events (chain_id, seq, prev_hash, hash, encoding_version, "
                "occurred_at, kind, tenant, attrs) VALUES (:c, 1, :h, :h, 1, 'infinity', "
                "'purge:step', 'acme', CAST(:a AS json))"
            ),
            {"c": chain, "h": "0" * 64, "a": json.dumps({"purge_id": job, "step": "engines"})},
        )
    return job


async def test_a_job_no_read_gets_past_costs_only_itself(
    tmp_path: Path, prod_db: doors.ProdDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The honest debt is restored at once; the forged job, whose every read fails (an error
    of the database's or the driver's no reader expected), is tried a few rounds, logged and
    counted, and costs nothing else (before: the whole restore was retried, for ever, and
    restored nothing)."""
    local = LocalTier()
    sc = await build_sidecar(doors.settings(tmp_path, prod_db))
    await sc.start()
    try:
        acme, raws, (job,) = await _down_during_purge(sc, local, {0xE2: "alice"})
        acme.close()
        assert sc.engine is not None
        forged = _plant_unreadable_job(sc.engine, sc.sidecar_id)
    finally:
        await sc.stop()
    honest_read = purge_service.proven_debt

    def unreadable(session: Session, owed: OwedJob, **kw: Any) -> Any:
        if owed.job_id == forged:
            raise DataError("SELECT ...", {}, Exception("no read gets past this job's rows"))
        return honest_read(session, owed, **kw)

    monkeypatch.setattr(purge_service, "proven_debt", unreadable)
    (raw,) = raws
    sc = await build_sidecar(doors.settings(tmp_path, prod_db))
    await sc.start()
    delivered = False
    stop_error: BaseException | None = None
    try:
        acme = engine(sc, "tok-acme")
        channel = acme.control(local.on_evict, reconnect_delay=0.1)
        try:
            assert await run(channel.connected.wait, 10)
            delivered = await doors.until(lambda: raw not in local.chunks, 8)
            delivered = delivered and await doors.until(lambda: bool(_late(sc, job.id)), 5)
        finally:
            channel.close()
            acme.close()
        counted = sc.metrics.registry.get_sample_value(
            "kvgov_background_task_errors_total", {"task": "kvgov-late-evict-restore"}
        )
    finally:
        try:
            await sc.stop()
        except BaseException as exc:
            stop_error = exc
    assert delivered, (
        f"one forged job whose chained step no read gets past hid every debt of the restarted "
        f"sidecar: vllm-acme still holds alice's chunk purged by {job.id}"
    )
    assert counted is not None and counted >= 1
    assert stop_error is None, f"Sidecar.stop() raised {type(stop_error).__name__}"

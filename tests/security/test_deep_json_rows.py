"""One deeply nested JSON row must not kill the purge executor, the API or ``audit verify``
(review r14, F1).

The attack: the runtime database role (every sidecar's) may INSERT into ``chains``,
``ledger_events``, ``purge_jobs`` and ``purge_steps``. A JSON value nested a few thousand deep
is valid ``json``/``jsonb`` for Postgres, but psycopg's ``json.loads`` raised
:class:`RecursionError` decoding it. The receipt's cross-check
(:func:`kvgov.ledger.purge_trail.chained_steps`) decodes every ``purge:step`` row naming the job
before it checks any, and neither :meth:`PurgeService._finish` nor the executor's loop (which
caught ``KvgovError, SQLAlchemyError, OSError``) caught it: the executor task died silently,
the job stayed ``running`` (its ledger step retaken after its lease by the next sidecar, whose
executor died the same way), and :meth:`Sidecar.stop` raised the error again before the
writer's close. The purge list, the job view, a request's provenance and ``audit verify`` read
the same rows.

Now (``docs/ledger.md``, "Bounded JSON"): every engine decodes JSON through
:mod:`kvgov.boundedjson` (a value past the bounds reads as a fixed marker, which no hash check
accepts and ``audit verify`` names), the executor survives any error of a pass, and a stop
survives a dead task. Postgres as the runtime role a sidecar has, and SQLite where it applies.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from sqlalchemy import text
from sqlalchemy.orm import Session
from typer.testing import CliRunner

from kvgov.boundedjson import UNDECODABLE_KEY, is_undecodable, undecodable
from kvgov.cli.main import build_app
from kvgov.db.engine import make_engine, upgrade, utcnow
from kvgov.db.models import ChainSeal, LedgerEvent, PurgeJob, PurgeStep, table
from kvgov.db.purge_views import PurgeRequest
from kvgov.db.tokens import TokenRepository
from kvgov.ledger.chain import ChainedFields, link
from kvgov.ledger.seals import SealKind
from kvgov.ledger.verify import Problem
from kvgov.proxy.api.app import create_control_app
from kvgov.proxy.app import build_sidecar
from kvgov.types import Role
from tests.security import doors
from tests.security.doors import engine, run
from tests.security.test_chain_forgery import _head, _put
from tests.security.test_foreign_append import Ledger, _chain, _writer
from tests.security.test_purge_late_evict import LocalTier, _store

pytestmark = pytest.mark.postgres

#: nesting deep enough for Python's JSON decoder, shallow enough for Postgres' jsonb
DEPTH = 5000
DEEP = "[" * DEPTH + "]" * DEPTH


def _deep_attrs(**named: Any) -> str:
    """``named`` as a JSON object with one more member nested :data:`DEPTH` deep."""
    return json.dumps({**named, "x": "@"}).replace('"@"', DEEP)


def _plant(
    sc_engine: object, job_id: str, tenant: str, *, attrs: str | None = None, at: object = None
) -> str:
    """As the runtime role: a chain of its own, and one ``purge:step`` row on it that names
    ``job_id`` (no valid hash needed: it is decoded before anything is checked), its ``attrs``
    nested :data:`DEPTH` deep unless given, dated ``at`` (now unless given); its chain id."""
    chain = f"junk-{uuid.uuid4().hex[:8]}"
    attrs = attrs if attrs is not None else _deep_attrs(purge_id=job_id, step="tiers")
    with sc_engine.begin() as conn:  # type: ignore[attr-defined]
        conn.execute(
            text("INSERT INTO chains (chain_id, public_key, created_at) VALUES (:c, :k, :t)"),
            {"c": chain, "k": b"\0" * 32, "t": utcnow()},
        )
        conn.execute(
            text(
                "INSERT INTO ledger_events (chain_id, seq, prev_hash, hash, encoding_version, "
                "occurred_at, kind, tenant, attrs) VALUES (:c, 1, :h, :h, 1, :t, 'purge:step', "
                ":tenant, CAST(:a AS jsonb))"
            ),
            {"c": chain, "h": "0" * 64, "t": at or utcnow(), "tenant": tenant, "a": attrs},
        )
    return chain


async def test_a_deeply_nested_ledger_row_does_not_kill_the_purge_executor(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    sc = await build_sidecar(doors.settings(tmp_path, prod_db))
    await sc.start()
    stop_error: BaseException | None = None
    try:
        acme = engine(sc, "tok-acme")
        local = LocalTier()
        channel = acme.control(local.on_evict, reconnect_delay=0.1)
        try:
            assert await run(channel.connected.wait, 10)
            await _store(acme, local, 0xF1, "alice")
        finally:
            channel.close()
            acme.close()
        assert sc.purge is not None and sc.purge.task is not None and sc.engine is not None
        service = sc.purge.service
        job = await service.create(PurgeRequest(tenant="acme", user="alice", requested_by="t"))
        _plant(sc.engine, job.id, job.tenant)  # the attacker reads purge_jobs and plants it
        sc.purge.wake()
        finished = None
        for _ in range(100):
            got = await service.get(job.id)
            if got.finished:
                finished = got
                break
            await asyncio.sleep(0.2)
        executor = sc.purge.task
        died = executor.exception() if executor.done() else None
    finally:
        try:
            await sc.stop()
        except BaseException as exc:
            stop_error = exc
    assert finished is not None and died is None, (
        f"one forged ledger row (attrs nested {DEPTH} deep) naming purge {job.id}: finished="
        f"{finished is not None}, the sidecar's purge executor died of "
        f"{type(died).__name__}, and Sidecar.stop() raised {type(stop_error).__name__}"
    )
    assert stop_error is None, f"Sidecar.stop() raised {type(stop_error).__name__}"


# -- the decoder, on both backends ------------------------------------------------------------


@pytest.fixture(params=[pytest.param("postgres", marks=pytest.mark.postgres), "sqlite"])
def ledger(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Ledger]:
    """The migrated ledger; ``attacker``: the runtime role on Postgres."""
    if request.param == "postgres":
        url = request.getfixturevalue("prod_db").url
    else:
        url = f"sqlite:///{(tmp_path / 'ledger.db').as_posix()}"
        upgrade(url)
    attacker = make_engine(url)
    try:
        yield Ledger(url, attacker)
    finally:
        attacker.dispose()


def _as_json(conn: sa.Connection, param: str) -> str:
    """``param`` as a JSON value in SQL (SQLite keeps the text as it is)."""
    return f"CAST(:{param} AS jsonb)" if conn.dialect.name == "postgresql" else f":{param}"


def _plant_rows(attacker: sa.Engine) -> tuple[str, str]:
    """As the runtime role: a job whose ``result`` and ``engines`` step detail, and a
    ``kv:get`` row on a chain of its own whose ``attrs``, are nested :data:`DEPTH` deep; the
    job's id and the row's chain."""
    job, chain = str(uuid.uuid4()), f"junk-{uuid.uuid4().hex[:8]}"
    now = utcnow()
    with attacker.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO purge_jobs (id, kind, tenant, subject, state, dry_run, requested_by, "
                f"created_at, updated_at, result) VALUES (:id, 'tenant', 'acme', NULL, 'running', "
                f"false, 'x', :now, :now, {_as_json(conn, 'd')})"
            ),
            {"id": job, "now": now, "d": DEEP},
        )
        conn.execute(
            text(
                "INSERT INTO purge_steps (job_id, name, sidecar_id, state, attempts, detail) "
                f"VALUES (:j, 'engines', 's', 'incomplete', 1, {_as_json(conn, 'd')})"
            ),
            {"j": job, "d": DEEP},
        )
        conn.execute(
            text("INSERT INTO chains (chain_id, public_key, created_at) VALUES (:c, :k, :t)"),
            {"c": chain, "k": b"\0" * 32, "t": now},
        )
        attrs = "CAST(:a AS json)" if conn.dialect.name == "postgresql" else ":a"
        conn.execute(
            text(
                "INSERT INTO ledger_events (chain_id, seq, prev_hash, hash, encoding_version, "
                "occurred_at, kind, tenant, request_id, attrs) VALUES (:c, 1, :h, :h, 1, :t, "
                f"'kv:get', 'acme', 'deep-req', {attrs})"
            ),
            {"c": chain, "h": "0" * 64, "t": now, "a": _deep_attrs(purge_id=job)},
        )
    return job, chain


def test_deep_json_values_read_as_the_marker(ledger: Ledger) -> None:
    """Every way the application reads a JSON column (the ORM, Core, ``text()``) gives the
    marker for a value nested past the bounds, on Postgres as the runtime role and on SQLite;
    never a ``RecursionError``."""
    job, chain = _plant_rows(ledger.attacker)
    events, steps = table(LedgerEvent), table(PurgeStep)
    read: dict[str, object] = {}
    try:
        with Session(ledger.attacker) as s:
            found = s.get(PurgeJob, job)
            assert found is not None
            read["orm: purge_jobs.result"] = found.result
            step = s.scalars(sa.select(PurgeStep).where(PurgeStep.job_id == job)).one()
            read["orm: purge_steps.detail"] = step.detail
        with ledger.attacker.connect() as conn:
            read["core: ledger_events.attrs"] = conn.execute(
                sa.select(events.c.attrs).where(events.c.chain_id == chain)
            ).scalar_one()
            read["core: purge_steps.detail"] = conn.execute(
                sa.select(steps.c.detail).where(steps.c.job_id == job)
            ).scalar_one()
            read["text: purge_steps.detail"] = conn.execute(
                text("SELECT detail FROM purge_steps WHERE job_id = :j"), {"j": job}
            ).scalar_one()
    except RecursionError as exc:
        raise AssertionError(
            f"reading a JSON value nested {DEPTH} deep raised RecursionError (after: "
            f"{sorted(read)})"
        ) from exc
    if ledger.attacker.dialect.name == "postgresql":
        assert all(is_undecodable(v) for v in read.values()), read
    else:  # SQLite: text() returns the stored text, never decoded
        read.pop("text: purge_steps.detail")
        assert all(is_undecodable(v) for v in read.values()), read
    assert dict(undecodable()) == dict(read["core: ledger_events.attrs"])  # type: ignore[call-overload]


def test_a_deep_row_hashed_over_the_marker_never_verifies(ledger: Ledger) -> None:
    """The attacker knows the marker: a row appended to a closed chain whose stored hash is
    the hash over the marker's content, its stored ``attrs`` nested thousands deep. The hash
    check never accepts it: ``audit verify`` names the row ``modified`` (before: verify
    raised ``RecursionError``)."""

    async def write() -> None:
        writer, engine_ = await _writer(ledger.url, "node-deep")
        try:
            for i in range(3):
                await writer.append(_put(i))
        finally:
            await writer.close()
            engine_.dispose()

    asyncio.run(write())
    with ledger.attacker.begin() as conn:
        seq, head = _head(conn, "node-deep")
        now = utcnow()
        fields = dict.fromkeys(ChainedFields.__dataclass_fields__) | {
            "chain_id": "node-deep",
            "seq": seq + 1,
            "prev_hash": head,
            "occurred_at": now,
            "kind": "kv:get",
            "tenant": "acme",
            "attrs": dict(undecodable()),  # what the reader decodes the stored value to
            "encoding_version": 1,
        }
        fields.pop("attrs_json")
        forged_hash = link(ChainedFields(**fields))
        attrs = "CAST(:a AS json)" if conn.dialect.name == "postgresql" else ":a"
        conn.execute(
            text(
                "INSERT INTO ledger_events (chain_id, seq, prev_hash, hash, encoding_version, "
                f"occurred_at, kind, tenant, attrs) VALUES (:c, :s, :p, :h, 1, :t, 'kv:get', "
                f"'acme', {attrs})"
            ),
            {"c": "node-deep", "s": seq + 1, "p": head, "h": forged_hash, "t": now, "a": DEEP},
        )
    try:
        report = _chain(ledger.attacker, "node-deep")
    except RecursionError as exc:
        raise AssertionError("audit verify raised RecursionError on one deep row") from exc
    modified = [f for f in report.findings if f.problem is Problem.MODIFIED]
    assert [f.seq for f in modified] == [seq + 1], report.findings
    assert "too deep" in modified[0].detail
    assert report.head_seq == seq  # the walk stops there, as at any modified row


# -- the API and the CLI over such rows --------------------------------------------------------


async def test_the_api_and_audit_verify_answer_over_deep_rows(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    """The purge list and job (late evictions are read for them), a request's provenance and
    ``/v1/audit/verify`` answer 200 over deep rows naming the job and the request;
    ``kvgov audit verify`` exits 1 naming the row (before: 500s, and a crash)."""
    answers: dict[str, httpx.Response] = {}
    async with doors.sidecar(tmp_path, prod_db) as sc:
        assert sc.purge is not None and sc.engine is not None
        job = await sc.purge.service.create(
            PurgeRequest(tenant="acme", user="alice", requested_by="t")
        )
        await asyncio.wait_for(sc.purge.service.wait(job.id), 60)
        _, chain = _plant_rows(sc.engine)
        with sc.engine.begin() as conn:  # a late EVICT naming the finished job, nested deep
            conn.execute(
                text(
                    "INSERT INTO ledger_events (chain_id, seq, prev_hash, hash, encoding_version,"
                    " occurred_at, kind, tenant, attrs) VALUES (:c, 2, :h, :h, 1, :t,"
                    " 'purge:evict:late', 'acme', CAST(:a AS json))"
                ),
                {"c": chain, "h": "0" * 64, "t": utcnow(), "a": _deep_attrs(purge_id=job.id)},
            )
        with Session(sc.engine) as s:
            _, raw = TokenRepository(s).create(Role.AUDITOR, tenant=None)
            s.commit()
        auditor = {"Authorization": f"Bearer {raw}"}
        transport = httpx.ASGITransport(app=create_control_app(sc.control_plane()))
        async with httpx.AsyncClient(transport=transport, base_url="http://kvgov.test") as c:
            for path in (
                "/v1/purges",
                f"/v1/purges/{job.id}",
                "/v1/requests/deep-req/provenance",
                "/v1/audit/verify",
            ):
                answers[path] = await c.get(path, headers=auditor)
        data_dir = sc.settings.data_dir
    failed = {p: r.status_code for p, r in answers.items() if r.status_code != 200}
    assert not failed, f"the API failed over rows nested {DEPTH} deep: {failed}"
    verdict = answers["/v1/audit/verify"].json()
    assert verdict["ok"] is False
    junk = next(ch for ch in verdict["chains"] if ch["chain_id"] == chain)
    assert junk["ok"] is False and junk["findings"] >= 1, junk
    assert UNDECODABLE_KEY not in answers["/v1/purges"].text  # the row counts for nothing
    env = {"KVGOV_DATABASE_URL": prod_db.url, "KVGOV_DATA_DIR": str(data_dir)}
    result = CliRunner().invoke(build_app(), ["audit", "verify"], env=env)
    assert not isinstance(result.exception, RecursionError), result.exception
    assert result.exit_code == 1, result.output
    assert f"BROKEN {chain}" in result.output


# -- the executor and the stop survive what they did not expect --------------------------------


async def test_the_purge_executor_survives_any_error_of_a_pass(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    """A pass that fails with an error nobody expected (here a ``RecursionError``, as one deep
    row raised it) is logged, counted, and the next pass runs the job (before: the task died
    and no purge of the sidecar ever ran again)."""
    sc = await build_sidecar(doors.settings(tmp_path, prod_db))
    await sc.start()
    stop_error: BaseException | None = None
    try:
        assert sc.purge is not None and sc.purge.task is not None
        service = sc.purge.service
        honest = service.run_until_idle
        failures = []

        async def first_fails() -> int:
            if not failures:
                failures.append(1)
                raise RecursionError("maximum recursion depth exceeded")
            return await honest()

        service.run_until_idle = first_fails  # type: ignore[method-assign]
        job = await service.create(PurgeRequest(tenant="acme", user="bob", requested_by="t"))
        sc.purge.wake()
        finished = await doors.until(lambda: sc.purge is not None and sc.purge.steps_run > 0, 10)
        task = sc.purge.task
        died = task.exception() if task.done() else None
        got = await service.get(job.id)
        counted = sc.metrics.registry.get_sample_value(
            "kvgov_background_task_errors_total", {"task": "kvgov-purge-executor"}
        )
    finally:
        try:
            await sc.stop()
        except BaseException as exc:
            stop_error = exc
    assert died is None and failures, f"the purge executor died of {type(died).__name__}"
    assert finished and got.finished, got.state
    assert counted == 1
    assert stop_error is None, f"Sidecar.stop() raised {type(stop_error).__name__}"


async def test_a_dead_background_task_does_not_stop_the_writers_close(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    """A background task that died of an unexpected error: the stop logs and counts it, and
    goes on to the writer's close (before: ``stop()`` raised it again, with no final
    checkpoint and no close seal)."""
    sc = await build_sidecar(doors.settings(tmp_path, prod_db))
    await sc.start()

    async def dies() -> None:
        raise RecursionError("maximum recursion depth exceeded")

    task = asyncio.create_task(dies(), name="kvgov-doomed")
    await asyncio.wait([task])
    sc._tasks.append(task)
    assert sc.writer is not None and sc.engine is not None
    chain_id = sc.writer.chain_id
    attacker = make_engine(prod_db.url)
    stop_error: BaseException | None = None
    try:
        try:
            await sc.stop()
        except BaseException as exc:
            stop_error = exc
        seals = table(ChainSeal)
        with attacker.connect() as conn:
            closes = conn.execute(
                sa.select(sa.func.count()).where(
                    seals.c.chain_id == chain_id, seals.c.kind == SealKind.CLOSE.value
                )
            ).scalar_one()
    finally:
        attacker.dispose()
    assert stop_error is None, f"Sidecar.stop() raised {type(stop_error).__name__}"
    assert closes == 1, "the writer's close never ran"
    counted = sc.metrics.registry.get_sample_value(
        "kvgov_background_task_errors_total", {"task": "kvgov-doomed"}
    )
    assert counted == 1

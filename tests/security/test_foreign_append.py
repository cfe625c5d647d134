"""The runtime database role appends to a LIVE writer's chain.

Attack (the hole ``docs/ledger.md`` "Chain seals" documented): every sidecar pod holds the
runtime role, which may INSERT into ``ledger_events``, and the chain hash is unkeyed. With
stolen runtime credentials an attacker computes correctly chained rows (a ``kv:get`` naming
any request, a ``purge:step`` that makes a purge receipt complete) and appends them to a
serving sidecar's chain. The writer re-chained its next batch on the database's head, its
next checkpoint and its close signed over the forged rows, its session covered them, and
``audit verify`` and the purge receipt's cross-check took them for its own.

Now the writer compares the head it reads under the chain lock with the head it last wrote;
rows it did not write, and that no other writer session of the chain explains (a ``kvgov
token`` command beside it), are named by a signed ``foreign`` seal in the same transaction,
before its own rows (and before a checkpoint or its close). Verification fails them
(``foreign_append``) and the receipt's cross-check refuses them. The honest cases (a lost
commit reply, a batch re-chained after a refused event, a CLI command writing to the live
sidecar's chain, many batches and checkpoints) write no foreign seal and verify.

Postgres tests connect as the runtime role a production sidecar uses (``prod_db``); the SQLite
ones as whoever can write the file.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from kvgov.cli.main import build_app
from kvgov.config import Settings
from kvgov.db.engine import make_engine, upgrade, utcnow
from kvgov.db.models import ChainSeal, table
from kvgov.db.purge_views import StepName
from kvgov.errors import LedgerError
from kvgov.ledger.chain import public_key_bytes
from kvgov.ledger.checkpoint import write_checkpoint
from kvgov.ledger.events import Appended, Event
from kvgov.ledger.trust import verify_trusted
from kvgov.ledger.verify import ChainReport, VerifyReport
from kvgov.ledger.writer import LedgerWriter
from kvgov.services.purge.documents import read_detail
from kvgov.types import EventKind
from tests.integration.test_ledger_lost_reply import LoseCommitReplies
from tests.integration.test_purge_service import CHAIN, Env
from tests.security import test_receipt_forgery as forgery
from tests.security.doors import ProdDatabase
from tests.security.test_chain_forgery import FRAMED, NODE_KEY, PEM, TRUSTED, _forge, _head, _put
from tests.security.test_receipt_forgery import _inflate_tiers_step, _receipt

# the purge world of the receipt attacks, and its runtime role (their fixtures)
env = forgery.env
sqlite_env = forgery.sqlite_env
runtime_role = forgery.runtime_role


@dataclass(frozen=True)
class Ledger:
    """A migrated ledger database: the writer's and the attacker's engines (on Postgres both
    connect as the runtime role; on SQLite whoever can write the file)."""

    url: str
    attacker: sa.Engine


@pytest.fixture(params=[pytest.param("postgres", marks=pytest.mark.postgres), "sqlite"])
def ledger(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Ledger]:
    if request.param == "postgres":
        prod: ProdDatabase = request.getfixturevalue("prod_db")
        url = prod.url
    else:
        url = f"sqlite:///{(tmp_path / 'ledger.db').as_posix()}"
        upgrade(url)
    attacker = make_engine(url)
    try:
        yield Ledger(url, attacker)
    finally:
        attacker.dispose()


def _cli_env(ledger: Ledger, data_dir: Path) -> dict[str, str]:
    """The node's CLI: the ledger's URL and the node's signing key."""
    key_path = data_dir / "ledger-signing.key"
    key_path.write_text(PEM)
    key_path.chmod(0o600)
    return {"KVGOV_DATABASE_URL": ledger.url, "KVGOV_DATA_DIR": str(data_dir)}


def _verify(engine: sa.Engine) -> VerifyReport:
    return verify_trusted(engine, TRUSTED)


def _chain(engine: sa.Engine, chain_id: str) -> ChainReport:
    return next(c for c in _verify(engine).chains if c.chain_id == chain_id)


def _seals(engine: sa.Engine, chain_id: str, kind: str) -> list[Any]:
    t = table(ChainSeal)
    with engine.connect() as conn:
        return list(
            conn.execute(
                sa.select(t).where(t.c.chain_id == chain_id, t.c.kind == kind).order_by(t.c.seq)
            )
        )


def _append_forged(engine: sa.Engine, chain_id: str, events: list[dict[str, Any]]) -> list[int]:
    """The attack: correctly chained rows after the live chain's head; their positions."""
    with engine.begin() as conn:
        seq, head = _head(conn, chain_id)
        _forge(conn, chain_id, seq + 1, head, events, utcnow())
    return list(range(seq + 1, seq + 1 + len(events)))


async def _writer(url: str, chain_id: str, **kw: Any) -> tuple[LedgerWriter, sa.Engine]:
    engine = make_engine(url)
    writer = LedgerWriter(engine, chain_id=chain_id, signing_key=NODE_KEY, **kw)
    await writer.start()
    return writer, engine


# -- the attack -----------------------------------------------------------------------------


def test_rows_appended_to_a_live_writers_chain_fail_verification(
    ledger: Ledger, tmp_path: Path
) -> None:
    """A serving writer, a forged ``purge`` and ``kv:get`` appended between its batches, then
    its next batch, a checkpoint and its clean close: all signed by the writer before."""
    forged: list[int] = []

    async def run() -> None:
        writer, engine = await _writer(ledger.url, "node-live")
        try:
            for i in range(3):
                await writer.append(_put(i))
            assert await writer.write_checkpoint() is not None
            forged.extend(_append_forged(ledger.attacker, "node-live", FRAMED))
            for i in range(3, 5):
                await writer.append(_put(i))  # re-chained on the forged rows
            assert await writer.write_checkpoint() is not None  # signs a head past them
        finally:
            await writer.close()
            engine.dispose()

    asyncio.run(run())
    report = _verify(ledger.attacker)
    chain = next(c for c in report.chains if c.chain_id == "node-live")
    assert not report.ok, (
        f"audit verify: ok; rows {forged} appended by the runtime role to a live writer's chain"
        f" pass ({chain.events} events, {chain.checkpoints} checkpoints, closed={chain.closed})"
    )
    assert chain.first_bad is not None
    assert chain.first_bad.problem == "foreign_append", chain.to_dict()
    assert chain.first_bad.seq == forged[0] == 4
    assert f"{forged[0]}..{forged[-1]}" in chain.first_bad.detail
    seals = _seals(ledger.attacker, "node-live", "foreign")
    assert [(s.seq, s.session.split("@")[1]) for s in seals] == [(forged[-1], str(forged[0]))]
    # the writer's own events around them are not blamed: only the forged positions fail
    assert {f.problem for f in chain.findings} == {"foreign_append"}
    # `kvgov audit verify` (the CLI; the API and the dashboard run the same verifier)
    result = CliRunner().invoke(build_app(), ["audit", "verify"], env=_cli_env(ledger, tmp_path))
    assert result.exit_code == 1, result.output
    assert "BROKEN node-live: foreign_append at seq 4: events 4..5" in result.output


def test_the_writer_logs_and_counts_the_foreign_rows(
    ledger: Ledger, caplog: pytest.LogCaptureFixture
) -> None:
    async def run() -> LedgerWriter:
        writer, engine = await _writer(ledger.url, "node-log")
        try:
            await writer.append(_put(0))
            _append_forged(ledger.attacker, "node-log", FRAMED)
            with caplog.at_level(logging.ERROR):
                await writer.append(_put(1))
            assert (await writer.append(_put(2))).seq == 5
        finally:
            await writer.close()
            engine.dispose()
        return writer

    writer = asyncio.run(run())
    logged = [r for r in caplog.records if r.getMessage() == "ledger.chain.foreign_append"]
    assert len(logged) == 1, [r.getMessage() for r in caplog.records]
    assert logged[0].levelno == logging.ERROR
    fields = {
        k: v for k, v in vars(logged[0]).items() if k in ("chain_id", "first_seq", "last_seq")
    }
    assert fields == {"chain_id": "node-log", "first_seq": 2, "last_seq": 3}
    assert "req-framed" not in str(vars(logged[0]))  # positions, never the rows' contents
    assert writer.stats.foreign_appends == 2  # type: ignore[attr-defined]
    assert writer.stats.foreign_seals == 1  # type: ignore[attr-defined]


def test_an_idle_writers_checkpoint_disclaims_the_rows_first(ledger: Ledger) -> None:
    """No batch follows the forged rows: the periodic checkpoint reads the head, finds it is
    not its own, and signs the foreign seal before it signs anything."""

    async def run() -> None:
        writer, engine = await _writer(ledger.url, "node-idle")
        try:
            await writer.append(_put(0))
            assert await writer.write_checkpoint() is not None
            _append_forged(ledger.attacker, "node-idle", FRAMED[1:])
            assert _seals(ledger.attacker, "node-idle", "foreign") == []
            await writer.write_checkpoint()
            seals = _seals(ledger.attacker, "node-idle", "foreign")
            assert [s.seq for s in seals] == [2], seals
            await writer.write_checkpoint()  # once: the next one finds nothing new
            assert len(_seals(ledger.attacker, "node-idle", "foreign")) == 1
        finally:
            await writer.close()
            engine.dispose()

    asyncio.run(run())
    chain = _chain(ledger.attacker, "node-idle")
    assert chain.first_bad is not None, chain.to_dict()
    assert chain.first_bad.problem == "foreign_append" and chain.first_bad.seq == 2
    # nor does an operator's `kvgov audit checkpoint` sign the head those rows end on
    with pytest.raises(LedgerError, match="appended to it by someone other than its writer"):
        write_checkpoint(ledger.attacker, "node-idle", NODE_KEY)


def test_a_close_disclaims_the_rows_appended_since_the_last_batch(ledger: Ledger) -> None:
    async def run() -> None:
        writer, engine = await _writer(ledger.url, "node-close")
        try:
            await writer.append(_put(0))
            _append_forged(ledger.attacker, "node-close", FRAMED)
        finally:
            await writer.close(checkpoint=True)
            engine.dispose()

    asyncio.run(run())
    chain = _chain(ledger.attacker, "node-close")
    assert chain.first_bad is not None, chain.to_dict()
    assert chain.first_bad.problem == "foreign_append" and chain.first_bad.seq == 2
    assert [s.seq for s in _seals(ledger.attacker, "node-close", "foreign")] == [3]


def _forge_step_on_live_chain(env: Env, role: str | None, job: Any, detail: dict[str, Any]) -> int:
    """INSERT (as the runtime role on Postgres) a ``purge:step`` event matching the tampered
    ``tiers`` row, correctly chained after the head of the LIVE writer's chain."""
    event = {
        "kind": "purge:step",
        "tenant": job.tenant,
        "actor": job.subject,
        "outcome": "ok",
        "reason": "completed",
        "principal": "sidecar",
        "attrs": {
            "purge_id": job.id,
            "step": "tiers",
            "sidecar_id": None,
            "attempt": 99,
            "summary": read_detail(StepName.TIERS, detail).summary(),
        },
    }
    with env.engine.begin() as conn:
        if role is not None:
            conn.exec_driver_sql(f'SET LOCAL ROLE "{role}"')
        seq, head = _head(conn, CHAIN)
        _forge(conn, CHAIN, seq + 1, head, [event], datetime.now(UTC))
    return seq + 1


async def _forged_receipt(env: Env, role: str | None) -> tuple[dict[str, Any], int]:
    service, job, _, forged = await _inflate_tiers_step(env, role)
    seq = _forge_step_on_live_chain(env, role, job, forged)
    job = await asyncio.wait_for(service.wait(job.id), 30)
    return _receipt(env, job), seq


@pytest.mark.postgres
async def test_a_step_event_appended_to_the_live_chain_is_not_signed_completed(
    env: Env, runtime_role: str
) -> None:
    r, seq = await _forged_receipt(env, runtime_role)
    assert not (r["state"] == "completed" and r["entries_purged"] == 120), (
        f"signed {r['state']!r} with entries_purged={r['entries_purged']}: the purge:step event"
        f" the runtime role appended to the live writer's chain at {seq} was taken as its own"
    )
    assert any(line.startswith("tiers") for line in r["incomplete"]), r["incomplete"]
    report = verify_trusted(env.engine, [public_key_bytes(env.key)])
    chain = next(c for c in report.chains if c.chain_id == CHAIN)
    assert chain.first_bad is not None and chain.first_bad.problem == "foreign_append"
    assert chain.first_bad.seq == seq


async def test_sqlite_a_step_event_appended_to_the_live_chain_is_not_signed_completed(
    sqlite_env: Env,
) -> None:
    r, seq = await _forged_receipt(sqlite_env, None)
    assert r["state"] != "completed", f"signed completed with the event appended at {seq}"
    assert r["entries_purged"] != 120
    assert any(line.startswith("tiers") for line in r["incomplete"]), r["incomplete"]


# -- no false alarm -------------------------------------------------------------------------


def _clean(engine: sa.Engine, chain_id: str) -> ChainReport:
    """The chain verifies and holds no foreign seal."""
    report = _verify(engine)
    assert report.ok, report.to_dict()
    assert _seals(engine, chain_id, "foreign") == []
    return next(c for c in report.chains if c.chain_id == chain_id)


def test_many_batches_and_checkpoints_write_no_foreign_seal(ledger: Ledger) -> None:
    async def run() -> LedgerWriter:
        writer, engine = await _writer(ledger.url, "node-busy", batch_max_events=40)
        try:
            for round_ in range(5):
                futures = [writer.submit(_put(round_ * 200 + i)) for i in range(150)]
                lazy = [writer.submit_lazy(Event(kind=EventKind.KV_MISS)) for _ in range(50)]
                await asyncio.gather(*futures, *lazy)
                await writer.write_checkpoint()
        finally:
            await writer.close(checkpoint=True)
            engine.dispose()
        return writer

    writer = asyncio.run(run())
    assert _clean(ledger.attacker, "node-busy").events == 1000
    assert writer.stats.foreign_appends == 0  # type: ignore[attr-defined]


@pytest.mark.postgres
def test_a_lost_commit_reply_writes_no_foreign_seal(prod_db: ProdDatabase) -> None:
    async def run() -> None:
        writer, engine = await _writer(prod_db.url, "node-lost", batch_max_events=20)
        try:
            await writer.append(_put(0))
            faults = LoseCommitReplies(engine)
            faults.pending = 1
            got = await asyncio.gather(*(writer.submit(_put(i)) for i in range(1, 60)))
            assert [a.seq for a in got] == list(range(2, 61))
            assert faults.lost == 1
            faults.pending = 1  # a lone event too: found by its retry, not written again
            assert (await writer.append(_put(99))).seq == 61
            await writer.write_checkpoint()
            await writer.append(_put(100))
        finally:
            await writer.close()
            engine.dispose()

    asyncio.run(run())
    attacker = make_engine(prod_db.url)
    try:
        _clean(attacker, "node-lost")
    finally:
        attacker.dispose()


@pytest.mark.postgres
def test_a_batch_rechained_after_a_refused_event_writes_no_foreign_seal(
    prod_db: ProdDatabase,
) -> None:
    """The sequencer chains the next batch on the head it expects the previous one to leave;
    an event the database refuses makes that head stale: a re-chain, not a foreign append."""

    def event(i: int) -> Event:
        if i % 97 == 50:  # past bigint: prepare lets it through, Postgres refuses it
            return Event(kind=EventKind.KV_MISS, nbytes=2**63)
        return Event(kind=EventKind.KV_MISS, nbytes=i, request_id=f"r{i % 7}")

    async def run() -> list[Any]:
        writer, engine = await _writer(prod_db.url, "node-refused", batch_max_events=30)
        try:
            results = await asyncio.gather(
                *(writer.submit(event(i)) for i in range(600)), return_exceptions=True
            )
            await writer.write_checkpoint()
        finally:
            await writer.close()
            engine.dispose()
        return results

    results = asyncio.run(run())
    refused = [r for r in results if not isinstance(r, Appended)]
    assert len(refused) == 6, refused
    attacker = make_engine(prod_db.url)
    try:
        assert _clean(attacker, "node-refused").events == 594
    finally:
        attacker.dispose()


def test_a_cli_command_writing_to_the_live_sidecars_chain_is_no_foreign_append(
    ledger: Ledger, tmp_path: Path
) -> None:
    """``kvgov token create`` on the sidecar's host (``append_events``: its own non-exclusive
    session, events, a checkpoint, a close) while the sidecar writes: each sees rows it did
    not write, which the other's signed session explains."""
    from kvgov.cli._common import append_events

    _cli_env(ledger, tmp_path)  # the node's signing key
    key_path = tmp_path / "ledger-signing.key"
    settings = Settings(
        data_dir=tmp_path,
        database={"url": ledger.url},
        ledger={"chain_id": "node-cli", "signing_key_path": key_path},
    )

    async def run() -> None:
        sidecar, engine = await _writer(ledger.url, "node-cli", batch_max_events=5)
        cli_engine = make_engine(ledger.url)
        stop = asyncio.Event()

        async def serve() -> None:  # the sidecar keeps writing while the commands run
            i = 0
            while not stop.is_set():
                await asyncio.gather(*(sidecar.submit(_put(i + j)) for j in range(7)))
                i += 7
                await asyncio.sleep(0)

        try:
            await sidecar.append(_put(-1))
            serving = asyncio.create_task(serve())
            for n in range(3):
                events = [
                    Event(kind=EventKind.TOKEN_CREATED, principal=f"cli-{n}-{i}") for i in range(12)
                ]
                await append_events(settings, cli_engine, *events)
                await sidecar.write_checkpoint()
            stop.set()
            await serving
            await sidecar.append(_put(10_000))
            await sidecar.write_checkpoint()
            assert sidecar.stats.foreign_appends == 0  # type: ignore[attr-defined]
        finally:
            await sidecar.close(checkpoint=True)
            engine.dispose()
            cli_engine.dispose()

    asyncio.run(run())
    chain = _clean(ledger.attacker, "node-cli")
    assert chain.sessions == 4 and chain.closed


def test_rows_after_a_cli_command_closed_are_foreign(ledger: Ledger) -> None:
    """The other session explains only what it covers: rows appended after the CLI's close
    are the attacker's, and the live sidecar disclaims them."""

    async def run() -> None:
        sidecar, engine = await _writer(ledger.url, "node-after-cli")
        try:
            await sidecar.append(_put(0))
            cli, cli_engine = await _writer(ledger.url, "node-after-cli", exclusive=False)
            await cli.append(Event(kind=EventKind.TOKEN_CREATED, principal="cli"))
            await cli.close(checkpoint=True)
            cli_engine.dispose()
            _append_forged(ledger.attacker, "node-after-cli", FRAMED[1:])
            await sidecar.append(_put(1))
        finally:
            await sidecar.close()
            engine.dispose()

    asyncio.run(run())
    chain = _chain(ledger.attacker, "node-after-cli")
    assert chain.first_bad is not None, chain.to_dict()
    assert (chain.first_bad.problem, chain.first_bad.seq) == ("foreign_append", 3)
    assert len(_seals(ledger.attacker, "node-after-cli", "foreign")) == 1


# -- a CLI session a starting sidecar ends (review r11, F2) ---------------------------------
#
# Not an attack but a false alarm: a ``kvgov token``/``kvgov tenant`` command (``append_events``)
# writes to the node's chain while the sidecar starts. The sidecar's open is exclusive (it holds
# its journal's lock), so it ends every session opened before it, the command's included. The
# command, alive, goes on appending its own rows; they were covered only once its close resumed,
# and the sidecar's next batch sealed them ``foreign`` before that, for ever. Now a writer
# re-opens its session (``seals.keep_open``) in the very transaction that writes: whenever that
# transaction finds the head moved, and, for the CLI's writer (``every_transaction``), always.


def test_a_cli_session_ended_by_the_sidecars_start_is_not_sealed_foreign(ledger: Ledger) -> None:
    """Review r11's demonstration (its assertions kept): the sidecar writes between the
    command's rows."""
    chain_id = "node-r11-start"

    async def run() -> None:
        # the command starts first (no sidecar serving yet: on Postgres it even takes the lock)
        cli, cli_engine = await _writer(ledger.url, chain_id)
        await cli.append(Event(kind=EventKind.TOKEN_CREATED, principal="cli-0"))
        # the sidecar starts beside it: a journaled sidecar's open is exclusive
        sidecar, engine = await _writer(ledger.url, chain_id, exclusive=True)
        try:
            await sidecar.append(_put(0))
            # the command goes on with its own rows, then the sidecar serves a put
            await cli.append(Event(kind=EventKind.TOKEN_CREATED, principal="cli-1"))
            await sidecar.append(_put(1))
            await cli.close(checkpoint=True)
        finally:
            await sidecar.close(checkpoint=True)
            engine.dispose()
            cli_engine.dispose()

    asyncio.run(run())
    chain = _chain(ledger.attacker, chain_id)
    foreign = _seals(ledger.attacker, chain_id, "foreign")
    assert chain.first_bad is None and foreign == [], (chain.to_dict(), len(foreign))


def test_a_cli_row_written_right_after_the_sidecars_open_is_not_sealed_foreign(
    ledger: Ledger,
) -> None:
    """The command writes after the sidecar's open and before the sidecar's first row: its
    transaction finds no head moved (an open moves none), so only the CLI's writer checking
    its session in every transaction (``append_events``: ``every_transaction``) re-opens it
    before that row."""
    chain_id = "node-cli-race"

    async def run() -> None:
        cli, cli_engine = await _writer(ledger.url, chain_id, every_transaction=True)
        await cli.append(Event(kind=EventKind.TOKEN_CREATED, principal="cli-0"))
        sidecar, engine = await _writer(ledger.url, chain_id, exclusive=True)
        try:
            await cli.append(Event(kind=EventKind.TOKEN_CREATED, principal="cli-1"))
            await sidecar.append(_put(0))  # finds the command's row (2)
            await cli.append(Event(kind=EventKind.TOKEN_CREATED, principal="cli-2"))
            await sidecar.append(_put(1))
            assert sidecar.stats.foreign_appends == 0  # type: ignore[attr-defined]
            await cli.close(checkpoint=True)
        finally:
            await sidecar.close(checkpoint=True)
            engine.dispose()
            cli_engine.dispose()

    asyncio.run(run())
    foreign = _seals(ledger.attacker, chain_id, "foreign")
    chain = _chain(ledger.attacker, chain_id)
    assert chain.first_bad is None and foreign == [], (chain.to_dict(), len(foreign))
    assert chain.events == 5 and chain.closed

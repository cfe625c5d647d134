"""A chain row whose hash is not hex must not stop the chain's writer (review r13, F2).

The attack: the runtime database role (every sidecar pod) may INSERT into ``ledger_events``,
``checkpoints`` and ``chain_seals``, whose hash columns were plain ``VARCHAR(64)``. One
``ledger_events`` row with ``hash = 'z' * 64`` at a live chain's head: the writer's foreign
watch sealed it, the seal's note decoded the hash with ``bytes.fromhex``, the ``ValueError``
escaped the watch, and the committer took it for the database refusing the EVENTS: it refused
every one, its checkpoints and close failed, and its restart failed in ``open_session`` the same
way. The pod recorded nothing (puts, gets, denials, purge steps) and crash-looped.

Now (``docs/ledger.md``, "Malformed rows"):

- migration 0014 makes the database refuse such a row (Postgres: owner triggers, which the
  runtime role can neither drop nor disable, raising a check violation; rows already there are
  left alone, so an old junk row does not fail the upgrade; SQLite: ``BEFORE INSERT``
  triggers);
- a row from before it (or from a database not yet upgraded) no longer stops anything: the
  writer chains on, and signs, the hash's stand-in (``kvgov.ledger.chain.link_target``), the
  seal notes refuse a non-hex head with ``LedgerSealError``, the watch turns any failure of its
  own into that error (retried and alerted, never the events' refusal), and ``audit verify``
  names the row (``malformed``) and checks the writer's rows after it.

The attacks on a ledger as it was before this change (revision 0013: the junk row goes in) run
as the runtime role on Postgres and on SQLite; the database's refusal on the migrated schema too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from kvgov.db.engine import make_engine, upgrade, utcnow
from kvgov.db.models import ChainSeal, Checkpoint, LedgerEvent, table
from kvgov.errors import LedgerError, LedgerSealError
from kvgov.ledger.chain import GENESIS_HASH, checkpoint_note, link_target, public_key_bytes
from kvgov.ledger.events import Appended
from kvgov.ledger.seals import SealKind, foreign_note, session_note
from kvgov.ledger.verify import ChainReport, Problem
from kvgov.ledger.writer import LedgerWriter
from kvgov.ledger.writing import foreign
from tests.pgroles import role_database
from tests.security.test_chain_forgery import NODE_KEY, _forge, _head, _put
from tests.security.test_foreign_append import Ledger, _chain, _seals, _writer, ledger

__all__ = ["ledger"]  # the migrated ledger (Postgres as the runtime role, and SQLite)

#: the revision before migration 0014: the database still takes a malformed hash
BEFORE = "0013"
JUNK = "z" * 64


@dataclass(frozen=True)
class OldLedger(Ledger):
    """A ledger at :data:`BEFORE` (``attacker`` and the writers: the runtime role on
    Postgres); ``owner_url`` migrates it on."""

    owner_url: str
    runtime_role: str = ""

    def upgrade(self) -> None:
        upgrade(self.owner_url, runtime_role=self.runtime_role)


@pytest.fixture(params=[pytest.param("postgres", marks=pytest.mark.postgres), "sqlite"])
def old_ledger(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[OldLedger]:
    if request.param == "postgres":
        with role_database() as db:
            upgrade(db.owner_url, BEFORE, runtime_role=db.runtime)
            attacker = make_engine(db.runtime_url)
            try:
                yield OldLedger(db.runtime_url, attacker, db.owner_url, db.runtime)
            finally:
                attacker.dispose()
        return
    url = f"sqlite:///{(tmp_path / 'ledger.db').as_posix()}"
    upgrade(url, BEFORE)
    attacker = make_engine(url)
    try:
        yield OldLedger(url, attacker, url)
    finally:
        attacker.dispose()


def _append_junk_head(engine: sa.Engine, chain_id: str, digest: Any = JUNK) -> int:
    """The attack: one row after the chain's head whose ``hash`` is not hex; its position."""
    with engine.begin() as conn:
        seq, head = _head(conn, chain_id)
        conn.execute(
            table(LedgerEvent)
            .insert()
            .values(
                chain_id=chain_id,
                seq=seq + 1,
                prev_hash=head,
                hash=digest,
                encoding_version=1,
                occurred_at=utcnow(),
                kind="kv:get",
                tenant="acme",
                outcome="hit",
                attrs={},
            )
        )
    return seq + 1


def _assert_names_only_the_junk_row(report: ChainReport, junk: int, head: int) -> None:
    """Verification names the row and checks every row after it (the writer's, linked to the
    junk hash's stand-in): nothing else is found, and the chain is verified to its head."""
    assert [(f.problem, f.seq) for f in report.findings] == [(Problem.MALFORMED, junk)], (
        report.findings
    )
    assert report.events == report.head_seq == head


# -- the attack on a live writer and on its restart -------------------------------------------


def test_a_junk_head_hash_does_not_stop_the_live_writer(old_ledger: OldLedger) -> None:
    """r13 F2: the writer keeps recording after the junk row, its close works, its foreign seal
    names the row, and verification names it."""
    outcomes: list[Any] = []
    closed: list[str] = []
    state: dict[str, Any] = {}

    async def run() -> None:
        writer, engine = await _writer(old_ledger.url, "node-junk")
        try:
            for i in range(3):
                await writer.append(_put(i))
            state["junk"] = _append_junk_head(old_ledger.attacker, "node-junk")
            for i in range(3, 8):
                try:
                    outcomes.append(await writer.append(_put(i)))
                except LedgerError as err:
                    outcomes.append(err)
            await asyncio.sleep(0.2)
            try:
                outcomes.append(await writer.append(_put(99)))
            except LedgerError as err:
                outcomes.append(err)
            try:
                state["checkpoint"] = await writer.write_checkpoint()
            except Exception as err:
                state["checkpoint"] = err
        finally:
            try:
                await writer.close()
            except Exception as err:
                closed.append(repr(err))
            state["stats"] = writer.stats
            engine.dispose()

    asyncio.run(run())
    refused = [str(o) for o in outcomes if not isinstance(o, Appended)]
    assert not refused, (
        f"the live writer refused {len(refused)} of {len(outcomes)} events after one junk row "
        f"at its head (first: {refused[0]!r}); its close raised {closed}"
    )
    assert not closed
    junk = state["junk"]
    assert not isinstance(state["checkpoint"], Exception), state["checkpoint"]
    assert [o.seq for o in outcomes] == list(range(junk + 1, junk + 7))
    assert state["stats"].events_failed == 0
    assert state["stats"].foreign_appends == 1
    assert state["checkpoint"] is not None and state["checkpoint"].seq == junk + 6
    (seal,) = _seals(old_ledger.attacker, "node-junk", SealKind.FOREIGN)
    assert (seal.seq, seal.head_hash) == (junk, link_target(JUNK))
    with old_ledger.attacker.connect() as conn:
        after = conn.execute(
            sa.select(table(LedgerEvent).c.prev_hash).where(
                table(LedgerEvent).c.chain_id == "node-junk",
                table(LedgerEvent).c.seq == junk + 1,
            )
        ).scalar_one()
    assert after == link_target(JUNK)  # a chain hash: the migrated schema takes it too
    _assert_names_only_the_junk_row(_chain(old_ledger.attacker, "node-junk"), junk, junk + 6)


def test_a_junk_head_hash_does_not_stop_the_writers_restart(old_ledger: OldLedger) -> None:
    """r13 F2: the restart's open signed the head's hash (``session_note``: ``fromhex``), so the
    chain's writer never started again. Now it starts, records and closes; verify names the row."""
    started: list[str] = []
    written: list[Appended] = []

    async def run() -> None:
        writer, engine = await _writer(old_ledger.url, "node-junk2")
        await writer.append(_put(0))
        await writer.close()
        engine.dispose()
        _append_junk_head(old_ledger.attacker, "node-junk2")
        engine = make_engine(old_ledger.url)
        again = LedgerWriter(engine, chain_id="node-junk2", signing_key=NODE_KEY)
        try:
            await again.start()
            written.append(await again.append(_put(1)))
            await again.close(checkpoint=True)
        except Exception as err:
            started.append(repr(err))
        finally:
            engine.dispose()

    asyncio.run(run())
    assert not started, f"the writer's restart on its chain failed: {started[0]}"
    assert [a.seq for a in written] == [3]  # 1: its put, 2: the junk row
    (opened,) = [s for s in _seals(old_ledger.attacker, "node-junk2", SealKind.OPEN) if s.seq]
    assert (opened.seq, opened.head_hash) == (2, link_target(JUNK))
    _assert_names_only_the_junk_row(_chain(old_ledger.attacker, "node-junk2"), 2, 3)


def test_other_malformed_heads_do_not_stop_the_writer(old_ledger: OldLedger) -> None:
    """Upper case (``fromhex`` takes it, the database's check does not), short, non-ASCII, one
    after the other: each is sealed, the writer records after each, and verification names
    each and checks every row between them."""
    junks: list[int] = []
    written: list[Appended] = []
    refused: list[str] = []

    async def run() -> None:
        writer, engine = await _writer(old_ledger.url, "node-junk3")
        try:
            await writer.append(_put(0))
            for i, junk in enumerate(["A" * 64, "ab", "é" * 64], start=1):
                junks.append(_append_junk_head(old_ledger.attacker, "node-junk3", junk))
                try:
                    written.append(await writer.append(_put(i)))
                except LedgerError as err:
                    refused.append(f"after {junk[:2]!r}...: {err}")
        finally:
            await writer.close()
            engine.dispose()

    asyncio.run(run())
    assert not refused, f"the writer refused events after a malformed head: {refused}"
    assert [a.seq for a in written] == [3, 5, 7]
    assert _foreign_runs(old_ledger, "node-junk3") == [(2, 2), (4, 4), (6, 6)]
    report = _chain(old_ledger.attacker, "node-junk3")
    assert [(f.problem, f.seq) for f in report.findings] == [(Problem.MALFORMED, j) for j in junks]
    assert report.events == report.head_seq == 7


def _foreign_runs(ledger: Ledger, chain_id: str) -> list[tuple[int, int]]:
    """The positions the chain's foreign seals name, ``(first, last)``."""
    return sorted(
        (int(s.session.rpartition("@")[2]), int(s.seq))
        for s in _seals(ledger.attacker, chain_id, SealKind.FOREIGN)
    )


# -- the database refuses the row ---------------------------------------------------------------


def test_the_upgrade_keeps_an_old_junk_row_and_the_writer_chains_past_it(
    old_ledger: OldLedger,
) -> None:
    """A junk head written before the upgrade: the migration does not fail on it (``NOT
    VALID``: rows already there are not checked), and the writer's restart chains past it with
    a ``prev_hash`` the new check accepts; verification names the row."""
    failed: list[str] = []

    async def run() -> None:
        writer, engine = await _writer(old_ledger.url, "node-old")
        await writer.append(_put(0))
        await writer.close()
        engine.dispose()
        _append_junk_head(old_ledger.attacker, "node-old")
        old_ledger.upgrade()
        engine = make_engine(old_ledger.url)
        writer = LedgerWriter(engine, chain_id="node-old", signing_key=NODE_KEY)
        try:
            await writer.start()
            for i in range(1, 4):
                await writer.append(_put(i))
            await writer.close()
        except Exception as err:
            failed.append(repr(err))
        finally:
            engine.dispose()

    asyncio.run(run())
    assert not failed, f"the writer could not chain past the old junk row: {failed[0]}"
    _assert_names_only_the_junk_row(_chain(old_ledger.attacker, "node-old"), 2, 5)
    with pytest.raises(sa.exc.IntegrityError):
        _append_junk_head(old_ledger.attacker, "node-old")  # a new one is refused


#: (table, column) of each chain hash, and a row for it (a valid one: every hash ``0``*64)
_HASH_COLUMNS = [
    ("ledger_events", "hash"),
    ("ledger_events", "prev_hash"),
    ("checkpoints", "head_hash"),
    ("chain_seals", "head_hash"),
]


def _row(table_name: str, chain_id: str) -> dict[str, Any]:
    now = datetime.now(UTC)
    if table_name == "ledger_events":
        return {
            "chain_id": chain_id,
            "seq": 1,
            "prev_hash": GENESIS_HASH,
            "hash": GENESIS_HASH,
            "encoding_version": 1,
            "occurred_at": now,
            "kind": "kv:get",
            "attrs": {},
        }
    common = {"chain_id": chain_id, "seq": 1, "head_hash": GENESIS_HASH, "signed_at": now}
    common |= {"signature": b"\x02" * 64, "public_key": b"\x01" * 32}
    if table_name == "checkpoints":
        return common
    return common | {"kind": "open", "session": "s" * 32, "exclusive": False}


_MODELS = {"ledger_events": LedgerEvent, "checkpoints": Checkpoint, "chain_seals": ChainSeal}


#: hashes the database refuses: not hex, upper case (``fromhex`` takes it), short, a newline
#: (which a ``$`` outside a full match would let through)
_MALFORMED = [JUNK, "A" * 64, "a" * 63, "a" * 63 + "\n"]


@pytest.mark.parametrize(("table_name", "column"), _HASH_COLUMNS)
def test_the_database_refuses_a_malformed_chain_hash(
    ledger: Ledger, table_name: str, column: str
) -> None:
    """Migration 0014: the runtime role's INSERT of a hash that is not 64 lowercase hex
    characters is refused, in every chain hash column (the same row with a hex hash goes in)."""
    chain_id = f"c-{table_name}-{column}"
    model = table(_MODELS[table_name])
    with ledger.attacker.begin() as conn:
        conn.execute(
            sa.text("INSERT INTO chains (chain_id, public_key, created_at) VALUES (:c, :pk, :now)"),
            {"c": chain_id, "pk": b"\x01" * 32, "now": datetime.now(UTC)},
        )
    for junk in _MALFORMED:
        with pytest.raises(sa.exc.IntegrityError) as refused, ledger.attacker.begin() as conn:
            conn.execute(model.insert().values(_row(table_name, chain_id) | {column: junk}))
        assert "64 lowercase hex" in str(refused.value), junk
    with ledger.attacker.begin() as conn:
        conn.execute(model.insert().values(_row(table_name, chain_id)))


@pytest.mark.postgres
@pytest.mark.parametrize(
    "statement",
    [
        "DROP TRIGGER ledger_events_hash_format ON ledger_events",
        "ALTER TABLE ledger_events DISABLE TRIGGER ledger_events_hash_format",
        "DROP FUNCTION kvgov_chain_hash_format() CASCADE",
        (
            "CREATE OR REPLACE FUNCTION kvgov_chain_hash_format() RETURNS trigger"
            " LANGUAGE plpgsql AS $$ BEGIN RETURN NULL; END $$"
        ),
    ],
)
def test_the_runtime_role_cannot_remove_the_guard(prod_db: Any, statement: str) -> None:
    """The triggers and their function are the owner's: the runtime role can neither drop,
    disable nor replace them."""
    engine = make_engine(prod_db.url)
    try:
        with pytest.raises(sa.exc.ProgrammingError) as refused, engine.begin() as conn:
            conn.exec_driver_sql(statement)
        # InsufficientPrivilege: not the owner (or, to replace the function, no CREATE)
        assert "must be owner" in str(refused.value) or "permission denied" in str(refused.value)
    finally:
        engine.dispose()


# -- each layer on its own ---------------------------------------------------------------------


def test_seal_and_checkpoint_notes_refuse_a_malformed_head_without_value_error() -> None:
    """A seal's note for a head that is not a chain hash is the seal's failure, never a
    ``ValueError`` (which a committer read as its events' refusal); a checkpoint's is a
    ``LedgerError`` (what the checkpoint loop catches)."""
    at = datetime.now(UTC)
    with pytest.raises(LedgerSealError):
        foreign_note("c", "s", first=1, last=1, head_hash=JUNK, signed_at=at)
    with pytest.raises(LedgerSealError):
        session_note(
            "c", SealKind.OPEN, "s", seq=1, head_hash="A" * 64, signed_at=at, exclusive=False
        )
    with pytest.raises(LedgerError):
        checkpoint_note("c", 1, JUNK, at)
    assert link_target(GENESIS_HASH) == GENESIS_HASH
    assert link_target(JUNK) != link_target("Z" * 64)
    assert link_target(link_target(JUNK)) == link_target(JUNK)


def test_a_failing_watch_is_retried_never_a_refusal_of_the_events(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any failure of the watch's own work (here a ``ValueError`` from its foreign seal, as the
    junk head's ``fromhex`` raised) is a seal failure: the committer retries and alerts, and the
    events are written once the seal goes in."""
    real = foreign.write_foreign_seal
    calls: list[int] = []

    def flaky(*args: Any, **kw: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("non-hexadecimal number found in fromhex() arg at position 0")
        return real(*args, **kw)

    monkeypatch.setattr(foreign, "write_foreign_seal", flaky)
    outcomes: list[Any] = []
    state: dict[str, Any] = {}

    async def run() -> None:
        writer, engine = await _writer(ledger.url, "node-flaky")
        try:
            await writer.append(_put(0))
            with ledger.attacker.begin() as conn:  # a valid foreign row: the watch seals it
                seq, head = _head(conn, "node-flaky")
            _append_valid(ledger.attacker, "node-flaky", seq + 1, head)
            for i in range(1, 4):
                try:
                    outcomes.append(await writer.append(_put(i)))
                except LedgerError as err:
                    outcomes.append(err)
        finally:
            await writer.close()
            state["stats"] = writer.stats
            engine.dispose()

    asyncio.run(run())
    refused = [str(o) for o in outcomes if not isinstance(o, Appended)]
    assert not refused, f"a failure of the watch refused the events: {refused}"
    assert state["stats"].seal_failures >= 1
    assert state["stats"].events_failed == 0
    assert len(_seals(ledger.attacker, "node-flaky", SealKind.FOREIGN)) == 1


def _append_valid(engine: sa.Engine, chain_id: str, seq: int, prev: str) -> None:
    """A correctly chained row someone else appended (what the watch seals as foreign)."""
    with engine.begin() as conn:
        _forge(conn, chain_id, seq, prev, [{"kind": "kv:get", "tenant": "acme"}], utcnow())


def test_verify_reports_junk_in_every_hash_column_without_crashing(
    old_ledger: OldLedger,
) -> None:
    """``audit verify`` on a junk checkpoint, a junk seal and a junk ``prev_hash`` (rows from
    before 0014): findings at their positions, never an exception."""

    async def write() -> None:
        writer, engine = await _writer(old_ledger.url, "node-v")
        try:
            for i in range(2):
                await writer.append(_put(i))
        finally:
            await writer.close()
            engine.dispose()

    asyncio.run(write())
    signed = {"seq": 2, "head_hash": JUNK, "public_key": public_key_bytes(NODE_KEY)}
    with old_ledger.attacker.begin() as conn:
        conn.execute(table(Checkpoint).insert().values(_row("checkpoints", "node-v") | signed))
        conn.execute(table(ChainSeal).insert().values(_row("chain_seals", "node-v") | signed))
        event = {"seq": 3, "prev_hash": JUNK, "hash": "1" * 64}
        conn.execute(table(LedgerEvent).insert().values(_row("ledger_events", "node-v") | event))
    report = _chain(old_ledger.attacker, "node-v")
    found = sorted((f.seq, f.problem) for f in report.findings)
    assert found == [
        (2, Problem.BAD_SIGNATURE),  # the checkpoint
        (2, Problem.BAD_SIGNATURE),  # the seal
        (3, Problem.BROKEN_LINK),  # the row: its prev_hash links to nothing
    ], report.findings

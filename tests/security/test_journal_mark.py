"""Attack: the runtime database role moves the journal mark and acknowledged events vanish.

Review 4b, finding 1. A sidecar acknowledges puts (and journals gets) once their events are
fsynced to its local journal; the writer commits them later and moves
``ledger_journal_marks.applied_upto`` in the same transaction. At start the journal skipped
every record at or below the mark and deleted those segments, and the runtime role may UPDATE
that row (``db/grants.py``). So with the sidecar's database credentials only:

1. hold the chain's advisory lock (any role may): the committer blocks, puts are still
   acknowledged from the journal;
2. wait for an unclean stop (here ``kill -9``);
3. set the mark far ahead and let go of the lock.

The next start dropped and deleted every acknowledged record, and ``audit verify`` still said
the ledger was intact. Now the writer confirms the mark against the chain before the journal
skips or deletes anything (``kvgov.ledger.writing.replay.check_mark``): a mark ahead of the
chain (events would be lost) or behind it (events would be recorded twice) refuses the start
with :class:`LedgerError`, the journal left whole; an operator who sets the mark back gets every
record replayed once.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import psycopg
import pytest
import sqlalchemy as sa
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kvgov.db.engine import make_engine, upgrade
from kvgov.db.models import JournalMark, LedgerEvent
from kvgov.errors import LedgerError
from kvgov.ledger.chain import public_key_bytes
from kvgov.ledger.events import EntryChange, Event
from kvgov.ledger.journal import Journal, decode_event, encode_event
from kvgov.ledger.pgfast import CHAIN_LOCK_CLASS
from kvgov.ledger.trust import verify_trusted
from kvgov.ledger.writer import LedgerWriter
from kvgov.ledger.writing.replay import chain_holds
from kvgov.types import EntryState, EventKind, Outcome
from tests.pgroles import RoleDatabase, role_database

KEY = Ed25519PrivateKey.generate()
PEM = KEY.private_bytes(
    serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
).decode()
CHAIN = "victim"
#: puts per phase; each put comes with a journaled get: 2 * N records per phase
N = 25
ROOT = Path(__file__).resolve().parents[2]

# The sidecar: commits a first round of puts and gets (phase 1), then, once the test holds the
# chain's lock, acknowledges a second round from the journal alone (phase 2) and waits to be
# killed. With "keep", the journal never deletes a segment (a crash between a commit and its
# trim), so records the chain holds are still on disk at the next start.
CHILD = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path
    from cryptography.hazmat.primitives import serialization
    from kvgov.db.engine import make_engine
    from kvgov.ledger.events import Event, EntryChange
    from kvgov.ledger.journal import Journal
    from kvgov.ledger.writer import LedgerWriter
    from kvgov.types import EventKind, EntryState

    async def main(url, pem, journal_dir, n, keep):
        if keep == "keep":
            Journal.trim = lambda self, applied_upto: None
        key = serialization.load_pem_private_key(pem.encode(), password=None)
        writer = LedgerWriter(make_engine(url), chain_id="victim", signing_key=key,
                              journal=Journal(Path(journal_dir)))
        await writer.start()

        async def round(tag):
            acks = []
            for i in range(int(n)):
                entry = EntryChange(key_digest=f"{tag}{i:063x}", state=EntryState.LIVE,
                                    tenant="acme")
                acks.append(writer.submit_queued(Event(kind=EventKind.KV_PUT, tenant="acme",
                                                       request_id=f"{tag}r{i}", nbytes=i,
                                                       entry=entry)))
                writer.submit_lazy(Event(kind=EventKind.KV_GET, tenant="acme",
                                         request_id=f"{tag}g{i}"))
            await asyncio.gather(*acks)

        await round("a")
        await writer.flush()
        print("committed", flush=True)
        sys.stdin.readline()  # the test holds the chain's lock now
        await round("b")
        print("acked", flush=True)
        await asyncio.sleep(3600)  # until killed

    asyncio.run(main(*sys.argv[1:]))
    """
)


@dataclass
class Crashed:
    db: RoleDatabase
    engine: sa.Engine
    journal_dir: Path


def _count(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.select(sa.func.count()).where(LedgerEvent.chain_id == CHAIN)
            ).scalar_one()
        )


def _request_ids(engine: sa.Engine) -> list[str]:
    with engine.connect() as conn:
        return list(
            conn.execute(
                sa.select(LedgerEvent.request_id).where(
                    LedgerEvent.chain_id == CHAIN, LedgerEvent.request_id.is_not(None)
                )
            ).scalars()
        )


def _mark(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.select(JournalMark.applied_upto).where(JournalMark.chain_id == CHAIN)
            ).scalar_one()
        )


def _set_mark(dsn: str, value: int) -> None:
    with psycopg.connect(dsn) as conn:
        conn.execute(
            "UPDATE ledger_journal_marks SET applied_upto = %s WHERE chain_id = %s",
            (value, CHAIN),
        )


def _files(journal_dir: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(journal_dir.glob("journal-*.log"))
    }


def _expected() -> set[str]:
    return {f"{tag}{kind}{i}" for tag in "ab" for kind in "rg" for i in range(N)}


async def _restart(engine: sa.Engine, journal_dir: Path) -> int:
    writer = LedgerWriter(engine, chain_id=CHAIN, signing_key=KEY, journal=Journal(journal_dir))
    await writer.start()
    replayed = writer.stats.journal_replayed
    await writer.flush()
    await writer.close(checkpoint=True)
    return replayed


@contextmanager
def crashed_sidecar(tmp_path: Path, *, keep_segments: bool) -> Iterator[Crashed]:
    """A sidecar that committed phase 1, acknowledged phase 2 from its journal while the
    runtime role held the chain's lock, and was killed before committing it."""
    journal_dir = tmp_path / "journal"
    with role_database() as db:
        upgrade(db.owner_url, runtime_role=db.runtime)
        child = subprocess.Popen(
            [
                sys.executable,
                "-c",
                CHILD,
                db.runtime_url,
                PEM,
                str(journal_dir),
                str(N),
                "keep" if keep_segments else "trim",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        assert child.stdin and child.stdout and child.stderr
        engine = make_engine(db.runtime_url)
        try:
            assert child.stdout.readline().strip() == "committed", child.stderr.read()
            assert _count(engine) >= 2 * N  # phase 1
            with psycopg.connect(db.dsn(db.runtime)) as att:  # the runtime role
                att.execute(
                    "SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (CHAIN_LOCK_CLASS, CHAIN)
                )
                child.stdin.write("go\n")
                child.stdin.flush()
                assert child.stdout.readline().strip() == "acked", child.stderr.read()
                os.kill(child.pid, signal.SIGKILL)  # the unclean stop
                child.wait(timeout=30)
                att.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )
                att.rollback()  # lets go of the lock
            assert _mark(engine) == 2 * N  # phase 1 committed, phase 2 only in the journal
            assert sorted(_request_ids(engine)) == sorted(
                f"a{kind}{i}" for kind in "rg" for i in range(N)
            )
            yield Crashed(db, engine, journal_dir)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait(timeout=30)
            for f in (child.stdin, child.stdout, child.stderr):
                f.close()
            engine.dispose()


@pytest.mark.postgres
@pytest.mark.slow
@pytest.mark.parametrize("keep_segments", [False, True], ids=["trimmed", "kept"])
def test_runtime_role_inflating_the_journal_mark_cannot_make_acknowledged_events_vanish(
    tmp_path: Path, keep_segments: bool
) -> None:
    with crashed_sidecar(tmp_path, keep_segments=keep_segments) as crashed:
        engine, journal_dir = crashed.engine, crashed.journal_dir
        _set_mark(crashed.db.dsn(crashed.db.runtime), 1_000_000_000)
        before, files = _count(engine), _files(journal_dir)
        assert files

        with pytest.raises(LedgerError, match="lacks it") as refused:
            asyncio.run(_restart(engine, journal_dir))
        assert "drop acknowledged ledger events" in str(refused.value)
        # nothing skipped, nothing deleted, nothing written: the evidence is all still there
        assert _files(journal_dir) == files
        assert _count(engine) == before
        assert _mark(engine) == 1_000_000_000

        # the operator sets the mark back to what the chain holds: every record replayed once
        _set_mark(crashed.db.dsn(crashed.db.owner), 2 * N)
        assert asyncio.run(_restart(engine, journal_dir)) == 2 * N
        got = _request_ids(engine)
        assert sorted(got) == sorted(_expected())  # none lost, none twice
        assert verify_trusted(engine, [public_key_bytes(KEY)]).ok
        assert _files(journal_dir) == {}


@pytest.mark.postgres
@pytest.mark.slow
def test_runtime_role_moving_the_journal_mark_back_cannot_record_events_twice(
    tmp_path: Path,
) -> None:
    with crashed_sidecar(tmp_path, keep_segments=True) as crashed:
        engine, journal_dir = crashed.engine, crashed.journal_dir
        _set_mark(crashed.db.dsn(crashed.db.runtime), N)  # half of phase 1 "not applied"
        before, files = _count(engine), _files(journal_dir)

        with pytest.raises(LedgerError, match="holds it") as refused:
            asyncio.run(_restart(engine, journal_dir))
        assert "twice" in str(refused.value)
        assert _files(journal_dir) == files
        assert _count(engine) == before

        _set_mark(crashed.db.dsn(crashed.db.owner), 2 * N)
        assert asyncio.run(_restart(engine, journal_dir)) == 2 * N
        assert sorted(_request_ids(engine)) == sorted(_expected())


@pytest.mark.postgres
@pytest.mark.slow
@pytest.mark.parametrize("keep_segments", [False, True], ids=["trimmed", "kept"])
def test_an_untouched_mark_still_replays_exactly_the_missing_records(
    tmp_path: Path, keep_segments: bool
) -> None:
    """The control: after ``kill -9`` the restart replays phase 2, none lost, none twice,
    whether or not phase 1's records (which the chain holds) were still on disk."""
    with crashed_sidecar(tmp_path, keep_segments=keep_segments) as crashed:
        engine, journal_dir = crashed.engine, crashed.journal_dir
        assert asyncio.run(_restart(engine, journal_dir)) == 2 * N
        assert sorted(_request_ids(engine)) == sorted(_expected())
        assert _mark(engine) == 4 * N
        assert verify_trusted(engine, [public_key_bytes(KEY)]).ok
        assert _files(journal_dir) == {}  # a clean stop empties the journal
        # and a clean restart replays nothing
        assert asyncio.run(_restart(engine, journal_dir)) == 0
        assert sorted(_request_ids(engine)) == sorted(_expected())


def test_a_journal_record_is_found_in_the_chain_by_its_chained_content(db_url: str) -> None:
    """What the mark is checked with: each journaled event, read back from its record, is
    found in the chain on both dialects (nested attrs, a payload, an outcome, an entry), and a
    record differing in a single chained field (a microsecond, an attr) is not."""
    events = [
        Event(
            kind=EventKind.KV_PUT,
            tenant="acme",
            request_id="r1",
            nbytes=7,
            tier="redis",
            outcome=Outcome.OK,
            attrs={"n": 1, "nested": {"a": [1, 2.5, None, "x"]}},
            entry=EntryChange(key_digest="d" * 64, state=EntryState.LIVE, tenant="acme"),
        ),
        Event(kind=EventKind.KV_GET, tenant="acme", request_id="g1", payload={"why": "test"}),
        Event(kind=EventKind.KV_EVICT, key_digest="e" * 64, reason="capacity"),
    ]
    engine = make_engine(db_url)
    try:
        upgrade(db_url)

        async def write() -> None:
            writer = LedgerWriter(engine, chain_id=CHAIN, signing_key=KEY)
            await writer.start()
            for e in events:
                await writer.append(e)
            await writer.close()

        asyncio.run(write())
        with engine.connect() as conn:
            for e in events:
                read_back = decode_event(encode_event(e))
                assert chain_holds(conn, CHAIN, read_back)
                later = replace(read_back, occurred_at=read_back.occurred_at + timedelta(0, 0, 1))
                assert not chain_holds(conn, CHAIN, later)
                assert not chain_holds(conn, CHAIN, replace(read_back, attrs={"other": True}))
            assert not chain_holds(conn, "another-chain", decode_event(encode_event(events[0])))
    finally:
        engine.dispose()

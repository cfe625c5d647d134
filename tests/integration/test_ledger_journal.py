"""The writer with its local journal, on real Postgres: a queued event is acknowledged before
the database has it, survives ``kill -9`` of the process and is replayed exactly once; a
journal that fails hands its waiters to the database commit; refused events never reach it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import psycopg
import pytest
import sqlalchemy as sa
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kvgov.db.engine import make_engine, upgrade
from kvgov.db.models import CacheEntry, JournalMark, LedgerEvent
from kvgov.errors import LedgerError
from kvgov.ledger.events import EntryChange, Event
from kvgov.ledger.journal import Journal
from kvgov.ledger.verify import verify
from kvgov.ledger.writer import LedgerWriter
from kvgov.types import EntryState, EventKind

pytestmark = pytest.mark.postgres

KEY = Ed25519PrivateKey.generate()
PEM = KEY.private_bytes(
    serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
).decode()

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

    async def main(url, pem, journal_dir, n):
        key = serialization.load_pem_private_key(pem.encode(), password=None)
        writer = LedgerWriter(make_engine(url), chain_id="victim", signing_key=key,
                              journal=Journal(Path(journal_dir)))
        await writer.start()
        print("started", flush=True)
        sys.stdin.readline()  # the test holds the chain's lock now
        acks = []
        for i in range(int(n)):
            entry = EntryChange(key_digest=f"{i:064x}", state=EntryState.LIVE, tenant="acme")
            acks.append(writer.submit_queued(Event(kind=EventKind.KV_PUT, tenant="acme",
                                                   request_id=f"r{i}", nbytes=i, entry=entry)))
            # a read nothing waits on: journaled too, synced with the puts
            writer.submit_lazy(Event(kind=EventKind.KV_GET, tenant="acme", request_id=f"g{i}"))
        await asyncio.gather(*acks)
        print(f"acked {len(acks)}", flush=True)
        await asyncio.sleep(3600)  # until killed

    asyncio.run(main(*sys.argv[1:]))
    """
)


@pytest.fixture
def url(pg_url: str) -> Iterator[str]:
    upgrade(pg_url)
    yield pg_url


@pytest.fixture
async def engine(url: str) -> AsyncIterator[sa.Engine]:
    eng = make_engine(url)
    yield eng
    eng.dispose()


def put(i: int) -> Event:
    entry = EntryChange(key_digest=f"{i:064x}", state=EntryState.LIVE, tenant="acme")
    return Event(kind=EventKind.KV_PUT, tenant="acme", request_id=f"r{i}", nbytes=i, entry=entry)


def count(engine: sa.Engine, chain_id: str) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.select(sa.func.count()).where(LedgerEvent.chain_id == chain_id)
            ).scalar_one()
        )


def mark(engine: sa.Engine, chain_id: str) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.select(JournalMark.applied_upto).where(JournalMark.chain_id == chain_id)
            ).scalar_one()
        )


async def started(engine: sa.Engine, journal_dir: Path, **kw: object) -> LedgerWriter:
    writer = LedgerWriter(
        engine,
        chain_id="node",
        signing_key=KEY,
        journal=Journal(journal_dir),
        **kw,  # type: ignore[arg-type]
    )
    await writer.start()
    return writer


@pytest.mark.slow
def test_acknowledged_events_survive_kill_9_before_postgres_has_them(
    url: str, tmp_path: Path
) -> None:
    journal_dir = tmp_path / "journal"
    n = 300
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, url, PEM, str(journal_dir), str(n)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdin is not None and child.stdout is not None and child.stderr is not None
    dsn = url.replace("postgresql+psycopg://", "postgresql://", 1)
    engine = make_engine(url)
    try:
        assert child.stdout.readline().strip() == "started", child.stderr.read()
        with psycopg.connect(dsn) as holder:
            # hold the chain's lock: the child's writer cannot commit a single batch
            holder.execute("SELECT 1 FROM chains WHERE chain_id = 'victim' FOR UPDATE")
            child.stdin.write("go\n")
            child.stdin.flush()
            line = child.stdout.readline().strip()
            assert line == f"acked {n}", child.stderr.read()  # acknowledged from the journal
            assert count(engine, "victim") == 0  # ... while Postgres has none of them
            os.kill(child.pid, signal.SIGKILL)
            child.wait(timeout=30)
            # the dead client's backend may still wait on the lock: end it, then let go
            holder.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
            holder.rollback()
        assert count(engine, "victim") == 0

        async def restart() -> tuple[int, int]:
            writer = LedgerWriter(
                engine, chain_id="victim", signing_key=KEY, journal=Journal(journal_dir)
            )
            await writer.start()
            replayed = writer.stats.journal_replayed
            await writer.flush()
            await writer.close()
            return replayed, writer.applied_upto

        replayed, applied = asyncio.run(restart())
        assert replayed == 2 * n
        assert applied == 2 * n
        assert count(engine, "victim") == 2 * n  # every acknowledged event and read, once
        with engine.connect() as conn:
            got = set(
                conn.execute(
                    sa.select(LedgerEvent.request_id).where(LedgerEvent.chain_id == "victim")
                ).scalars()
            )
            entries = conn.execute(sa.select(sa.func.count()).select_from(CacheEntry)).scalar()
        assert got == {f"r{i}" for i in range(n)} | {f"g{i}" for i in range(n)}
        assert entries == n  # the index changes the events carry came with them
        assert mark(engine, "victim") == 2 * n
        assert verify(engine).ok
        assert list(journal_dir.glob("journal-*.log")) == []  # a clean stop empties it

        again = asyncio.run(restart())  # nothing left to replay: no event twice
        assert again == (0, 2 * n)
        assert count(engine, "victim") == 2 * n
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)
        child.stdin.close()
        child.stdout.close()
        child.stderr.close()
        engine.dispose()


async def test_queued_events_commit_in_large_batches_and_move_the_mark(
    engine: sa.Engine, tmp_path: Path
) -> None:
    writer = await started(engine, tmp_path / "j")
    await asyncio.gather(*(writer.submit_queued(put(i)) for i in range(400)))
    await writer.flush()
    assert count(engine, "node") == 400
    assert mark(engine, "node") == 400
    # the journal acknowledged them; the commits came in a few batches, not one per event
    assert writer.stats.batches_committed <= 10
    assert writer.journal is not None and writer.journal.syncs >= 1
    await writer.close()
    assert verify(engine).ok


@pytest.mark.parametrize("lazy_journaled", [True, False])
async def test_a_batch_mixing_queued_and_other_events_moves_the_mark(
    engine: sa.Engine, tmp_path: Path, lazy_journaled: bool
) -> None:
    writer = await started(engine, tmp_path / "j", journal_lazy_events=lazy_journaled)
    acks = [writer.submit_queued(put(0)), writer.submit_queued(put(1))]
    lazy = writer.submit_lazy(Event(kind=EventKind.KV_GET, tenant="acme"))
    urgent = writer.submit(Event(kind=EventKind.SIDECAR_STARTED))  # never journaled
    await asyncio.gather(*acks)
    assert (await urgent).seq == 4 and (await lazy).seq == 3
    assert mark(engine, "node") == (3 if lazy_journaled else 2)
    assert writer.journal is not None
    assert writer.journal.last_position == (3 if lazy_journaled else 2)
    await writer.close()


async def test_a_failing_journal_hands_its_waiters_to_the_commit(
    engine: sa.Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = await started(engine, tmp_path / "j")
    journal = writer.journal
    assert journal is not None

    def disk_full() -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(journal, "sync", disk_full)
    await asyncio.gather(*(writer.submit_queued(put(i)) for i in range(20)))
    # acknowledged only once committed: nothing rested on the failed write
    assert count(engine, "node") == 20
    assert writer.stats.journal_failures == 1
    later = writer.submit_queued(put(99))  # the journal is set aside: a commit is awaited
    assert (await later).seq == 21
    await writer.close()


async def test_an_event_the_ledger_refuses_is_refused_before_it_is_journaled(
    engine: sa.Engine, tmp_path: Path
) -> None:
    writer = await started(engine, tmp_path / "j")
    with pytest.raises(LedgerError, match="NUL"):
        writer.submit_queued(Event(kind=EventKind.KV_PUT, tenant="bad\x00tenant"))
    assert writer.journal is not None and writer.journal.last_position == 0
    await writer.close()


async def test_a_damaged_journal_stops_the_writer_from_starting(
    engine: sa.Engine, tmp_path: Path
) -> None:
    d = tmp_path / "j"
    d.mkdir()
    (d / "journal-00000000000000000001.log").write_bytes(b"garbage!" * 10)
    (d / "journal-00000000000000000009.log").write_bytes(b"KVGJRNL1")
    writer = LedgerWriter(engine, chain_id="node", signing_key=KEY, journal=Journal(d))
    with pytest.raises(LedgerError, match="damaged"):
        await writer.start()

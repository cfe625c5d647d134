"""The ledger writer's journal acknowledgement alone (``ledger.writing.acks.JournalAcks``) and
its replay (``ledger.writing.replay.read_back``), on a real journal in a temporary directory:
an acknowledgement resolves once the journal is synced past its event, not before and not on
commit; when the journal fails, the waiters follow their commits and the writer is told to
write them now; at start, the records after the mark come back as events, in order."""

from __future__ import annotations

import asyncio
import errno
from datetime import UTC, datetime
from pathlib import Path

import pytest

from kvgov.errors import LedgerError
from kvgov.ledger.events import Appended, Event
from kvgov.ledger.journal import Journal, encode_event
from kvgov.ledger.writing.acks import JournalAcks
from kvgov.ledger.writing.replay import read_back
from kvgov.ledger.writing.stats import WriterStats
from kvgov.types import EventKind

AT = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def put(i: int) -> Event:
    return Event(kind=EventKind.KV_PUT, tenant="acme", key_digest=f"{i:064x}", occurred_at=AT)


async def started(
    tmp_path: Path, *, sync_interval_s: float = 0.0
) -> tuple[JournalAcks, Journal, list[int]]:
    journal = Journal(tmp_path / "j")
    journal.open(0, chain_id="node-a")
    hurried: list[int] = []
    acks = JournalAcks(
        journal,
        "node-a",
        WriterStats(),
        on_failed=lambda: hurried.append(1),
        sync_interval_s=sync_interval_s,
    )
    acks.start("test-journal")
    return acks, journal, hurried


async def test_an_acknowledgement_waits_for_the_sync_not_the_commit(tmp_path: Path) -> None:
    acks, journal, _ = await started(tmp_path)
    loop = asyncio.get_running_loop()
    prepared, pos = acks.append(put(1))
    assert prepared.event == put(1)
    assert pos == 1
    assert journal.durable == 0  # appended, not yet synced
    commit: asyncio.Future[Appended] = loop.create_future()
    ack = acks.acknowledgement(pos, commit)
    await asyncio.wait_for(ack, 10)
    assert journal.durable >= pos
    assert not commit.done()  # the commit comes later, in a large batch
    commit.set_result(Appended("node-a", 1))
    await acks.close(applied_upto=1)
    assert list((tmp_path / "j").glob("journal-*.log")) == []  # all applied: emptied


def count_syncs(journal: Journal, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The positions each sync of ``journal`` reached, in order."""
    synced: list[int] = []
    sync = journal.sync

    def counted() -> int:
        upto = sync()
        synced.append(upto)
        return upto

    monkeypatch.setattr(journal, "sync", counted)
    return synced


async def test_while_acknowledgements_are_held_syncs_start_at_most_once_per_interval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    acks, journal, _ = await started(tmp_path, sync_interval_s=1.0)
    loop = asyncio.get_running_loop()
    synced = count_syncs(journal, monkeypatch)

    def acknowledged(i: int) -> asyncio.Future[None]:
        # held: the caller streams more puts right behind each one
        return acks.acknowledgement(acks.append(put(i))[1], loop.create_future(), hold=True)

    # idle: the first append is synced and acknowledged at once, not an interval later
    await asyncio.wait_for(acknowledged(1), 0.5)
    # busy: the next appends wait for the interval since that sync began, then share one sync
    second = acknowledged(2)
    await asyncio.sleep(0.3)
    third = acknowledged(3)
    await asyncio.sleep(0.1)
    assert not second.done() and not third.done()
    await asyncio.wait_for(asyncio.gather(second, third), 5)
    assert synced == [1, 3]
    assert acks.stats.journal_syncs == 2
    assert journal.durable == 3
    await acks.close(applied_upto=3)


async def test_an_acknowledgement_with_nothing_behind_it_is_synced_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client with one put in flight at a time is never held for the interval (as
    PostgreSQL's commit_delay waits only with commit_siblings); events nobody waits for are."""
    acks, journal, _ = await started(tmp_path, sync_interval_s=30.0)
    loop = asyncio.get_running_loop()
    synced = count_syncs(journal, monkeypatch)
    for i in (1, 2, 3):  # back to back, well within the interval: each synced at once
        await asyncio.wait_for(
            acks.acknowledgement(acks.append(put(i))[1], loop.create_future()), 5
        )
    assert synced == [1, 2, 3]
    acks.append(put(4))  # a lazy event (a get's, an eviction's): nobody waits, it may linger
    await asyncio.sleep(0.3)
    assert journal.durable == 3
    last = acks.acknowledgement(acks.append(put(5))[1], loop.create_future())
    await asyncio.wait_for(last, 5)  # a waiter with nothing behind it takes the lazy one along
    assert synced == [1, 2, 3, 5]
    await acks.close(applied_upto=5)


async def test_an_acknowledgement_not_held_is_synced_at_once_beside_held_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Holding is the caller's own: a streaming client's held acknowledgements do not hold a
    sequential client's back; its sync takes theirs along."""
    acks, journal, _ = await started(tmp_path, sync_interval_s=30.0)
    loop = asyncio.get_running_loop()
    synced = count_syncs(journal, monkeypatch)
    first = acks.acknowledgement(acks.append(put(1))[1], loop.create_future(), hold=True)
    await asyncio.wait_for(first, 5)  # an idle journal syncs at once, held or not
    held = acks.acknowledgement(acks.append(put(2))[1], loop.create_future(), hold=True)
    await asyncio.sleep(0.3)
    assert not held.done()  # held: up to the interval (30 s) for the stream's next puts
    lone = acks.acknowledgement(acks.append(put(3))[1], loop.create_future())
    await asyncio.wait_for(asyncio.gather(lone, held), 5)  # at once, the held one along
    assert synced == [1, 3]
    await acks.close(applied_upto=3)


async def test_an_event_the_ledger_refuses_is_not_journaled(tmp_path: Path) -> None:
    acks, journal, _ = await started(tmp_path)
    with pytest.raises(LedgerError):
        acks.append(Event(kind=EventKind.KV_PUT, reason="nul\x00"))
    assert journal.last_position == 0
    await acks.close(applied_upto=0)


async def test_a_failed_journal_hands_its_waiters_to_their_commits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    acks, journal, hurried = await started(tmp_path)
    loop = asyncio.get_running_loop()

    def disk_full() -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(journal, "sync", disk_full)
    commits: list[asyncio.Future[Appended]] = [loop.create_future() for _ in range(2)]
    acked = [acks.acknowledgement(acks.append(put(i))[1], commits[i]) for i in range(2)]
    for _ in range(100):
        if hurried:
            break
        await asyncio.sleep(0.01)
    assert hurried == [1]  # the writer must now commit them without lingering
    assert acks.stats.journal_failures == 1
    assert not acks.taking
    assert not any(a.done() for a in acked)  # no acknowledgement rests on the failed write
    commits[0].set_result(Appended("node-a", 1))
    commits[1].set_exception(LedgerError("refused"))
    await asyncio.sleep(0)
    assert acked[0].result() is None
    with pytest.raises(LedgerError, match="refused"):
        acked[1].result()
    await acks.close(applied_upto=0)


def test_replay_reads_back_the_records_after_the_mark_as_events(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    journal.open(0, chain_id="node-a")
    for i in range(1, 5):
        journal.append(encode_event(put(i)))
    journal.sync()
    journal.close(applied_upto=2)
    again = Journal(tmp_path)
    assert read_back(again, "node-a", 2) == [(put(3), 3), (put(4), 4)]
    again.close(applied_upto=4)


def test_replay_refuses_a_record_that_is_not_an_event(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    journal.open(0, chain_id="node-a")
    journal.append(b"not an event")
    journal.sync()
    journal.close(applied_upto=0)
    with pytest.raises(LedgerError, match="not a ledger event"):
        read_back(Journal(tmp_path), "node-a", 0)

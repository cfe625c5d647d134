"""The ledger writer's urgency rule alone (``ledger.writing.schedule.Schedule``): no database,
no event loop, an explicit clock. Urgent events make everything queued due at once; lazy ones
wait up to ``lazy_max_delay_ms`` after the oldest queued event; a full batch, ``make_due``
(flush) and closing make the queue due too. The same rule over real databases:
``tests/integration/test_ledger_urgency.py``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvgov.errors import LedgerError
from kvgov.ledger.events import Appended, Event
from kvgov.ledger.writing.schedule import Batcher, Item, Schedule
from kvgov.types import EventKind


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def item(loop: asyncio.AbstractEventLoop, i: int) -> Item:
    fut: asyncio.Future[Appended] = loop.create_future()
    return (Event(kind=EventKind.KV_GET, reason=str(i)), fut, 0)


def schedule(*, batch_max: int = 10, queue_max: int = 100, lazy_ms: float = 25.0) -> Schedule:
    return Schedule(batch_max=batch_max, queue_max=queue_max, lazy_max_delay_ms=lazy_ms)


def reasons(items: list[Item]) -> list[str | None]:
    return [e.reason for e, _, _ in items if isinstance(e, Event)]


def test_an_urgent_event_is_due_at_once(loop: asyncio.AbstractEventLoop) -> None:
    s, clock = schedule(), Clock()
    assert s.push(item(loop, 0), urgent=True, clock=clock)
    assert s.due()
    assert s.linger_s(clock.now) == 0.0


def test_lazy_events_wait_for_company_up_to_the_delay_from_the_oldest(
    loop: asyncio.AbstractEventLoop,
) -> None:
    s, clock = schedule(lazy_ms=25.0), Clock()
    assert s.push(item(loop, 0), urgent=False, clock=clock)  # the first wakes the loop
    clock.now += 0.010
    assert not s.push(item(loop, 1), urgent=False, clock=clock)  # the rest do not
    assert not s.due()
    # measured from the oldest event (queued at 100.0), not the newest
    assert s.linger_s(clock.now) == pytest.approx(0.015)
    clock.now += 0.015
    assert s.linger_s(clock.now) <= 0  # time's up: written although not "due"


def test_an_urgent_event_takes_the_lazy_ones_queued_before_it(
    loop: asyncio.AbstractEventLoop,
) -> None:
    s, clock = schedule(), Clock()
    for i in range(3):
        s.push(item(loop, i), urgent=False, clock=clock)
    assert not s.due()
    assert s.push(item(loop, 3), urgent=True, clock=clock)
    assert s.due()
    assert reasons(s.take(clock.now)) == ["0", "1", "2", "3"]
    assert not s.due()  # nothing left owed


def test_a_full_batch_is_due_without_waiting(loop: asyncio.AbstractEventLoop) -> None:
    s, clock = schedule(batch_max=3), Clock()
    s.push(item(loop, 0), urgent=False, clock=clock)
    assert not s.push(item(loop, 1), urgent=False, clock=clock)
    assert s.push(item(loop, 2), urgent=False, clock=clock)  # a full batch wakes the loop
    assert s.due()


def test_a_batch_takes_at_most_batch_max_oldest_first_and_restarts_the_window(
    loop: asyncio.AbstractEventLoop,
) -> None:
    s, clock = schedule(batch_max=2), Clock()
    for i in range(5):
        s.push(item(loop, i), urgent=False, clock=clock)
    clock.now += 1.0
    assert reasons(s.take(clock.now)) == ["0", "1"]
    assert len(s) == 3
    assert s.oldest_at == clock.now  # the rest waited at most since now
    assert reasons(s.take(clock.now)) == ["2", "3"]
    assert reasons(s.take(clock.now)) == ["4"]
    assert not s


def test_make_due_and_closing_write_lazy_events_now(loop: asyncio.AbstractEventLoop) -> None:
    s, clock = schedule(), Clock()
    s.push(item(loop, 0), urgent=False, clock=clock)
    s.make_due()  # flush()
    assert s.due()
    s.take(clock.now)
    s.push(item(loop, 1), urgent=False, clock=clock)
    assert not s.due()  # flush covered what was queued then, not what came after
    s.closing = True
    assert s.due()


def test_without_a_delay_every_event_is_urgent(loop: asyncio.AbstractEventLoop) -> None:
    s, clock = schedule(lazy_ms=0.0), Clock()
    s.push(item(loop, 0), urgent=True, clock=clock)
    s.take(clock.now)
    assert s.push(item(loop, 1), urgent=False, clock=clock)
    assert s.due()


def test_the_queue_is_full_at_queue_max(loop: asyncio.AbstractEventLoop) -> None:
    s, clock = schedule(batch_max=10, queue_max=3), Clock()
    for i in range(3):
        assert not s.full
        s.push(item(loop, i), urgent=False, clock=clock)
    assert s.full


def test_replayed_records_go_first_and_are_due(loop: asyncio.AbstractEventLoop) -> None:
    s, clock = schedule(), Clock()
    s.push_replayed([item(loop, 0), item(loop, 1)], clock.now)
    assert s.due()
    s.push(item(loop, 2), urgent=False, clock=clock)
    assert reasons(s.take(clock.now)) == ["0", "1", "2"]


async def test_a_journaled_events_failed_commit_is_logged_by_the_batcher(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A journaled event's commit (a put acknowledged once journaled, a replayed record) is
    awaited by nobody: the batcher logs its failure (``ledger.journal.uncommitted``) and
    retrieves it; an event that is not journaled is left to whoever awaits it."""
    loop = asyncio.get_running_loop()
    batcher: Batcher[None] = Batcher(
        schedule(),
        sequence=lambda events, positions: None,
        commit=lambda chained: [],
        seq_executor=ThreadPoolExecutor(1),
        db_executor=ThreadPoolExecutor(1),
    )
    journaled, plain = item(loop, 1), item(loop, 2)
    journaled = (journaled[0], journaled[1], 7)
    caplog.set_level(logging.ERROR, logger="kvgov.ledger.writing.acks")
    await batcher._slots.acquire()  # the batch in flight that _settle ends
    batcher._inflight = 1
    batcher._settle([journaled, plain], [LedgerError("ledger batch failed: OperationalError")])
    lines = [r for r in caplog.records if r.getMessage() == "ledger.journal.uncommitted"]
    assert len(lines) == 1 and lines[0].error == "LedgerError"  # type: ignore[attr-defined]
    assert isinstance(journaled[1].exception(), LedgerError)
    with pytest.raises(LedgerError):
        await plain[1]

"""Scheduling by urgency: when queued ledger events go into a batch, and the batching loop.

:class:`Schedule` is the rule, plain bookkeeping with no threads or tasks (its clock is passed
in), so it can be read and tested alone:

- an *urgent* event (``submit``, ``append``: someone waits for its commit) makes everything
  queued so far due at once: group commit, no added delay;
- a *lazy* event (``submit_lazy``, and a journaled event, which is already durable) may wait up
  to ``lazy_max_delay_ms`` after the oldest queued event, so that many share one commit;
- the queue is due anyway when it holds a full batch (``batch_max_events``), on ``flush``
  (:meth:`Schedule.make_due`) and once the writer is closing;
- a batch takes up to ``batch_max_events`` events, oldest first; the queue holds at most
  ``queue_max_events`` (the writer then refuses or waits: backpressure).

:class:`Batcher` is the loop that applies it: one task takes each due batch off the schedule
and runs it through the two stages, one thread each (sequencing, then committing), and resolves
every event's future with its result once the commit is over (a journaled event's failed commit,
which nothing may await, is logged there: no callback per event). One batch is in flight at a time
(:data:`PIPELINE_DEPTH`): whatever queued while it was committing is the next batch.
"""

from __future__ import annotations

import asyncio
import functools
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Generic, TypeVar

from kvgov.errors import LedgerError
from kvgov.ledger.batch import Prepared
from kvgov.ledger.events import Appended, Event
from kvgov.ledger.writing.acks import log_unwritten
from kvgov.ledger.writing.handoff import hand_off
from kvgov.ledger.writing.sequence import Result

#: a queued event (or, journaled, already prepared), its commit future and its journal
#: position (0: not journaled)
Item = tuple["Event | Prepared", "asyncio.Future[Appended]", int]
#: batches taken from the queue and not yet committed. One: a batch is whatever queued while
#: the previous one was being committed, so batches are as large as the load makes them. With
#: two (one chained ahead), a put-heavy data plane split its events into alternating tiny
#: batches, each paying a commit's fixed cost (in the writer and in Postgres); measured in
#: ``docs/ledger.md``, "Throughput"
PIPELINE_DEPTH = 1

C = TypeVar("C")


class Schedule:
    """The writer's queue and its urgency rule (event-loop thread only)."""

    def __init__(self, *, batch_max: int, queue_max: int, lazy_max_delay_ms: float) -> None:
        self.batch_max = batch_max
        self.queue_max = queue_max
        #: how long an event nothing waits on may wait for company (0: never)
        self.lazy_s = max(0.0, lazy_max_delay_ms) / 1000.0
        self.items: deque[Item] = deque()
        #: events ever queued / ever taken into a batch; the first ``due_upto`` must go now
        self.enqueued = 0
        self.taken = 0
        self.due_upto = 0
        #: clock time at which the oldest queued event was queued (or waited since)
        self.oldest_at = 0.0
        #: the writer is closing: everything queued is due
        self.closing = False

    def __len__(self) -> int:
        return len(self.items)

    @property
    def full(self) -> bool:
        return len(self.items) >= self.queue_max

    def push(self, item: Item, *, urgent: bool, clock: Callable[[], float]) -> bool:
        """Queue ``item``; whether the batching loop must look at the queue now (it was
        empty, the item is urgent, or the queue holds a full batch)."""
        items = self.items
        wake = not items
        if wake:
            self.oldest_at = clock()
        items.append(item)
        self.enqueued += 1
        if urgent or not self.lazy_s:
            self.due_upto = self.enqueued
            return True
        return wake or len(items) >= self.batch_max

    def push_replayed(self, replayed: list[Item], now: float) -> None:
        """Queue journal records read back at start, ahead of anything new, all due."""
        self.items.extend(replayed)
        self.enqueued += len(replayed)
        if replayed:
            self.oldest_at = now
            self.due_upto = self.enqueued

    def make_due(self) -> None:
        """Everything queued so far goes now (``flush``; a failed journal's waiters)."""
        self.due_upto = self.enqueued

    def due(self) -> bool:
        """Whether the queue must be written now rather than lingered on."""
        return self.closing or self.due_upto > self.taken or len(self.items) >= self.batch_max

    def linger_s(self, now: float) -> float:
        """How long the queue may still wait for company (<= 0: write it now)."""
        if self.due():
            return 0.0
        return self.oldest_at + self.lazy_s - now

    def take(self, now: float) -> list[Item]:
        """The next batch: up to ``batch_max`` events, oldest first."""
        items = self.items
        batch = [items.popleft() for _ in range(min(len(items), self.batch_max))]
        self.taken += len(batch)
        if items:  # the rest waited at most since now (a batch was full)
            self.oldest_at = now
        return batch


class Batcher(Generic[C]):
    """Runs due batches through ``sequence`` (on ``seq_executor``) and then ``commit`` (on
    ``db_executor``), and settles each event's future with its result."""

    def __init__(
        self,
        schedule: Schedule,
        *,
        sequence: Callable[[list[Event | Prepared], list[int]], C],
        commit: Callable[[C], list[Result]],
        seq_executor: Executor,
        db_executor: Executor,
    ) -> None:
        self.schedule = schedule
        self._sequence = sequence
        self._commit = commit
        self._seq_executor = seq_executor
        self._db_executor = db_executor
        self._wake = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._slots = asyncio.Semaphore(PIPELINE_DEPTH)
        self._inflight = 0
        self.task: asyncio.Task[None] | None = None

    def start(self, name: str) -> None:
        self.task = asyncio.create_task(self._run(), name=name)

    def push(self, item: Item, *, urgent: bool, loop: asyncio.AbstractEventLoop) -> None:
        schedule = self.schedule
        wake = schedule.push(item, urgent=urgent, clock=loop.time)
        self._idle.clear()
        if schedule.full:
            self._room.clear()
        if wake:
            self._wake.set()

    def push_replayed(self, replayed: list[Item], now: float) -> None:
        self.schedule.push_replayed(replayed, now)
        if replayed:
            self._idle.clear()

    def hurry(self) -> None:
        """Write everything queued so far now."""
        self.schedule.make_due()
        self._wake.set()

    def close(self) -> None:
        """Write everything queued, then stop (await :attr:`task`)."""
        self.schedule.closing = True
        self._wake.set()

    async def wait_for_room(self) -> None:
        while self.schedule.full and not self.schedule.closing:
            await self._room.wait()

    async def flush(self) -> None:
        """Write every event queued so far now (lazy ones too) and wait until the writer is
        idle: they are written (or failed)."""
        if self.schedule:
            self.hurry()
        while self.schedule or not self._idle.is_set():
            await self._idle.wait()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        schedule = self.schedule
        while True:
            if not schedule:
                if not self._inflight:
                    self._idle.set()
                if schedule.closing:
                    while self._inflight:  # _settle sets _idle when the last one lands
                        self._idle.clear()
                        await self._idle.wait()
                    self._idle.set()
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            delay = schedule.linger_s(loop.time())
            if delay > 0:  # only lazy events: linger for company, or for urgency
                self._wake.clear()
                timer = loop.call_later(delay, self._wake.set)
                try:
                    await self._wake.wait()
                finally:
                    timer.cancel()
                continue
            # group commit: no artificial delay for what is due. What queued while the
            # previous batch was committing is the next batch.
            await self._slots.acquire()
            items = schedule.take(loop.time())
            if not items:  # pragma: no cover - only this task takes from the queue
                self._slots.release()
                continue
            if not schedule.full:
                self._room.set()
            self._inflight += 1
            try:
                chained = await hand_off(
                    loop,
                    self._seq_executor,
                    self._sequence,
                    [e for e, _, _ in items],
                    [p for _, _, p in items],
                )
                commit = hand_off(loop, self._db_executor, self._commit, chained)
            except Exception as err:  # noqa: BLE001 - every waiter must hear of the failure
                self._settle(items, [LedgerError(f"ledger batch failed: {type(err).__name__}")])
                continue
            commit.add_done_callback(functools.partial(self._finish, items))

    def _finish(self, items: list[Item], done: asyncio.Future[list[Result]]) -> None:
        err = done.exception()
        if err is not None:
            self._settle(items, [LedgerError(f"ledger batch failed: {type(err).__name__}")])
        else:
            self._settle(items, done.result())

    def _settle(self, items: list[Item], results: list[Result]) -> None:
        if len(results) == 1 and len(items) > 1:
            results = results * len(items)
        for (_, fut, position), result in zip(items, results, strict=True):
            if fut.done():
                continue
            if isinstance(result, Appended):
                fut.set_result(result)
            else:
                fut.set_exception(result)
                if position:  # journaled: its record stays in the journal (replayed at start)
                    log_unwritten(fut)
        self._inflight -= 1
        self._slots.release()
        if not self.schedule and not self._inflight:
            self._idle.set()

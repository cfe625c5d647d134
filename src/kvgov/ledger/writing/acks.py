"""Journal acknowledgement: an event acknowledged once it is durable in the local journal.

With a :class:`~kvgov.ledger.journal.Journal`, ``submit_queued`` (a put) checks the event as
its batch will (:func:`~kvgov.ledger.batch.prepare`: what the ledger could never store is
refused before any acknowledgement), appends it to the journal and queues it like a lazy
event. :class:`JournalAcks` runs the journal's sync loop on a thread of its own: it
``fdatasync``-s whatever was appended since the last sync (group commit) and then resolves the
acknowledgements the sync covers, in position order. Syncs start at most once per
``sync_interval_s`` (``ledger.journal_sync_interval_ms``) while every waiting acknowledgement
is *held* (its caller has more on the way right behind it: a client streaming PUT frames) or
nobody waits: the appends of the interval then share one sync (fewer syncs, thread hand-offs
and wake-ups per put; measured in ``docs/ledger.md``, "The local journal"). An
acknowledgement that is not held (a client with one put in flight at a time, a stream's last
frame) syncs at once, taking whatever is appended along, as PostgreSQL's ``commit_delay``
waits only with ``commit_siblings``; so does a journal idle for the interval. Holding is the
caller's own: a client that always says more delays only its own acknowledgements. The
event's commit still follows, in a large batch; nobody awaits it, so a failure is logged (by the
batcher: :func:`log_unwritten`) and the record stays in the journal, replayed at the next start.

A journal that fails (disk full, I/O error) is set aside until the next start: its waiters are
handed to their commits (each acknowledgement resolves as its commit does, which is made due
at once) and later events are not journaled, so no acknowledgement rests on a failed write.
"""

from __future__ import annotations

import asyncio
import functools
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from kvgov.ledger.batch import Prepared, prepare
from kvgov.ledger.events import Appended, Event
from kvgov.ledger.journal import Journal, encode_event
from kvgov.ledger.writing.handoff import hand_off
from kvgov.ledger.writing.stats import WriterStats
from kvgov.logging import get_logger

log = get_logger(__name__)

#: an acknowledgement waiting for a sync: (journal position, acknowledgement, commit, held)
_Waiter = tuple[int, "asyncio.Future[None]", "asyncio.Future[Appended]", bool]


class JournalAcks:
    """Journals events and acknowledges them once synced (event loop, and one thread)."""

    def __init__(
        self,
        journal: Journal,
        chain_id: str,
        stats: WriterStats,
        *,
        on_failed: Callable[[], None],
        sync_interval_s: float = 0.0,
    ) -> None:
        self.journal = journal
        self.chain_id = chain_id
        self.stats = stats
        #: called once the journal failed: the commits its waiters now wait for must go now
        self._on_failed = on_failed
        #: waiters, in position order
        self._waiters: deque[_Waiter] = deque()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvgov-journal")
        #: the writer is closing: the sync loop ends once nothing is left to sync
        self.closing = False
        #: the least time from the start of one sync to the start of the next, while every
        #: waiting acknowledgement is held (or nobody waits)
        self.sync_interval_s = max(0.0, sync_interval_s)
        #: waiting acknowledgements that are not held: while there is one, sync at once
        self._prompt = 0

    def start(self, name: str) -> None:
        self._task = asyncio.create_task(self._run(), name=name)

    @property
    def taking(self) -> bool:
        """The journal takes events: started and not failed."""
        return self.journal.broken is None and self._task is not None

    def append(self, event: Event) -> tuple[Prepared, int]:
        """Append ``event`` to the journal (synced soon); it prepared, and its position.
        Raises :class:`~kvgov.errors.LedgerError` for an event the ledger would refuse
        (nothing is journaled)."""
        prepared = prepare(event)
        pos = self.journal.append(encode_event(event))
        self._wake.set()
        return prepared, pos

    def acknowledgement(
        self, position: int, commit: asyncio.Future[Appended], *, hold: bool = False
    ) -> asyncio.Future[None]:
        """A future resolved once the journal is synced past ``position`` (or, if the journal
        fails first, as ``commit`` is). ``hold``: the caller has more acknowledged events on
        the way right behind this one; its sync may wait up to the interval for them."""
        ack: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((position, ack, commit, hold))
        if not hold:
            self._prompt += 1
            self._wake.set()
        return ack

    async def _run(self) -> None:
        """Sync the journal whenever something was appended (group commit: whatever is
        appended during one sync, or within ``sync_interval_s`` of its start, goes in the
        next) and acknowledge what it covers."""
        loop = asyncio.get_running_loop()
        journal = self.journal
        waiters = self._waiters
        started = -self.sync_interval_s  # an idle journal syncs at once
        while True:
            if journal.last_position <= journal.durable:  # nothing appended since the last sync
                if self.closing:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            await self._gather(loop, started)
            started = loop.time()
            try:
                upto = await hand_off(loop, self._executor, journal.sync)
            except OSError as err:
                self._failed(err)
                return
            self.stats.journal_syncs += 1
            while waiters and waiters[0][0] <= upto:
                _, ack, _, held = waiters.popleft()
                if not held:
                    self._prompt -= 1
                if not ack.done():
                    ack.set_result(None)

    async def _gather(self, loop: asyncio.AbstractEventLoop, started: float) -> None:
        """Before a sync: let what is appended until ``sync_interval_s`` after the last sync
        began share it, while every waiting acknowledgement is held or nobody waits; return
        as soon as one that is not held waits."""
        while not self.closing:
            wait = started + self.sync_interval_s - loop.time()
            if wait <= 0 or self._prompt:
                return
            self._wake.clear()  # set again by the next append: look once more then
            timer = loop.call_later(wait, self._wake.set)
            try:
                await self._wake.wait()
            finally:
                timer.cancel()

    def _failed(self, err: OSError) -> None:
        """Set the journal aside: its waiters, and every later put, wait for the commit."""
        self.stats.journal_failures += 1
        log.error(
            "ledger.journal.failed",
            extra={
                "chain_id": self.chain_id,
                "error": type(err).__name__,
                "detail": err.strerror or "",
                "waiting": len(self._waiters),
            },
        )
        waiters, self._waiters = self._waiters, deque()
        self._prompt = 0
        self._task = None
        for _, ack, commit, _ in waiters:
            commit.add_done_callback(functools.partial(_follow, ack))
        self._on_failed()

    async def close(self, applied_upto: int) -> None:
        """Stop syncing (after a last sync of what was appended) and close the journal; what
        the chain does not hold (beyond ``applied_upto``) stays in it for the next start."""
        self.closing = True
        task = self._task
        if task is not None:
            self._wake.set()
            await task
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self.journal.close, applied_upto)
        self._executor.shutdown(wait=True)


def log_unwritten(fut: asyncio.Future[Appended]) -> None:
    """A journaled event's commit, which nothing may await: a failure is logged (the event
    stays in the journal, replayed at the next start). The batcher calls it for every
    journaled event whose commit failed (:meth:`~kvgov.ledger.writing.schedule.Batcher._settle`:
    a call there, not a done-callback, and its loop hop, on every commit)."""
    if not fut.cancelled() and fut.exception() is not None:
        log.error("ledger.journal.uncommitted", extra={"error": type(fut.exception()).__name__})


def _follow(ack: asyncio.Future[None], commit: asyncio.Future[Appended]) -> None:
    """Resolve ``ack`` as ``commit`` was (the journal failed: the commit is what counts)."""
    if ack.done():
        return
    err = None if commit.cancelled() else commit.exception()
    if commit.cancelled():
        ack.cancel()
    elif err is not None:
        ack.set_exception(err)
    else:
        ack.set_result(None)

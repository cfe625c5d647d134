"""The batched ledger writer: the real :class:`~kvgov.ledger.events.EventSink`.

One ``LedgerWriter`` per process owns one hash chain. Callers ``submit`` (or ``append``) events
into a bounded in-memory queue; one background task takes what has accumulated (up to
``batch_max_events``), and a single worker thread, the chain's only sequencer, writes it as one
transaction (see :mod:`kvgov.ledger.batch`). This is group commit: an event arriving while the
writer is idle is committed at once, and whatever arrives during a commit forms the next batch
(no artificial delay). Each event's future resolves with its
position only after that transaction committed, so an acknowledged event survives a crash.

Urgency: an event someone waits for (``submit``, ``append``; a put's acknowledgement) goes
into the next batch at once. An event nothing waits on (``submit_lazy``: gets, misses,
exists, evictions) may linger up to ``lazy_max_delay_ms`` so that many of them share one
commit; it goes earlier with the next urgent event, on :meth:`LedgerWriter.flush`, when a batch
is full, or on close. Lazy events are therefore durable within that window, not on return.

Journal: with a :class:`~kvgov.ledger.journal.Journal`, :meth:`LedgerWriter.submit_queued`
(a put's acknowledgement) resolves once the event is fsynced to the local journal, and the
event itself waits for company like a lazy one: Postgres gets large batches, each moving the
chain's journal mark in its own transaction. Lazy events are journaled too
(``journal_lazy_events``), nobody waiting: a crash then loses none of them either. On start,
journal records after the mark are replayed first. If the journal fails (disk full, I/O
error), it is set aside and every waiter falls back to waiting for the commit: durability never
rests on a failed write.

Failures are never acknowledged and never silently dropped: a transient database error retries
the batch with backoff (callers keep waiting); a batch the database refuses is split so that
only the offending events fail (their futures raise :class:`~kvgov.errors.LedgerError`). A
full queue raises :class:`~kvgov.errors.LedgerBackpressureError` from ``submit``; ``append``
waits for room instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import Connection, Engine, exc, select

from kvgov.db.engine import SQLITE_BEGIN_IMMEDIATE, utcnow
from kvgov.db.models import Chain, JournalMark, table
from kvgov.errors import LedgerBackpressureError, LedgerError
from kvgov.ledger.batch import (
    Applied,
    Head,
    Prepared,
    Rows,
    apply_batch,
    chain_rows,
    find_committed,
    prepare,
    read_head,
)
from kvgov.ledger.chain import key_fingerprint, public_key_bytes
from kvgov.ledger.checkpoint import CheckpointInfo, checkpoint_logged, write_checkpoint
from kvgov.ledger.events import Appended, Event
from kvgov.ledger.journal import Journal, decode_event, encode_event
from kvgov.logging import get_logger

log = get_logger(__name__)

_TRANSIENT = (exc.OperationalError, exc.InterfaceError, exc.DisconnectionError, exc.TimeoutError)
_RETRY_MAX_S = 2.0
#: a committer connection idle this long is replaced (the pool pings the new one)
_CONN_IDLE_S = 30.0
#: user pseudonyms remembered as already in ``user_refs`` (bounded; forgetting costs one upsert)
_KNOWN_USERS_MAX = 100_000


@dataclass(slots=True)
class WriterStats:
    """Counters for metrics."""

    events_written: int = 0
    events_failed: int = 0
    batches_committed: int = 0
    batch_retries: int = 0
    backpressure_rejections: int = 0
    last_batch_size: int = 0
    last_commit_s: float = 0.0
    journal_replayed: int = 0
    journal_failures: int = 0


#: an event (or, journaled, already prepared), its commit future and its journal position
#: (0: not journaled)
_Item = tuple["Event | Prepared", "asyncio.Future[Appended]", int]
_Result = Appended | LedgerError
#: batches taken from the queue and not yet committed. One: a batch is whatever queued while
#: the previous one was being committed, so batches are as large as the load makes them. With
#: two (one chained ahead), a put-heavy data plane split its events into alternating tiny
#: batches, each paying a commit's fixed cost (in the writer and in Postgres): an interleaved
#: A/B of bench/dataplane.py governed puts gave +7-9% at 1 and 4 MiB for one, and large
#: backlogs still commit at ~29k events/s (bench/ledger.py)
_PIPELINE_DEPTH = 1
#: the sequencer yields the GIL (``time.sleep(0)``) after this many events. Without it, each
#: time the committer's database call returns it waits for the CPU-bound sequencer to be
#: preempted (``sys.getswitchinterval()``, 5 ms): a GIL convoy that cost a batch of 2,000
#: events tens of milliseconds, a third of the writer's throughput
_YIELD_EVERY = 128


@dataclass(slots=True)
class _Chained:
    """A batch as the sequencer hands it to the committer."""

    results: list[_Result | None]  # per event; preset for events refused by ``prepare``
    ready: list[tuple[int, Prepared]]
    expected: Head
    rows: Rows
    #: the journal position of each ready event (0: not journaled)
    positions: list[int]
    #: the rows as COPY text (Postgres), formatted here rather than by the committer
    copy: str | None = None


class LedgerWriter:
    """Batches events into one chain. Use ``await start()`` then ``submit``/``append``."""

    def __init__(
        self,
        engine: Engine,
        *,
        chain_id: str,
        signing_key: Ed25519PrivateKey,
        batch_max_events: int = 2000,
        queue_max_events: int = 200_000,
        description: str | None = None,
        lazy_max_delay_ms: float = 25.0,
        journal: Journal | None = None,
        journal_lazy_events: bool = True,
    ) -> None:
        if not chain_id or any(c in chain_id for c in "\r\n") or len(chain_id) > 255:
            raise LedgerError("chain id must be 1..255 characters without line breaks")
        self.engine = engine
        self.chain_id = chain_id
        self._key = signing_key
        self._public_key = public_key_bytes(signing_key)
        self._batch_max = batch_max_events
        self._queue_max = queue_max_events
        self._description = description
        self._queue: deque[_Item] = deque()
        #: how long an event nothing waits on may wait for company (0: never)
        self._lazy_s = max(0.0, lazy_max_delay_ms) / 1000.0
        #: events ever queued / ever taken into a batch; the first ``_due_upto`` must go now
        self._enqueued = 0
        self._taken = 0
        self._due_upto = 0
        #: loop time at which the oldest queued event was queued
        self._oldest_at = 0.0
        self._wake = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvgov-db")
        self._seq_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvgov-seq")
        self._slots = asyncio.Semaphore(_PIPELINE_DEPTH)
        self._inflight = 0
        self._head_lock = threading.Lock()
        self._seq_head: Head = (0, "")
        self._head_reset: Head | None = None
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._abort = threading.Event()
        self.stats = WriterStats()
        self.head_seq = 0
        self._known_users: set[str] = set()
        #: the committer's connection (used only on the committer thread)
        self._conn: Connection | None = None
        self._conn_used_at = 0.0
        #: Postgres: the sequencer formats each batch as COPY text
        self._copy = engine.dialect.name == "postgresql"
        self.journal = journal
        #: the journal positions whose events the chain holds (the mark, as committed)
        self.applied_upto = 0
        #: submit_queued's waiters: (position, acknowledgement, commit), in position order
        self._jwaiters: deque[tuple[int, asyncio.Future[None], asyncio.Future[Appended]]] = deque()
        self._jwake = asyncio.Event()
        self._jtask: asyncio.Task[None] | None = None
        #: journal lazy events too (nothing waits on them; durable at the next sync)
        self._lazy_journal = journal_lazy_events
        self._jexecutor = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvgov-journal")
            if journal is not None
            else None
        )

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Register the chain (or check its key on restart), read its head, start batching.
        With a journal, its records after the chain's mark are committed before this
        returns."""
        if self._task is not None:
            return
        loop = asyncio.get_running_loop()
        self._seq_head, self.applied_upto = await loop.run_in_executor(
            self._executor, self._register_chain
        )
        self.head_seq = self._seq_head[0]
        if self.journal is not None:
            await self._replay(self.journal)
        self._task = asyncio.create_task(self._run(), name=f"kvgov-ledger-writer:{self.chain_id}")
        if self.journal is not None:
            self._jtask = asyncio.create_task(
                self._run_journal(self.journal), name=f"kvgov-ledger-journal:{self.chain_id}"
            )
            if self.stats.journal_replayed:
                # what the replayed events change (the cache-entry index) is in the database
                # before anyone reads it to start from
                await self.flush()
        log.info(
            "ledger.writer.started",
            extra={
                "chain_id": self.chain_id,
                "head_seq": self.head_seq,
                "journal": str(self.journal.directory) if self.journal is not None else None,
            },
        )

    async def _replay(self, journal: Journal) -> None:
        """Queue the journal's records after the chain's mark (acknowledged events a crash
        kept from Postgres), ahead of anything new."""
        loop = asyncio.get_running_loop()
        records = await loop.run_in_executor(
            self._executor,
            functools.partial(journal.open, self.applied_upto, chain_id=self.chain_id),
        )
        for pos, payload in records:
            event = decode_event(payload)
            fut: asyncio.Future[Appended] = loop.create_future()
            fut.add_done_callback(_log_unwritten)
            self._queue.append((event, fut, pos))
            self._enqueued += 1
        if records:
            self._idle.clear()
            self._oldest_at = loop.time()
            self._due_upto = self._enqueued
            self.stats.journal_replayed += len(records)
            log.warning(
                "ledger.journal.replayed",
                extra={
                    "chain_id": self.chain_id,
                    "events": len(records),
                    "from_position": records[0][0],
                },
            )

    def _register_chain(self) -> tuple[Head, int]:
        """Register the chain (or check its key); its head and journal mark."""
        chains = table(Chain)
        with self.engine.connect() as conn, conn.begin():
            found = conn.execute(
                select(chains.c.public_key).where(chains.c.chain_id == self.chain_id)
            ).first()
            if found is None:
                conn.execute(
                    chains.insert().values(
                        chain_id=self.chain_id,
                        public_key=self._public_key,
                        created_at=utcnow(),
                        description=self._description,
                    )
                )
            elif bytes(found[0]) != self._public_key:
                raise LedgerError(
                    f"chain {self.chain_id!r} belongs to another signing key "
                    f"({key_fingerprint(bytes(found[0]))})",
                    hint="a chain's key never changes: use a new ledger.chain_id with a new key",
                )
            mark = 0
            if self.journal is not None:
                marks = table(JournalMark)
                found_mark = conn.execute(
                    select(marks.c.applied_upto).where(marks.c.chain_id == self.chain_id)
                ).scalar()
                if found_mark is None:
                    conn.execute(marks.insert().values(chain_id=self.chain_id, applied_upto=0))
                else:
                    mark = int(found_mark)
            return read_head(conn, self.chain_id), mark

    async def close(self, *, grace_s: float | None = None, checkpoint: bool = False) -> None:
        """Stop taking events, write everything queued, stop. With ``grace_s``, events not
        written by then fail with :class:`LedgerError` (never reported as written). With
        ``checkpoint``, sign the final head (a failure is logged, the close goes on)."""
        self._closing = True
        self._wake.set()
        task = self._task
        if task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(task), grace_s)
            except TimeoutError:
                self._abort.set()
                await task
        if checkpoint and task is not None:
            await checkpoint_logged(self)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self._drop_connection)
        jtask = self._jtask
        if jtask is not None:
            self._jwake.set()
            await jtask
        if self.journal is not None and self._jexecutor is not None:
            # what was not committed stays in the journal, for the next start
            await loop.run_in_executor(self._jexecutor, self.journal.close, self.applied_upto)
            self._jexecutor.shutdown(wait=True)
        self._executor.shutdown(wait=True)
        self._seq_executor.shutdown(wait=True)
        log.info("ledger.writer.closed", extra={"chain_id": self.chain_id, **self._stats_dict()})

    # -- EventSink ------------------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    def submit(
        self, event: Event, *, urgent: bool = True, _journaled: tuple[Prepared, int] | None = None
    ) -> asyncio.Future[Appended]:
        """Queue ``event``; its future resolves once it is committed. ``urgent=False`` is
        :meth:`submit_lazy`."""
        if self._closing:
            raise LedgerError("ledger writer is closed")
        if len(self._queue) >= self._queue_max:
            self.stats.backpressure_rejections += 1
            raise LedgerBackpressureError(
                "ledger queue is full", hint="the database is slower than the event rate"
            )
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Appended] = loop.create_future()
        queue = self._queue
        if not queue:
            self._oldest_at = loop.time()
            self._wake.set()
        if _journaled is None:
            queue.append((event, fut, 0))
        else:
            queue.append((_journaled[0], fut, _journaled[1]))
        self._enqueued += 1
        self._idle.clear()
        if len(queue) >= self._queue_max:
            self._room.clear()
        if urgent or not self._lazy_s:
            self._due_upto = self._enqueued
            self._wake.set()
        elif len(queue) >= self._batch_max:
            self._wake.set()
        return fut

    def submit_lazy(self, event: Event) -> asyncio.Future[Appended]:
        """Queue an event nothing waits on: it may linger up to ``lazy_max_delay_ms`` to share
        a commit (its future still resolves once it is committed). With a journal it is also
        journaled (synced at once, nobody waiting), so a crash does not lose it."""
        journaled = None
        if self._lazy_journal:
            try:
                journaled = self._journal_event(event)
            except LedgerError:  # the batch refuses it, as it would without a journal
                journaled = None
        return self.submit(event, urgent=False, _journaled=journaled)

    def _journal_event(self, event: Event) -> tuple[Prepared, int] | None:
        """Append ``event`` to the journal and return it prepared, with its position; None if
        the journal is not taking events (absent, failed, closing, queue full). Raises
        :class:`LedgerError` for an event the ledger would refuse (nothing is journaled)."""
        journal = self.journal
        if (
            journal is None
            or journal.broken is not None
            or self._jtask is None
            or self._closing
            or len(self._queue) >= self._queue_max
        ):
            return None
        prepared = prepare(event)
        pos = journal.append(encode_event(event))
        self._jwake.set()
        return prepared, pos

    async def append(self, event: Event) -> Appended:
        while len(self._queue) >= self._queue_max and not self._closing:
            await self._room.wait()
        return await self.submit(event)

    def submit_queued(self, event: Event) -> asyncio.Future[Any]:
        """Queue ``event``; the future resolves once it is *durably queued*: fsynced to the
        local journal (the event then waits for company like a lazy one), or, without a
        working journal, committed. Raises :class:`LedgerError` for an event the ledger could
        never store, :class:`~kvgov.errors.LedgerBackpressureError` when the queue is full."""
        journaled = self._journal_event(event)  # a refusal raises now, before any ack
        if journaled is None:  # no journal takes it: closed or full (submit raises), or failed
            return self.submit(event)
        commit = self.submit(event, urgent=False, _journaled=journaled)
        commit.add_done_callback(_log_unwritten)
        ack: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._jwaiters.append((journaled[1], ack, commit))
        return ack

    async def _run_journal(self, journal: Journal) -> None:
        """Sync the journal whenever something was appended (group commit: whatever is
        appended during one sync goes in the next) and acknowledge what it covers."""
        loop = asyncio.get_running_loop()
        waiters = self._jwaiters
        while True:
            if journal.last_position <= journal.durable:  # nothing appended since the last sync
                if self._closing:
                    return
                self._jwake.clear()
                await self._jwake.wait()
                continue
            try:
                upto = await loop.run_in_executor(self._jexecutor, journal.sync)
            except OSError as err:
                self._journal_failed(err)
                return
            while waiters and waiters[0][0] <= upto:
                _, ack, _ = waiters.popleft()
                if not ack.done():
                    ack.set_result(None)

    def _journal_failed(self, err: OSError) -> None:
        """Set the journal aside: its waiters, and every later put, wait for the commit."""
        self.stats.journal_failures += 1
        log.error(
            "ledger.journal.failed",
            extra={
                "chain_id": self.chain_id,
                "error": type(err).__name__,
                "detail": err.strerror or "",
                "waiting": len(self._jwaiters),
            },
        )
        waiters, self._jwaiters = self._jwaiters, deque()
        self._jtask = None
        for _, ack, commit in waiters:
            commit.add_done_callback(functools.partial(_follow, ack))
        self._due_upto = self._enqueued  # their commits are awaited now
        self._wake.set()

    async def flush(self) -> None:
        """Commit every event submitted so far now (lazy ones too) and wait until they are
        written (or failed)."""
        if self._queue:
            self._due_upto = self._enqueued
            self._wake.set()
        while self._queue or not self._idle.is_set():
            await self._idle.wait()

    async def write_checkpoint(self) -> CheckpointInfo | None:
        """Sign the chain head as of now (after what is committed). None if already signed."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._executor, write_checkpoint, self.engine, self.chain_id, self._key
        )

    # -- the batching loop ----------------------------------------------------------------
    #
    # Two stages, one thread each, so hashing the next batch overlaps the database writing
    # the previous one: the sequencer prepares and chains a batch on top of the head it
    # expects; the committer writes it in one transaction after checking, under the chain's
    # lock, that the database head is that head (otherwise it re-chains from the real head:
    # after a refused event, or if anything else wrote to the chain).

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._queue:
                if not self._inflight:
                    self._idle.set()
                if self._closing:
                    while self._inflight:  # _settle sets _idle when the last one lands
                        self._idle.clear()
                        await self._idle.wait()
                    self._idle.set()
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            if not self._due():  # only lazy events: linger for company, or for urgency
                delay = self._oldest_at + self._lazy_s - loop.time()
                if delay > 0:
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
            n = min(len(self._queue), self._batch_max)
            if n == 0:  # pragma: no cover - only this task takes from the queue
                self._slots.release()
                continue
            items = [self._queue.popleft() for _ in range(n)]
            self._taken += n
            if self._queue:  # the rest waited at most since now (a batch was full)
                self._oldest_at = loop.time()
            if len(self._queue) < self._queue_max:
                self._room.set()
            self._inflight += 1
            try:
                chained = await loop.run_in_executor(
                    self._seq_executor,
                    self._sequence,
                    [e for e, _, _ in items],
                    [p for _, _, p in items],
                )
                commit = loop.run_in_executor(self._executor, self._commit_chained, chained)
            except Exception as err:  # noqa: BLE001 - every waiter must hear of the failure
                self._settle(items, [LedgerError(f"ledger batch failed: {type(err).__name__}")])
                continue
            commit.add_done_callback(functools.partial(self._finish, items))

    def _due(self) -> bool:
        """Whether the queue must be written now rather than lingered on."""
        return self._closing or self._due_upto > self._taken or len(self._queue) >= self._batch_max

    def _finish(self, items: list[_Item], done: asyncio.Future[list[_Result]]) -> None:
        err = done.exception()
        if err is not None:
            self._settle(items, [LedgerError(f"ledger batch failed: {type(err).__name__}")])
        else:
            self._settle(items, done.result())

    def _settle(self, items: list[_Item], results: list[_Result]) -> None:
        if len(results) == 1 and len(items) > 1:
            results = results * len(items)
        for (_, fut, _), result in zip(items, results, strict=True):
            if fut.done():
                continue
            if isinstance(result, Appended):
                fut.set_result(result)
            else:
                fut.set_exception(result)
        self._inflight -= 1
        self._slots.release()
        if not self._queue and not self._inflight:
            self._idle.set()

    def _sequence(self, events: list[Event | Prepared], positions: list[int]) -> _Chained:
        """Sequencer thread: prepare and chain a batch on top of the head it expects."""
        results: list[_Result | None] = [None] * len(events)
        ready: list[tuple[int, Prepared]] = []
        ready_positions: list[int] = []
        for i, event in enumerate(events):
            if i % _YIELD_EVERY == _YIELD_EVERY - 1:
                time.sleep(0)
            if isinstance(event, Prepared):  # journaled: prepared when it was queued
                ready.append((i, event))
                ready_positions.append(positions[i])
                continue
            try:
                ready.append((i, prepare(event)))
                ready_positions.append(positions[i])
            except LedgerError as err:
                results[i] = err
        lines: list[str] | None = [] if self._copy else None
        with self._head_lock:
            if self._head_reset is not None:
                self._seq_head, self._head_reset = self._head_reset, None
            expected = head = self._seq_head
            batch = [p for _, p in ready]
            rows: Rows = []
            for start in range(0, len(batch), _YIELD_EVERY):
                part, head = chain_rows(
                    self.chain_id, head, batch[start : start + _YIELD_EVERY], lines
                )
                rows.extend(part)
                time.sleep(0)
            self._seq_head = head
        copy = None
        if lines is not None:
            lines.append("")
            copy = "\n".join(lines)
        return _Chained(results, ready, expected, rows, ready_positions, copy)

    def _commit_chained(self, chained: _Chained) -> list[_Result]:
        """Committer thread: write a chained batch (with retries); the result of each event."""
        results = chained.results
        if chained.ready:
            batch = [p for _, p in chained.ready]
            outcomes = self._commit(
                batch, chained.positions, (chained.expected, chained.rows), chained.copy
            )
            for (i, _), outcome in zip(chained.ready, outcomes, strict=True):
                results[i] = outcome
        self.stats.events_failed += sum(isinstance(r, LedgerError) for r in results)
        return [r if r is not None else LedgerError("not written") for r in results]

    def _commit(
        self,
        batch: list[Prepared],
        positions: list[int],
        chained: tuple[Head, Rows] | None = None,
        copy: str | None = None,
    ) -> list[_Result]:
        delay = 0.05
        #: rows each try wrote: a try whose COMMIT reply was lost may be in the chain
        attempts: list[tuple[Rows, bool]] = []
        while True:
            if self._abort.is_set():
                return [LedgerError("ledger writer closed before the event was written")] * len(
                    batch
                )
            started = time.perf_counter()
            mark = max(positions, default=0)
            try:
                applied = self._transaction(batch, chained, attempts, copy, mark)
            except _TRANSIENT as err:
                self.stats.batch_retries += 1
                log.warning(
                    "ledger.batch.retry",
                    extra={"chain_id": self.chain_id, "error": type(err).__name__},
                )
                time.sleep(delay)
                delay = min(delay * 2, _RETRY_MAX_S)
                continue
            except (exc.SQLAlchemyError, LedgerError, ValueError) as err:
                if len(batch) == 1:
                    log.error(
                        "ledger.event.refused",
                        extra={"chain_id": self.chain_id, "error": type(err).__name__},
                    )
                    return [LedgerError(f"event refused by the database: {type(err).__name__}")]
                # isolate the refused events: write the others one by one
                out: list[_Result] = []
                for item, pos in zip(batch, positions, strict=True):
                    out.extend(self._commit([item], [pos]))
                return out
            appended = applied.appended
            self.stats.batches_committed += 1
            self.stats.events_written += len(appended)
            self.stats.last_batch_size = len(appended)
            self.stats.last_commit_s = time.perf_counter() - started
            self.head_seq = applied.head[0]
            if mark > self.applied_upto:
                self.applied_upto = mark
                if self.journal is not None:
                    self.journal.trim(mark)
            if applied.rechained:
                with self._head_lock:  # chained here, not by the sequencer: it must follow
                    self._head_reset = applied.head
            return list(appended)

    def _transaction(
        self,
        batch: list[Prepared],
        chained: tuple[Head, Rows] | None,
        attempts: list[tuple[Rows, bool]],
        copy: str | None = None,
        mark: int = 0,
    ) -> Applied:
        conn = self._connection()
        try:
            with conn.begin():
                # a retry first looks for its own earlier try: committed, reply lost
                found = find_committed(conn, self.chain_id, attempts) if attempts else None
                if found is not None:
                    log.warning(
                        "ledger.batch.recovered",
                        extra={"chain_id": self.chain_id, "events": len(found.appended)},
                    )
                    return found
                applied = apply_batch(
                    conn,
                    self.chain_id,
                    batch,
                    self._known_users,
                    chained=chained,
                    attempts=attempts,
                    copy=copy,
                    mark=mark,
                )
        except BaseException:
            self._drop_connection()  # whatever state it is in, the next try starts afresh
            raise
        self._conn_used_at = time.monotonic()
        # only what is committed is known: a rolled-back batch must insert its users again
        if len(self._known_users) > _KNOWN_USERS_MAX:
            self._known_users.clear()
        self._known_users.update(applied.new_users)
        return applied

    def _connection(self) -> Connection:
        """The committer's own connection, kept between batches (no pool checkout and
        pre-ping per batch). After an idle spell it is swapped for a fresh, pinged one."""
        conn = self._conn
        if conn is not None and time.monotonic() - self._conn_used_at > _CONN_IDLE_S:
            self._drop_connection()
            conn = None
        if conn is None:
            conn = self.engine.connect().execution_options(**{SQLITE_BEGIN_IMMEDIATE: True})
            self._conn = conn
        return conn

    def _drop_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(exc.SQLAlchemyError, OSError):
                conn.close()

    def _stats_dict(self) -> dict[str, float | int]:
        s = self.stats
        return {
            "events_written": s.events_written,
            "events_failed": s.events_failed,
            "batches_committed": s.batches_committed,
            "batch_retries": s.batch_retries,
        }


def _log_unwritten(fut: asyncio.Future[Appended]) -> None:
    """A journaled event's commit, which nothing awaits: a failure is logged (the event stays
    in the journal, replayed at the next start)."""
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

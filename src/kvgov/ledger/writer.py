"""The batched ledger writer: the real :class:`~kvgov.ledger.events.EventSink`.

One ``LedgerWriter`` per process owns one hash chain. Callers ``submit`` (or ``append``) events
into a bounded in-memory queue; one background task takes what has accumulated (up to
``batch_max_events``), and a single worker thread, the chain's only sequencer, writes it as one
transaction (see :mod:`kvgov.ledger.batch`). This is group commit: an event arriving while the
writer is idle is committed at once, and whatever arrives during a commit forms the next batch
(``batch_max_delay_ms`` is accepted but adds no delay). Each event's future resolves with its
position only after that transaction committed, so an acknowledged event survives a crash.

Failures are never acknowledged and never silently dropped: a transient database error retries
the batch with backoff (callers keep waiting); a batch the database refuses is split so that
only the offending events fail (their futures raise :class:`~kvgov.errors.LedgerError`). A
full queue raises :class:`~kvgov.errors.LedgerBackpressureError` from ``submit``; ``append``
waits for room instead.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import Engine, exc, select

from kvgov.errors import LedgerBackpressureError, LedgerError
from kvgov.ledger.batch import Prepared, apply_batch, prepare
from kvgov.ledger.chain import key_fingerprint, public_key_bytes
from kvgov.ledger.checkpoint import CheckpointInfo, write_checkpoint
from kvgov.ledger.db import SQLITE_BEGIN_IMMEDIATE, utcnow
from kvgov.ledger.events import Appended, Event
from kvgov.ledger.models import Chain, table
from kvgov.logging import get_logger

log = get_logger(__name__)

_TRANSIENT = (exc.OperationalError, exc.InterfaceError, exc.DisconnectionError, exc.TimeoutError)
_RETRY_MAX_S = 2.0
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


_Item = tuple[Event, "asyncio.Future[Appended]"]


class LedgerWriter:
    """Batches events into one chain. Use ``await start()`` then ``submit``/``append``."""

    def __init__(
        self,
        engine: Engine,
        *,
        chain_id: str,
        signing_key: Ed25519PrivateKey,
        batch_max_events: int = 2000,
        batch_max_delay_ms: float = 0.0,
        queue_max_events: int = 200_000,
        description: str | None = None,
    ) -> None:
        if not chain_id or any(c in chain_id for c in "\r\n") or len(chain_id) > 255:
            raise LedgerError("chain id must be 1..255 characters without line breaks")
        self.engine = engine
        self.chain_id = chain_id
        self._key = signing_key
        self._public_key = public_key_bytes(signing_key)
        self._batch_max = batch_max_events
        #: accepted for compatibility; the writer no longer lingers (see ``_run``)
        self._linger_s = batch_max_delay_ms / 1000.0
        self._queue_max = queue_max_events
        self._description = description
        self._queue: deque[_Item] = deque()
        self._wake = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvgov-ledger")
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._abort = threading.Event()
        self.stats = WriterStats()
        self.head_seq = 0
        self._known_users: set[str] = set()

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Register the chain (or check its key on restart), read its head, start batching."""
        if self._task is not None:
            return
        loop = asyncio.get_running_loop()
        self.head_seq = await loop.run_in_executor(self._executor, self._register_chain)
        self._task = asyncio.create_task(self._run(), name=f"kvgov-ledger-writer:{self.chain_id}")
        log.info(
            "ledger.writer.started",
            extra={"chain_id": self.chain_id, "head_seq": self.head_seq},
        )

    def _register_chain(self) -> int:
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
            from kvgov.ledger.batch import read_head

            seq, _ = read_head(conn, self.chain_id)
            return seq

    async def close(self, *, grace_s: float | None = None) -> None:
        """Stop taking events, write everything queued, stop. With ``grace_s``, events not
        written by then fail with :class:`LedgerError` (never reported as written)."""
        self._closing = True
        self._wake.set()
        task = self._task
        if task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(task), grace_s)
            except TimeoutError:
                self._abort.set()
                await task
        self._executor.shutdown(wait=True)
        log.info("ledger.writer.closed", extra={"chain_id": self.chain_id, **self._stats_dict()})

    # -- EventSink ------------------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    def submit(self, event: Event) -> asyncio.Future[Appended]:
        if self._closing:
            raise LedgerError("ledger writer is closed")
        if len(self._queue) >= self._queue_max:
            self.stats.backpressure_rejections += 1
            raise LedgerBackpressureError(
                "ledger queue is full", hint="the database is slower than the event rate"
            )
        fut: asyncio.Future[Appended] = asyncio.get_running_loop().create_future()
        self._queue.append((event, fut))
        self._idle.clear()
        if len(self._queue) >= self._queue_max:
            self._room.clear()
        self._wake.set()
        return fut

    async def append(self, event: Event) -> Appended:
        while len(self._queue) >= self._queue_max and not self._closing:
            await self._room.wait()
        return await self.submit(event)

    async def flush(self) -> None:
        """Wait until every event submitted so far is written (or failed)."""
        while self._queue or not self._idle.is_set():
            await self._idle.wait()

    async def write_checkpoint(self) -> CheckpointInfo | None:
        """Sign the chain head as of now (after what is committed). None if already signed."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._executor, write_checkpoint, self.engine, self.chain_id, self._key
        )

    # -- the batching loop ----------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._queue:
                self._idle.set()
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            # group commit: no artificial delay. What queued while the previous batch was
            # committing is the next batch; the first event after an idle spell goes at once.
            n = min(len(self._queue), self._batch_max)
            items = [self._queue.popleft() for _ in range(n)]
            if len(self._queue) < self._queue_max:
                self._room.set()
            events = [event for event, _ in items]
            try:
                results = await loop.run_in_executor(self._executor, self._write, events)
            except Exception as err:  # noqa: BLE001 - every waiter must hear of the failure
                failure = LedgerError(f"ledger batch failed: {type(err).__name__}")
                results = [failure] * len(items)
            for (_, fut), result in zip(items, results, strict=True):
                if fut.done():
                    continue
                if isinstance(result, Appended):
                    fut.set_result(result)
                else:
                    fut.set_exception(result)

    def _write(self, events: list[Event]) -> list[Appended | LedgerError]:
        """Runs in the worker thread: prepare, then commit with retries."""
        results: list[Appended | LedgerError | None] = [None] * len(events)
        ready: list[tuple[int, Prepared]] = []
        for i, event in enumerate(events):
            try:
                ready.append((i, prepare(event)))
            except LedgerError as err:
                results[i] = err
        if ready:
            for (i, _), outcome in zip(ready, self._commit([p for _, p in ready]), strict=True):
                results[i] = outcome
        self.stats.events_failed += sum(isinstance(r, LedgerError) for r in results)
        return [r if r is not None else LedgerError("not written") for r in results]

    def _commit(self, batch: list[Prepared]) -> list[Appended | LedgerError]:
        delay = 0.05
        while True:
            if self._abort.is_set():
                return [LedgerError("ledger writer closed before the event was written")] * len(
                    batch
                )
            started = time.perf_counter()
            try:
                appended = self._transaction(batch)
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
                out: list[Appended | LedgerError] = []
                for item in batch:
                    out.extend(self._commit([item]))
                return out
            self.stats.batches_committed += 1
            self.stats.events_written += len(appended)
            self.stats.last_batch_size = len(appended)
            self.stats.last_commit_s = time.perf_counter() - started
            self.head_seq = appended[-1].seq
            return list(appended)

    def _transaction(self, batch: list[Prepared]) -> list[Appended]:
        with self.engine.connect() as plain:
            conn = plain.execution_options(**{SQLITE_BEGIN_IMMEDIATE: True})
            with conn.begin():
                applied = apply_batch(conn, self.chain_id, batch, self._known_users)
        # only what is committed is known: a rolled-back batch must insert its users again
        if len(self._known_users) > _KNOWN_USERS_MAX:
            self._known_users.clear()
        self._known_users.update(applied.new_users)
        return applied.appended

    def _stats_dict(self) -> dict[str, float | int]:
        s = self.stats
        return {
            "events_written": s.events_written,
            "events_failed": s.events_failed,
            "batches_committed": s.batches_committed,
            "batch_retries": s.batch_retries,
        }


async def periodic_checkpoints(writer: LedgerWriter, interval_s: float) -> None:
    """Sign the head every ``interval_s`` seconds until cancelled (``kvgov serve`` runs this)."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await writer.write_checkpoint()
        except LedgerError as err:
            log.warning("ledger.checkpoint.failed", extra={"error": err.code})

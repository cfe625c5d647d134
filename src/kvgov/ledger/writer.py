"""The batched ledger writer: the real :class:`~kvgov.ledger.events.EventSink`.

One ``LedgerWriter`` per process owns one hash chain. Callers ``submit`` (or ``append``) events
into a bounded in-memory queue; one background task takes what has accumulated (up to
``batch_max_events``), a sequencer thread chains it and a committer thread writes it as one
transaction. This is group commit: an event arriving while the writer is idle is committed at
once, and whatever arrives during a commit forms the next batch (no artificial delay). Each
event's future resolves with its position only after that transaction committed, so an
acknowledged event survives a crash.

``LedgerWriter`` is a facade; each concern is a part of its own in :mod:`kvgov.ledger.writing`:

- urgency and batching (:mod:`~kvgov.ledger.writing.schedule`): an event someone waits for
  (``submit``, ``append``) goes into the next batch at once; one nothing waits on
  (``submit_lazy``: gets, misses, exists, evictions) may linger up to ``lazy_max_delay_ms`` to
  share a commit, and goes earlier with the next urgent event, on :meth:`LedgerWriter.flush`,
  when a batch is full, or on close: lazy events are durable within that window;
- sequencing (:mod:`~kvgov.ledger.writing.sequence`): the chain head, seqs and hashes;
- committing (:mod:`~kvgov.ledger.writing.commit`): a transient database error retries the
  batch with backoff (callers keep waiting); a batch the database refuses is split so that
  only the offending events fail (:class:`~kvgov.errors.LedgerError`);
- journal acknowledgement (:mod:`~kvgov.ledger.writing.acks`): with a
  :class:`~kvgov.ledger.journal.Journal`, :meth:`LedgerWriter.submit_queued` resolves once the
  event is fsynced to the local journal, and the event waits for company like a lazy one; lazy
  events are journaled too (``journal_lazy_events``). A failed journal is set aside and its
  waiters wait for their commits: durability never rests on a failed write;
- replay (:mod:`~kvgov.ledger.writing.replay`): on start, the chain is registered and the
  journal records after its mark are committed before anything new;
- seals (:mod:`~kvgov.ledger.seals`): a new chain's genesis and each session's open (at start)
  and close (at close) are signed, so that nobody without the key can start a chain or append
  to one its writer closed; on Postgres the writer holds the chain's writer lock for its life;
- foreign appends (:mod:`~kvgov.ledger.writing.foreign`): rows someone else appended to the
  chain while the writer holds it are named by a signed foreign seal before the writer's next
  batch, checkpoint or close signs anything over them.

Failures are never acknowledged and never silently dropped. A full queue raises
:class:`~kvgov.errors.LedgerBackpressureError` from ``submit``; ``append`` waits for room.
"""

from __future__ import annotations

import asyncio
import functools
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import Engine, exc

from kvgov.errors import LedgerBackpressureError, LedgerError
from kvgov.ledger.batch import Prepared
from kvgov.ledger.chain import public_key_bytes
from kvgov.ledger.checkpoint import CheckpointInfo, checkpoint_logged, write_checkpoint
from kvgov.ledger.events import Appended, Event
from kvgov.ledger.journal import Journal
from kvgov.ledger.seals import (
    MAX_LEASE_S,
    Claim,
    claim_chain,
    close_session,
    new_session,
    resume,
)
from kvgov.ledger.writing.acks import JournalAcks
from kvgov.ledger.writing.commit import Committer
from kvgov.ledger.writing.foreign import ForeignWatch
from kvgov.ledger.writing.replay import register_chain, replay
from kvgov.ledger.writing.schedule import Batcher, Item, Schedule
from kvgov.ledger.writing.sequence import Chained, Sequencer
from kvgov.ledger.writing.stats import WriterStats
from kvgov.logging import get_logger

__all__ = ["LedgerWriter", "WriterStats"]

log = get_logger(__name__)


class LedgerWriter:
    """Batches events into one chain. Use ``await start()`` then ``submit``/``append``.

    A facade over its parts (:mod:`kvgov.ledger.writing`): the :class:`Schedule` and its
    :class:`Batcher` (urgency and batching), the :class:`Sequencer` (chain head, seq, hashes),
    the :class:`Committer` (the transaction), :class:`JournalAcks` (durable-on-journal
    acknowledgements) and :func:`replay` (the journal read back at start)."""

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
        journal_sync_interval_ms: float = 0.0,
        exclusive: bool | None = None,
        every_transaction: bool = False,
        lease_s: int | None = None,
    ) -> None:
        if not chain_id or any(c in chain_id for c in "\r\n") or len(chain_id) > 255:
            raise LedgerError("chain id must be 1..255 characters without line breaks")
        if lease_s is not None and not (every_transaction and 1 <= lease_s <= MAX_LEASE_S):
            # its sessions are renewed in its transactions: only one that checks them in
            # every transaction keeps them from lapsing while it writes
            raise LedgerError(
                f"a neighbour writer's lease is 1..{MAX_LEASE_S} seconds, with every_transaction"
            )
        self.engine = engine
        self.chain_id = chain_id
        self.journal = journal
        self.stats = WriterStats()
        self._key = signing_key
        self._description = description
        #: this writer holds the chain alone, so its open ends every earlier session of the
        #: chain (:mod:`kvgov.ledger.seals`); None: when it holds a journal's lock or the
        #: chain's writer lock (Postgres)
        self._exclusive = exclusive
        #: a neighbour writer's lease (``lease_s``; see ``_watch``), None for a chain's own
        self._lease_s = lease_s
        #: the session this writer opened (signed open at start, signed close at close)
        self._session: str | None = None
        self._claim: Claim | None = None
        #: one thread each: the committer (and start-up, checkpoints), the sequencer
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvgov-db")
        self._seq_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvgov-seq")
        self._schedule = Schedule(
            batch_max=batch_max_events,
            queue_max=queue_max_events,
            lazy_max_delay_ms=lazy_max_delay_ms,
        )
        self._sequencer = Sequencer(chain_id, copy=engine.dialect.name == "postgresql")
        #: the head this writer left, and its sessions: rows it did not write are sealed
        #: ``every_transaction``: a short-lived writer beside a live one (``kvgov token``)
        #: checks in every transaction that its session still covers the chain (a sidecar
        #: starting beside it ends it), not only when the head moved
        #: ``lease_s``: a neighbour writer beside the chain's own (the CLI's ``append_events``):
        #: its sessions sign a lease, after which an open it has not closed over explains
        #: nothing new to another writer's watch or to verification; it renews them as it
        #: writes (:func:`kvgov.ledger.seals.keep_open`)
        self._watch = ForeignWatch(
            chain_id,
            signing_key,
            self.stats,
            every_transaction=every_transaction,
            lease_s=lease_s,
        )
        self._committer = Committer(
            engine,
            chain_id,
            self.stats,
            journal=journal,
            follow=self._sequencer.follow,
            watch=self._watch,
        )
        self._batcher: Batcher[Chained] = Batcher(
            self._schedule,
            sequence=self._sequencer.sequence,
            commit=self._committer.commit_chained,
            seq_executor=self._seq_executor,
            db_executor=self._executor,
        )
        self._acks = (
            JournalAcks(
                journal,
                chain_id,
                self.stats,
                on_failed=self._batcher.hurry,
                sync_interval_s=journal_sync_interval_ms / 1000.0,
            )
            if journal is not None
            else None
        )
        #: journal lazy events too (nothing waits on them; durable at the next sync)
        self._lazy_journal = journal_lazy_events

    @property
    def head_seq(self) -> int:
        """The last seq the chain holds, as committed."""
        return self._committer.head_seq

    @property
    def applied_upto(self) -> int:
        """The journal positions whose events the chain holds (the mark, as committed)."""
        return self._committer.applied_upto

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Register the chain (or check its key on restart), sign its genesis (a new chain)
        and this session's open at its head, start batching. With a journal, its records after
        the chain's mark are committed before this returns."""
        if self._batcher.task is not None:
            return
        loop = asyncio.get_running_loop()
        session = new_session(self._lease_s)
        claim = await loop.run_in_executor(self._executor, claim_chain, self.engine, self.chain_id)
        exclusive = self._exclusive
        if exclusive is None:
            exclusive = self.journal is not None or claim.held
        try:
            head, mark = await loop.run_in_executor(
                self._executor,
                functools.partial(
                    register_chain,
                    self.engine,
                    self.chain_id,
                    public_key_bytes(self._key),
                    description=self._description,
                    journaled=self.journal is not None,
                    signing_key=self._key,
                    session=session,
                    exclusive=exclusive,
                ),
            )
        except BaseException:
            await loop.run_in_executor(self._executor, claim.release)
            raise
        self._session, self._claim = session, claim
        # a writer dropped without close() must not keep its lock's connection open
        weakref.finalize(self, claim.abandon)
        self._sequencer.start(head)
        self._watch.start(session, head)
        self._committer.head_seq = head[0]
        self._committer.applied_upto = mark
        if self.journal is not None:
            try:
                items = await replay(
                    self.journal,
                    self.chain_id,
                    mark,
                    executor=self._executor,
                    stats=self.stats,
                    engine=self.engine,  # the mark confirmed against the chain
                )
            except BaseException:  # not started: the session stays open, as after a crash
                self._session = self._claim = None
                await loop.run_in_executor(self._executor, claim.release)
                raise
            self._batcher.push_replayed(items, loop.time())
        self._batcher.start(f"kvgov-ledger-writer:{self.chain_id}")
        if self._acks is not None:
            self._acks.start(f"kvgov-ledger-journal:{self.chain_id}")
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

    async def close(self, *, grace_s: float | None = None, checkpoint: bool = False) -> None:
        """Stop taking events, write everything queued, stop. With ``grace_s``, events not
        written by then fail with :class:`LedgerError` (never reported as written). With
        ``checkpoint``, sign the final head (a failure is logged, the close goes on). Then the
        session's signed close (:mod:`kvgov.ledger.seals`): events appended after it, by
        anyone, fail verification until a writer opens the chain again."""
        self._batcher.close()
        if self._acks is not None:
            self._acks.closing = True
        task = self._batcher.task
        if task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(task), grace_s)
            except TimeoutError:
                self._committer.abort.set()
                await task
        if checkpoint and task is not None:
            await checkpoint_logged(self)
        loop = asyncio.get_running_loop()
        session, self._session = self._session, None
        if session is not None:
            session = self._watch.session or session  # the current one (it may have resumed)
            # the session's signed close: whatever is appended after it fails verification
            try:
                await loop.run_in_executor(
                    self._executor,
                    functools.partial(
                        close_session,
                        self.engine,
                        self.chain_id,
                        self._key,
                        session,
                        check=self._watch,
                    ),
                )
            except (LedgerError, exc.SQLAlchemyError, OSError) as err:
                log.warning(
                    "ledger.seal.close_failed",
                    extra={"chain_id": self.chain_id, "error": type(err).__name__},
                )
        claim, self._claim = self._claim, None
        if claim is not None:
            await loop.run_in_executor(self._executor, claim.release)
        await loop.run_in_executor(self._executor, self._committer.drop_connection)
        if self._acks is not None:
            # what was not committed stays in the journal, for the next start
            await self._acks.close(self.applied_upto)
        self._executor.shutdown(wait=True)
        self._seq_executor.shutdown(wait=True)
        log.info("ledger.writer.closed", extra={"chain_id": self.chain_id, **self.stats.summary()})

    # -- EventSink ------------------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        return len(self._schedule)

    def submit(
        self, event: Event, *, urgent: bool = True, _journaled: tuple[Prepared, int] | None = None
    ) -> asyncio.Future[Appended]:
        """Queue ``event``; its future resolves once it is committed. ``urgent=False`` is
        :meth:`submit_lazy`. ``_journaled``: the event as :meth:`_journal_event` just journaled
        it, which found the writer open and room in the queue (nothing ran since: not asked
        again)."""
        if _journaled is None:
            schedule = self._schedule
            if schedule.closing:
                raise LedgerError("ledger writer is closed")
            if schedule.full:
                self.stats.backpressure_rejections += 1
                raise LedgerBackpressureError(
                    "ledger queue is full", hint="the database is slower than the event rate"
                )
            item_event: Event | Prepared = event
            position = 0
        else:
            item_event, position = _journaled
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Appended] = loop.create_future()
        item: Item = (item_event, fut, position)
        self._batcher.push(item, urgent=urgent, loop=loop)
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
        :class:`LedgerError` for an event the ledger would refuse (nothing is journaled).
        What it returns is queued at once (:meth:`submit` does not check the queue again)."""
        acks = self._acks
        schedule = self._schedule
        if acks is None or not acks.taking or schedule.closing or schedule.full:
            return None
        return acks.append(event)

    async def append(self, event: Event) -> Appended:
        await self._batcher.wait_for_room()
        return await self.submit(event)

    def submit_queued(self, event: Event, *, hold: bool = False) -> asyncio.Future[Any]:
        """Queue ``event``; the future resolves once it is *durably queued*: fsynced to the
        local journal (the event then waits for company like a lazy one), or, without a
        working journal, committed. ``hold``: the caller has more acknowledged events right
        behind this one (a client streaming PUT frames): the journal sync may wait up to
        ``journal_sync_interval_ms`` for them (:mod:`~kvgov.ledger.writing.acks`). Raises
        :class:`LedgerError` for an event the ledger could never store,
        :class:`~kvgov.errors.LedgerBackpressureError` when the queue is full."""
        acks = self._acks
        journaled = self._journal_event(event)  # a refusal raises now, before any ack
        if journaled is None or acks is None:
            # no journal takes it: closed or full (submit raises), or failed
            return self.submit(event)
        commit = self.submit(event, urgent=False, _journaled=journaled)
        return acks.acknowledgement(journaled[1], commit, hold=hold)

    async def flush(self) -> None:
        """Commit every event submitted so far now (lazy ones too) and wait until they are
        written (or failed)."""
        await self._batcher.flush()

    async def write_checkpoint(self) -> CheckpointInfo | None:
        """Sign the chain head as of now (after what is committed). None if already signed."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._checkpoint)

    def _checkpoint(self) -> CheckpointInfo | None:  # executor thread
        session = self._session
        if session is None:  # not started, or closed: nothing of its own to watch
            return write_checkpoint(self.engine, self.chain_id, self._key)
        # still covering the chain (another writer may have claimed it); the current session
        # is the watch's (a batch may have resumed it)
        self._session = resume(
            self.engine,
            self.chain_id,
            self._key,
            self._watch.session or session,
            lease_s=self._lease_s,
        )
        self._watch.adopt(self._session)
        # rows someone else appended since the last batch are sealed before it signs
        return write_checkpoint(self.engine, self.chain_id, self._key, check=self._watch)

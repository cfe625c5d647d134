"""Committing: a chained batch written in one transaction, on the committer thread.

The :class:`Committer` owns the writer's database connection (kept between batches, replaced
after an idle spell) and writes each batch the :class:`~kvgov.ledger.writing.sequence.Sequencer`
chained with :func:`~kvgov.ledger.batch.apply_batch` (Postgres fast paths:
:mod:`kvgov.ledger.pgfast`). Around that transaction:

- a transient error (connection lost, timeout) retries the batch with backoff, and a retry
  first looks for its own earlier try in the chain (committed, reply lost:
  :func:`~kvgov.ledger.batch.find_committed`), so nothing is written twice;
- an error the database gives for the batch's content splits it: each event is written alone,
  and only the refused ones fail (:class:`~kvgov.errors.LedgerError`);
- a batch that holds journal records moves the chain's journal mark in the same transaction;
  once committed, the journal segments the chain wholly holds are deleted;
- a batch the committer had to re-chain on the database's real head tells the sequencer to
  follow that head;
- with the live writer's :class:`~kvgov.ledger.writing.foreign.ForeignWatch`, a head that is
  not the one the writer last left has the rows it did not write sealed as foreign, in the
  same transaction and before the batch (the fast path's own head check, or the head the
  general path reads anyway: nothing more per batch);
- a failure to write such a seal of the writer's own (:class:`~kvgov.errors.LedgerSealError`)
  is the writer's, not the events': the batch is retried with backoff and the failure logged
  (``ledger.chain.seal_failed``) and counted (``stats.seal_failures``); its events are never
  refused for it (review r11, F1). The watch turns every failure of its own work (but a
  transient one) into that error, so nothing it raises is read as a refusal of the events
  (review r13, F2: a ``ValueError`` from a foreign row's malformed hash was).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

from sqlalchemy import Connection, Engine, exc

from kvgov.db.engine import SQLITE_BEGIN_IMMEDIATE
from kvgov.errors import LedgerError, LedgerSealError
from kvgov.ledger.batch import (
    Applied,
    Head,
    HeadCheck,
    Prepared,
    Rows,
    apply_batch,
    find_committed,
)
from kvgov.ledger.journal import Journal
from kvgov.ledger.writing.sequence import Chained, Result
from kvgov.ledger.writing.stats import WriterStats
from kvgov.logging import get_logger

log = get_logger(__name__)

TRANSIENT = (exc.OperationalError, exc.InterfaceError, exc.DisconnectionError, exc.TimeoutError)
RETRY_MAX_S = 2.0
#: a committer connection idle this long is replaced (the pool pings the new one)
CONN_IDLE_S = 30.0
#: user pseudonyms remembered as already in ``user_refs`` (bounded; forgetting costs one upsert)
KNOWN_USERS_MAX = 100_000


class Committer:
    """Writes chained batches of one chain (committer thread only, but for :attr:`abort`)."""

    def __init__(
        self,
        engine: Engine,
        chain_id: str,
        stats: WriterStats,
        *,
        journal: Journal | None,
        follow: Callable[[Head], None],
        watch: HeadCheck | None = None,
    ) -> None:
        self.engine = engine
        self.chain_id = chain_id
        self.stats = stats
        self.journal = journal
        #: the live writer's watch for rows it did not write (None: no session, no check)
        self.watch = watch
        #: told the head a batch was re-chained on (the sequencer must follow it)
        self._follow = follow
        #: set when the writer closes with a grace period that ran out: give up, do not retry
        self.abort = threading.Event()
        #: the last seq the chain holds, as committed
        self.head_seq = 0
        #: the journal positions whose events the chain holds (the mark, as committed)
        self.applied_upto = 0
        self._known_users: set[str] = set()
        self._conn: Connection | None = None
        self._conn_used_at = 0.0

    def commit_chained(self, chained: Chained) -> list[Result]:
        """Write a chained batch (with retries); the result of each event."""
        results = chained.results
        if chained.ready:
            batch = [p for _, p in chained.ready]
            outcomes = self._commit(
                batch, chained.positions, (chained.expected, chained.rows), chained.copy
            )
            for (i, _), outcome in zip(chained.ready, outcomes, strict=True):
                results[i] = outcome
        self.stats.events_failed += sum([isinstance(r, LedgerError) for r in results])
        return [r if r is not None else LedgerError("not written") for r in results]

    def _commit(
        self,
        batch: list[Prepared],
        positions: list[int],
        chained: tuple[Head, Rows] | None = None,
        copy: str | None = None,
    ) -> list[Result]:
        delay = 0.05
        #: rows each try wrote: a try whose COMMIT reply was lost may be in the chain
        attempts: list[tuple[Rows, bool]] = []
        while True:
            if self.abort.is_set():
                return [LedgerError("ledger writer closed before the event was written")] * len(
                    batch
                )
            started = time.perf_counter()
            mark = max(positions, default=0)
            try:
                applied = self._transaction(batch, chained, attempts, copy, mark)
            except TRANSIENT as err:
                self.stats.batch_retries += 1
                log.warning(
                    "ledger.batch.retry",
                    extra={"chain_id": self.chain_id, "error": type(err).__name__},
                )
                time.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_S)
                continue
            except LedgerSealError as err:
                # the writer's own seal (a foreign seal, a resumed open), not the events: retry
                # (a taken key gets a fresh random part) and alert, never refuse them
                self.stats.seal_failures += 1
                log.error(
                    "ledger.chain.seal_failed",
                    extra={
                        "chain_id": self.chain_id,
                        "error": type(err.__cause__ or err).__name__,
                    },
                )
                time.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_S)
                continue
            except (exc.SQLAlchemyError, LedgerError, ValueError) as err:
                if len(batch) == 1:
                    log.error(
                        "ledger.event.refused",
                        extra={"chain_id": self.chain_id, "error": type(err).__name__},
                    )
                    return [LedgerError(f"event refused by the database: {type(err).__name__}")]
                # isolate the refused events: write the others one by one
                out: list[Result] = []
                for item, pos in zip(batch, positions, strict=True):
                    out.extend(self._commit([item], [pos]))
                return out
            appended = applied.appended
            self.stats.batches_committed += 1
            self.stats.events_written += len(appended)
            self.stats.last_batch_size = len(appended)
            self.stats.last_commit_s = time.perf_counter() - started
            self.head_seq = applied.head[0]
            if self.watch is not None:
                self.watch.settle(applied.head, applied.foreign)
            if mark > self.applied_upto:
                self.applied_upto = mark
                if self.journal is not None:
                    self.journal.trim(mark)
            if applied.rechained:  # chained here, not by the sequencer: it must follow
                self._follow(applied.head)
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
                    check=self.watch,
                )
        except BaseException:
            self.drop_connection()  # whatever state it is in, the next try starts afresh
            raise
        self._conn_used_at = time.monotonic()
        # only what is committed is known: a rolled-back batch must insert its users again
        if len(self._known_users) > KNOWN_USERS_MAX:
            self._known_users.clear()
        self._known_users.update(applied.new_users)
        return applied

    def _connection(self) -> Connection:
        """The committer's own connection, kept between batches (no pool checkout and
        pre-ping per batch). After an idle spell it is swapped for a fresh, pinged one."""
        conn = self._conn
        if conn is not None and time.monotonic() - self._conn_used_at > CONN_IDLE_S:
            self.drop_connection()
            conn = None
        if conn is None:
            conn = self.engine.connect().execution_options(**{SQLITE_BEGIN_IMMEDIATE: True})
            self._conn = conn
        return conn

    def drop_connection(self) -> None:
        """Close the connection (committer thread; the next batch opens another)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(exc.SQLAlchemyError, OSError):
                conn.close()

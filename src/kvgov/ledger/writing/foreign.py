"""Foreign appends: rows a live writer finds on its chain that it did not write.

The runtime database role (every sidecar pod holds it) may INSERT into ``ledger_events``, and
the chain hash is unkeyed: with stolen runtime credentials anyone can compute correctly chained
rows and append them to a live writer's chain. The writer re-chains its next batch on the real
head, so without this its next checkpoint and its close would sign over them and its session
would cover them (``docs/ledger.md``, "Chain seals").

The :class:`ForeignWatch` knows the head the writer last wrote (or accounted for). Whenever the
writer reads its chain's head under the chain lock (the general path of a batch, after the fast
path declined because the head moved; its checkpoints; its close) it compares the two: equal,
nothing happened (a batch re-chained after a refused event leaves them equal). Otherwise the
rows ``(known, head]`` are not the writer's. Those another valid writer session of the chain
covers (a ``kvgov token`` or ``kvgov tenant`` command writing beside the sidecar: its own
signed open, its rows, its close) are explained; the rest are named, before anything of the
writer's own in the same transaction, by a signed ``foreign`` seal
(:func:`kvgov.ledger.seals.write_foreign_seal`), which verification turns into
``foreign_append``. The writer keeps serving (it cannot un-append) and chains on the real head.

Explained means: covered, as the seals stand when the lock is held and at the writer's now
(:func:`kvgov.ledger.seals.span_of`), by a valid open of a session that is not one of this
writer's (its first, or one it resumed), up to that session's close or the exclusive open that
ended it, or up to the head while it is open-ended, less whatever that session's own foreign
seals disclaim. A neighbour session (a CLI command's: its id signs a lease) with no close of
its own is open-ended only within its lease: a command killed before its close no longer
explains, for ever, every row appended after it (``docs/ledger.md``, "Neighbour sessions").
What this cannot tell apart: rows appended while another session is open beside the writer
(either may have written them; a CLI command lives seconds, at most its lease), and, for a
writer that is not exclusive, rows an earlier crashed session (not a neighbour's) still covers
(``docs/ledger.md``, "Chain seals").

The comparison uses the head the transaction reads anyway: a batch whose head is the known one
costs nothing more; the seals are read only when it moved, and then at a bounded cost
(:func:`kvgov.ledger.seals.read_seals`, :mod:`kvgov.ledger.seals.scan`: junk rows the runtime
role inserted into ``chain_seals`` are checked once per process, and past the read's cap of rows
that do not verify it raises, which fails the transaction as a seal failure below: retried and
alerted on, the events wait; the watch never judges on part of the seals).

A transaction that finds the head moved also keeps the writer's own session covering the
chain (:func:`kvgov.ledger.seals.keep_open`, in that transaction, before the writer's rows): a
``kvgov token`` command whose session a starting sidecar's exclusive open ended re-opens
before it writes, so the sidecar's watch finds its rows explained (review r11, F2). A writer
created with ``every_transaction`` (the CLI's :func:`kvgov.cli._common.append_events`) does so
in every transaction, not only when the head moved: the sidecar's open moves no head. With a
``lease_s`` (the CLI's too) that is also where its neighbour session is renewed once half its
lease has passed (:func:`kvgov.ledger.seals.keep_open`).

The watch's own seals never cost the writer its events: a foreign seal's key has a random part
(the runtime role cannot take it first, review r11, F1), and a seal that still cannot be written
raises :class:`~kvgov.errors.LedgerSealError`, which the committer retries and alerts on
(``ledger.chain.seal_failed``, ``stats.seal_failures``) instead of refusing the batch. Any
failure of the watch's own work but a transient one is turned into that error (review r13, F2:
a ``ValueError`` from a foreign row's malformed hash escaped it and was read as the events'
refusal); a malformed hash itself is signed as its :func:`~kvgov.ledger.chain.link_target`.
"""

from __future__ import annotations

from datetime import datetime

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import Connection, exc, select

from kvgov.db.engine import utcnow
from kvgov.db.models import LedgerEvent, table
from kvgov.errors import LedgerSealError
from kvgov.ledger.batch import Disclaimed, Head
from kvgov.ledger.chain import GENESIS_HASH, link_target, public_key_bytes
from kvgov.ledger.seals import (
    Seal,
    SealKind,
    foreign_ranges,
    keep_open,
    read_seals,
    session_end,
    subtract,
    write_foreign_seal,
)
from kvgov.ledger.writing.stats import WriterStats
from kvgov.logging import get_logger

log = get_logger(__name__)


def unexplained(
    seals: list[Seal],
    public_key: bytes,
    mine: set[str],
    known: int,
    head: int,
    *,
    now: datetime | None = None,
) -> Disclaimed:
    """The runs ``(first, last)`` of positions ``known + 1..head`` that no valid writer
    session other than ``mine`` covers as of ``now`` (``seals``: the chain's, checked against
    its key; a neighbour session's lease: :func:`kvgov.ledger.seals.span_of`)."""
    valid = [
        s
        for s in seals
        if s.kind in (SealKind.OPEN, SealKind.CLOSE, SealKind.FOREIGN)
        and s.signature_ok(public_key, None)
    ]
    others = [
        (s.seq, session_end(valid, s, now=now))
        for s in valid
        if s.kind == SealKind.OPEN and s.session not in mine
    ]
    # another session's rows, as far as it still claims them
    covered = subtract(others, foreign_ranges(valid))
    cuts = [(start, head if end is None else end) for start, end in covered]
    runs = subtract([(known, head)], cuts)
    return [(start + 1, end) for start, end in runs if end is not None]


class ForeignWatch:
    """A live writer's watch on its chain's head (a :class:`~kvgov.ledger.batch.HeadCheck`).

    Used on the writer's database thread only (its committer, checkpoints and close share
    it). ``known`` and a session resumed in a transaction are taken only once it committed
    (:meth:`settle`): a batch rolled back leaves them, and its retry checks (and seals) again."""

    #: errors of the watch's own writes that are not the events' (the transaction is retried)
    _TRANSIENT = (
        exc.OperationalError,
        exc.InterfaceError,
        exc.DisconnectionError,
        exc.TimeoutError,
    )

    def __init__(
        self,
        chain_id: str,
        key: Ed25519PrivateKey,
        stats: WriterStats,
        *,
        every_transaction: bool = False,
        lease_s: int | None = None,
    ) -> None:
        self.chain_id = chain_id
        self._key = key
        self._public = public_key_bytes(key)
        self.stats = stats
        self._every = every_transaction
        self._lease = lease_s
        self._known: Head = (0, GENESIS_HASH)
        #: this writer's sessions, the current one last (a resumed session is a new one)
        self._sessions: list[str] = []
        #: the session the last :meth:`check` resumed, until its transaction commits
        self._pending: str | None = None

    @property
    def known(self) -> Head:
        return self._known

    @property
    def every_transaction(self) -> bool:
        return self._every

    @property
    def lease_s(self) -> int | None:
        return self._lease

    @property
    def session(self) -> str | None:
        """The session the writer's rows go under: the one resumed in the current
        transaction, or the current one (None before :meth:`start`)."""
        if self._pending is not None:
            return self._pending
        return self._sessions[-1] if self._sessions else None

    def start(self, session: str, head: Head) -> None:
        """The writer opened ``session`` on ``head``."""
        self._sessions = [session]
        self._pending = None
        self._known = head

    def adopt(self, session: str) -> None:
        """The writer goes on under ``session`` (it resumed: ``seals.keep_open``)."""
        if session not in self._sessions:
            self._sessions.append(session)

    def check(self, conn: Connection, head: Head) -> Disclaimed:
        """Under the chain lock, before the writer writes or signs anything in this
        transaction: seal the rows after the known head that no other session explains, then
        keep the writer's own session covering the chain (when the head moved, or always with
        ``every_transaction``). A failure of these writes of its own is a
        :class:`~kvgov.errors.LedgerSealError` (the caller retries; never the events' fault)."""
        self._pending = None
        known = self._known
        if not self._sessions:
            return []
        moved = head[0] > known[0]
        if not moved and not self._every:
            return []  # nothing new: the head it left (or a re-chain after a refusal)
        try:
            runs = self._seal_foreign(conn, known, head) if moved else []
            current = self._sessions[-1]
            resumed = keep_open(conn, self.chain_id, self._key, current, head, lease_s=self._lease)
        except self._TRANSIENT:
            raise
        except Exception as err:
            # never the events': a committer reads anything but LedgerSealError from the
            # transaction as the database refusing them (a ValueError from a malformed head's
            # hash made it refuse every event for good: review r13, F2)
            raise LedgerSealError(
                f"the writer of chain {self.chain_id!r} could not write its own seal: "
                f"{type(err).__name__}"
            ) from err
        if resumed != current:
            self._pending = resumed
        return runs

    def _seal_foreign(self, conn: Connection, known: Head, head: Head) -> Disclaimed:
        runs = unexplained(
            read_seals(conn, self.chain_id, self._public, reader="foreign_watch"),
            self._public,
            set(self._sessions),
            known[0],
            head[0],
            now=utcnow(),
        )
        for first, last in runs:
            at = head if last == head[0] else (last, self._hash_at(conn, last))
            write_foreign_seal(
                conn,
                self.chain_id,
                self._key,
                session=self._sessions[-1],
                first=first,
                head=at,
                on_taken=self.key_taken,
            )
        return runs

    def settle(self, head: Head, disclaimed: Disclaimed) -> None:
        """The transaction that read ``head`` (and sealed ``disclaimed``) committed: every row
        up to ``head`` is accounted for, and a session it resumed is the writer's."""
        if head[0] >= self._known[0]:
            self._known = head
        pending, self._pending = self._pending, None
        if pending is not None:
            self.adopt(pending)
        for first, last in disclaimed:
            self.stats.foreign_appends += last - first + 1
            self.stats.foreign_seals += 1
            log.error(
                "ledger.chain.foreign_append",
                extra={"chain_id": self.chain_id, "first_seq": first, "last_seq": last},
            )

    def key_taken(self) -> None:
        self.stats.seal_keys_taken += 1

    def _hash_at(self, conn: Connection, seq: int) -> str:
        """The hash the seal signs for position ``seq``: its stored one, or a malformed one's
        :func:`~kvgov.ledger.chain.link_target` (as :func:`~kvgov.ledger.batch.read_head`)."""
        events = table(LedgerEvent)
        return link_target(
            str(
                conn.execute(
                    select(events.c.hash).where(
                        events.c.chain_id == self.chain_id, events.c.seq == seq
                    )
                ).scalar_one()
            )
        )

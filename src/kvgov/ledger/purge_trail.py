"""A purge's chained step events, read back for its receipt.

Each purge step that ran chains a ``purge:step`` event: ``attrs`` names the purge, the step and
its sidecar and carries the step detail's ``summary()``; ``reason`` is the state the step ended
in. Those are the facts ``kvgov audit verify`` proves untampered, unlike the mutable
``purge_steps`` rows the runtime database role may UPDATE, so the receipt is checked against
them (:mod:`kvgov.services.purge.trail`). The rows are read the way verification reads them, and
a row whose own hash does not cover its columns is ignored: it proves nothing. Nor does a row on
a chain no trusted key vouches for: the runtime role may INSERT into ``chains`` and
``ledger_events``, and the chain hash is unkeyed, so it could register a chain of its own and
chain a matching event on it (review 6, F1). An event counts only on a chain whose key is
trusted (the receipt signer's own, ``ledger.trusted_keys``), whose genesis that key signed, at a
position a writer session of that key covered (:mod:`kvgov.ledger.seals`) and no foreign seal
names (appended to its chain by someone else, found at the writer's next batch, checkpoint or
close), and at or below a head signed *while that session held the chain* (:class:`_Signed`):
a checkpoint signed before the session ended, or the session's own close or foreign seal,
whose head is the chain's row at that position.

That last condition is review r13, F1. A writer killed without a close (a pod lost and
rescheduled under a new name starts a new chain; nothing reopens the old one) leaves a session
that covers every later position for ever; the runtime role chained matching events on such a
dead chain and the receipt took them. Now they sit above the dead writer's last signature and
count for nothing. The exclusive open of a writer restarted on the same chain signs over the
crashed session's tail (``audit verify`` accepts that) but is no word that the tail is the
crashed writer's, so neither it nor anything signed after it counts for that tail. Each step's
executor has its own writer sign its chain's head right after chaining the step's event, before
the step is marked finished (:meth:`kvgov.services.purge.service.PurgeService.run_one`), so an
honest event is signed by the time any receipt is built. Linking an event to the signed head
above it stays ``audit verify``'s job (the runtime role cannot change or fill a position below
a head once written).

Every row is decoded before it is checked, so the rows' JSON is read through
:mod:`kvgov.boundedjson`: a row whose ``attrs`` the runtime role nested thousands deep reads
as a marker that names no purge and matches no hash, never as a ``RecursionError`` that killed
the executor building the receipt (review r14, F1).

A purge's ``purge:evict:late`` events (an EVICT an ``engines@S`` step could not deliver, sent
once the engine's control channel was back: :mod:`kvgov.proxy.purge.late`) are read the same
way, for the job's document (:func:`late_evictions`) and, many jobs at once, for the purge list
and the dashboard (:func:`late_evictions_of`): only rows that prove themselves count (the
sidecar signs its head right after recording one). So are its ``kv:delete`` events
(:func:`purged_digests`): the key digests of the entries the purge deleted, from which a
restarted sidecar rebuilds the EVICTs it still owes engines.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Row, Select, select
from sqlalchemy.orm import Session

from kvgov.boundedjson import is_undecodable
from kvgov.db.models import Chain, LedgerEvent, table
from kvgov.db.purge_index import is_purge_step, purge_id_of
from kvgov.errors import SealScanCappedError
from kvgov.ledger.chain import link
from kvgov.ledger.checkpoint_scan import verified_checkpoints
from kvgov.ledger.seals import Span, Standing, read_standing
from kvgov.ledger.verify import row_fields
from kvgov.types import EventKind

#: a step of one job: its name and its sidecar (None: a global step)
StepKey = tuple[str, str | None]


@dataclass(frozen=True, slots=True)
class ChainedStep:
    """What the chain says one step did (its latest attempt's event)."""

    step: str
    sidecar_id: str | None
    #: the state the step ended in (the event's ``reason``)
    state: str | None
    summary: Mapping[str, Any] | None
    attempt: int
    chain_id: str
    seq: int
    #: when the step's executor chained it (after the step ran)
    occurred_at: datetime | None = None


class _Signed:
    """Which positions of one vouched chain a key holder signed over while the writer session
    holding them was live (see the module docstring): the highest such head of each session's
    span, found once per span (checkpoints checked highest first: the first valid one is it)."""

    def __init__(
        self,
        conn: Connection,
        chain_id: str,
        key: bytes,
        standing: Standing,
        reader: str = "purge_trail",
    ) -> None:
        self._conn = conn
        self._chain_id = chain_id
        self._key = key
        self.standing = standing
        self._reader = reader
        #: the highest head signed within each span (0: none)
        self._reach: dict[Span, int] = {}
        self._hashes: dict[int, str | None] = {}

    def proves(self, seq: int) -> bool:
        """Position ``seq`` is covered, no foreign seal names it, and a head at or above it
        was signed while a session holding it was live."""
        if not self.standing.covers(seq):
            return False  # written while none held it, or disclaimed by its live writer
        return any(seq <= self._reach_of(span) for span in self.standing.spans_at(seq))

    def _reach_of(self, span: Span) -> int:
        if span not in self._reach:
            self._reach[span] = max(self._own_head(span), self._checkpointed(span))
        return self._reach[span]

    def _own_head(self, span: Span) -> int:
        """The highest head the span's session signed (its close, a foreign seal) that is the
        chain's row there."""
        for seal in self.standing.own_heads(span):
            if self._hash_at(seal.seq) == seal.head_hash:
                return seal.seq
        return 0

    def _checkpointed(self, span: Span) -> int:
        """The highest valid checkpoint signed within ``span`` (:meth:`Span.signed_within`) at
        a position no foreign seal names, that is the chain's row there (0: none, or the
        lookup stopped at its cap: :func:`~kvgov.ledger.checkpoint_scan.verified_checkpoints`,
        which reads no row past the chain's head and checks no signature of a row naming
        another head than the chain's)."""

        def eligible(seq: int, signed_at: datetime) -> bool:
            return span.signed_within(seq, signed_at) and self.standing.foreign_at(seq) is None

        found = verified_checkpoints(
            self._conn,
            self._chain_id,
            self._key,
            reader=self._reader,
            above=span.start,
            upto=span.end,
            accept=eligible,
        )
        return next((cp.seq for cp in found), 0)

    def _hash_at(self, seq: int) -> str | None:
        if seq not in self._hashes:
            events = table(LedgerEvent)
            found = self._conn.execute(
                select(events.c.hash).where(
                    events.c.chain_id == self._chain_id, events.c.seq == seq
                )
            ).scalar()
            self._hashes[seq] = None if found is None else str(found)
        return self._hashes[seq]


def _vouched(
    conn: Connection, chain_id: str, trusted: Collection[bytes], reader: str = "purge_trail"
) -> _Signed | None:
    """What ``chain_id``'s seals prove, when a trusted key holds it and signed its genesis.
    None too when its seals hold more junk than one read examines
    (:mod:`kvgov.ledger.seals.scan`, logged and counted there): the chain proves nothing
    until they are removed (fail closed: the receipt says ``incomplete``). ``reader``: who is
    asking, for the log line of a capped read."""
    key = conn.execute(select(Chain.public_key).where(Chain.chain_id == chain_id)).scalar()
    if key is None or bytes(key) not in trusted:
        return None
    try:
        standing = read_standing(conn, chain_id, bytes(key), reader=reader)
    except SealScanCappedError:
        return None
    return _Signed(conn, chain_id, bytes(key), standing, reader) if standing.vouched else None


def proves_event(row: Row[Any], trusted: Collection[bytes], conn: Connection, reader: str) -> bool:
    """Whether the ledger vouches for one ``ledger_events`` row (a Core row, every column), as
    :func:`_proven` weighs each row of a purge: its own hash covers its columns, on a chain a
    ``trusted`` key holds and whose genesis that key signed, at a position a writer session
    of that key covered, no foreign seal names, and a head signed while that session was live
    lies at or above (see the module docstring). For other readers of single events
    (:mod:`kvgov.ledger.token_trail`); ``reader`` names them in a capped read's log line."""
    if is_undecodable(row.attrs) or link(row_fields(row)) != row.hash:
        return False
    signed = _vouched(conn, row.chain_id, trusted, reader)
    return signed is not None and signed.proves(row.seq)


@dataclass(frozen=True, slots=True)
class ChainedLateEviction:
    """What the chain says a late EVICT did: the engine that acknowledged it, how many digests
    it was sent and how many entries it removed, and when the sidecar recorded it."""

    engine: str
    digests: int
    removed: int
    recorded_at: datetime
    chain_id: str
    seq: int


def steps_query(purge_id: str, tenant: str) -> Select[Any]:
    """The ``purge:step`` events of purge ``purge_id`` in ``tenant``, oldest first: found
    through ``ix_ledger_events_purge_id`` (:mod:`kvgov.db.purge_index`), whose expression and
    predicate it names exactly. What the database compares is only a selection; the exact
    checks are :func:`chained_steps`'s, on the parsed row."""
    t = table(LedgerEvent)
    return (
        select(t)
        .where(
            purge_id_of(t.c.attrs) == purge_id,
            is_purge_step(t.c.kind),
            t.c.tenant == tenant,
        )
        .order_by(t.c.occurred_at, t.c.chain_id, t.c.seq)
    )


def late_query(jobs: Collection[tuple[str, str]]) -> Select[Any]:
    """The ``purge:evict:late`` events of the purges ``jobs`` (``(purge id, tenant)``), oldest
    first: found through ``ix_ledger_events_tenant_kind`` (a job has a few at most; a tenant
    has one per engine per purge that missed it), the job ids compared on the remaining rows.
    A selection only: :func:`late_evictions_of` keeps a row for its own job's tenant alone."""
    t = table(LedgerEvent)
    return (
        select(t)
        .where(
            t.c.tenant.in_(sorted({tenant for _, tenant in jobs})),
            t.c.kind == EventKind.PURGE_EVICT_LATE.value,
            purge_id_of(t.c.attrs).in_(sorted({job for job, _ in jobs})),
        )
        .order_by(t.c.occurred_at, t.c.chain_id, t.c.seq)
    )


def deletes_query(purge_id: str, tenant: str) -> Select[Any]:
    """The ``kv:delete`` events of purge ``purge_id`` in ``tenant`` (one per entry its tier
    steps deleted): found through ``ix_ledger_events_tenant_kind``, the job id compared on the
    remaining rows (and again, parsed, by :func:`_proven`)."""
    t = table(LedgerEvent)
    return (
        select(t)
        .where(
            t.c.tenant == tenant,
            t.c.kind == EventKind.KV_DELETE.value,
            purge_id_of(t.c.attrs) == purge_id,
        )
        .order_by(t.c.chain_id, t.c.seq)
    )


def _proven(
    session: Session,
    query: Select[Any],
    wanted: Callable[[Any, Mapping[str, Any]], bool],
    trusted: Collection[bytes],
) -> Iterator[tuple[Any, Mapping[str, Any]]]:
    """The rows of ``query`` that are ``wanted`` (by the row and its parsed ``attrs``: the
    purge they name), whose own hash covers their columns, on a chain a ``trusted`` key
    vouches for, at a position a writer session of that key covered and signed over while it
    was live (see the module docstring); with their ``attrs``."""
    conn = session.connection()
    chains: dict[str, _Signed | None] = {}
    for row in session.execute(query).all():
        if is_undecodable(row.attrs):
            continue  # past the JSON bounds (review r14, F1): no writer wrote it
        attrs = row.attrs if isinstance(row.attrs, Mapping) else {}
        if not wanted(row, attrs) or link(row_fields(row)) != row.hash:
            continue
        if row.chain_id not in chains:
            chains[row.chain_id] = _vouched(conn, row.chain_id, trusted)
        signed = chains[row.chain_id]
        if signed is None or not signed.proves(row.seq):
            # a chain no trusted key vouches for, written while none held it, or above every
            # head its session signed (a dead writer's chain: review r13, F1)
            continue
        yield row, attrs


def _of_purge(purge_id: str) -> Callable[[Any, Mapping[str, Any]], bool]:
    """:func:`_proven`'s ``wanted`` for the events of one purge (by their parsed ``attrs``)."""

    def wanted(_row: Any, attrs: Mapping[str, Any]) -> bool:
        return attrs.get("purge_id") == purge_id

    return wanted


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def late_evictions(
    session: Session, purge_id: str, tenant: str, trusted: Collection[bytes]
) -> list[ChainedLateEviction]:
    """The chained late EVICTs of purge ``purge_id``, oldest first, on chains ``trusted`` keys
    vouch for. Each is one engine's acknowledgement; the receipt is not changed by them."""
    return late_evictions_of(session, [(purge_id, tenant)], trusted).get(purge_id, [])


def late_evictions_of(
    session: Session, jobs: Collection[tuple[str, str]], trusted: Collection[bytes]
) -> dict[str, list[ChainedLateEviction]]:
    """:func:`late_evictions` of each of ``jobs`` (``(purge id, tenant)``), in one query: by
    purge id, oldest first; a job with none is absent. An event counts for a job only in the
    job's own tenant (another tenant's events never match)."""
    pairs = set(jobs)
    if not pairs:
        return {}

    def wanted(row: Any, attrs: Mapping[str, Any]) -> bool:
        return (attrs.get("purge_id"), row.tenant) in pairs

    found: dict[str, list[ChainedLateEviction]] = {}
    for row, attrs in _proven(session, late_query(pairs), wanted, trusted):
        engine = attrs.get("engine")
        found.setdefault(str(attrs["purge_id"]), []).append(
            ChainedLateEviction(
                engine=engine if isinstance(engine, str) else "?",
                digests=_count(attrs.get("digests")),
                removed=_count(attrs.get("removed")),
                recorded_at=row.occurred_at,
                chain_id=row.chain_id,
                seq=row.seq,
            )
        )
    return found


def purged_digests(
    session: Session, purge_id: str, tenant: str, trusted: Collection[bytes]
) -> list[str]:
    """The key digests of the entries purge ``purge_id`` deleted (its chained ``kv:delete``
    events, on chains ``trusted`` keys vouch for), sorted, each once. What a row the runtime
    role wrote (``cache_entries``, ``purge_steps``) says is not read: a restarted sidecar owes
    engines these digests and no others."""

    found: set[str] = set()
    for row, _ in _proven(session, deletes_query(purge_id, tenant), _of_purge(purge_id), trusted):
        if isinstance(row.key_digest, str) and row.key_digest:
            found.add(row.key_digest)
    return sorted(found)


def chained_steps(
    session: Session, purge_id: str, tenant: str, trusted: Collection[bytes]
) -> dict[StepKey, ChainedStep]:
    """The latest chained ``purge:step`` event of each step of purge ``purge_id``, on chains
    ``trusted`` keys vouch for (see the module docstring).

    A step retried after its event was chained (its row could not be written) has several;
    the row holds the last attempt's detail, so the last attempt's event is the one to match.
    """

    found: dict[StepKey, ChainedStep] = {}
    for row, attrs in _proven(session, steps_query(purge_id, tenant), _of_purge(purge_id), trusted):
        sidecar = attrs.get("sidecar_id")
        attempt = attrs.get("attempt")
        summary = attrs.get("summary")
        event = ChainedStep(
            step=str(attrs.get("step")),
            sidecar_id=sidecar if isinstance(sidecar, str) else None,
            state=row.reason,
            summary=summary if isinstance(summary, Mapping) else None,
            attempt=attempt if isinstance(attempt, int) else 0,
            chain_id=row.chain_id,
            seq=row.seq,
            occurred_at=row.occurred_at,
        )
        key = (event.step, event.sidecar_id)
        earlier = found.get(key)
        if earlier is None or event.attempt >= earlier.attempt:
            found[key] = event
    return found

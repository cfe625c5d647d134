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
trusted (the receipt signer's own, ``ledger.trusted_keys``), whose genesis that key signed, and
at a position a writer session of that key covered (:mod:`kvgov.ledger.seals`): not one its
live writer named in a foreign seal (appended to its chain by someone else, found at the
writer's next batch, checkpoint or close). Linking to the rest of the chain, and events
appended after a live writer's latest head-reading transaction, stay ``audit verify``'s job.

A purge's ``purge:evict:late`` events (an EVICT an ``engines@S`` step could not deliver, sent
once the engine's control channel was back: :mod:`kvgov.proxy.purge.late`) are read the same
way, for the job's document (:func:`late_evictions`) and, many jobs at once, for the purge list
and the dashboard (:func:`late_evictions_of`): only rows that prove themselves count.
So are its ``kv:delete`` events (:func:`purged_digests`): the key digests of the entries the
purge deleted, from which a restarted sidecar rebuilds the EVICTs it still owes engines.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Select, select
from sqlalchemy.orm import Session

from kvgov.db.models import Chain, LedgerEvent, table
from kvgov.db.purge_index import is_purge_step, purge_id_of
from kvgov.ledger.chain import link
from kvgov.ledger.seals import Standing, read_standing
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


def _vouched(conn: Connection, chain_id: str, trusted: Collection[bytes]) -> Standing | None:
    """The standing of ``chain_id`` when a trusted key holds it and signed its genesis."""
    key = conn.execute(select(Chain.public_key).where(Chain.chain_id == chain_id)).scalar()
    if key is None or bytes(key) not in trusted:
        return None
    standing = read_standing(conn, chain_id, bytes(key))
    return standing if standing.vouched else None


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
    vouches for, at a position a writer session of that key covered (see the module
    docstring); with their ``attrs``."""
    conn = session.connection()
    chains: dict[str, Standing | None] = {}
    for row in session.execute(query):
        attrs = row.attrs if isinstance(row.attrs, Mapping) else {}
        if not wanted(row, attrs) or link(row_fields(row)) != row.hash:
            continue
        if row.chain_id not in chains:
            chains[row.chain_id] = _vouched(conn, row.chain_id, trusted)
        standing = chains[row.chain_id]
        if standing is None or not standing.covers(row.seq):
            continue  # a chain no trusted key vouches for, or written while none held it
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

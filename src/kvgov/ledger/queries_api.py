"""Read queries behind the compliance REST API and the dashboard.

Each function takes a :class:`~sqlalchemy.orm.Session` and returns ORM rows or small frozen
records; none of them writes or commits. Lists use keyset pagination: the caller passes the
sort key of the last row it has (``after``) and asks for ``limit + 1`` rows to learn whether a
next page exists. Filters are explicit keyword arguments; a ``None`` filter is not applied.
Purge jobs and data keys have their queries in :mod:`kvgov.db.queries_admin`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, get_args

from sqlalchemy import String, and_, case, cast, func, select, tuple_
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import ColumnElement

from kvgov.config import TierName
from kvgov.db.models import (
    CacheEntry,
    Checkpoint,
    LedgerEvent,
    PolicyDecision,
    Request,
    Tenant,
)
from kvgov.ledger.repository import user_entries
from kvgov.types import EntryState, EventKind, Sensitivity

#: tier names the stats break bytes down by
KNOWN_TIERS: tuple[str, ...] = get_args(TierName)


def _json_list_contains(column: Any, value: str) -> ColumnElement[bool]:
    """``value`` is an element of the JSON string list in ``column`` (portable: text match on
    the JSON encoding, with LIKE wildcards escaped)."""
    needle = json.dumps(value).replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return cast(column, String).like(f"%{needle}%", escape="\\")


# -- entries ----------------------------------------------------------------------------------


def list_entries(
    session: Session,
    *,
    tenant: str | None = None,
    user: str | None = None,
    sensitivity: Sensitivity | None = None,
    tier: str | None = None,
    state: EntryState | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    after: tuple[datetime, str] | None = None,
    limit: int = 50,
) -> list[CacheEntry]:
    """Cache entries, newest first. ``user`` is a pseudonym: entries that hold its data
    (:func:`kvgov.ledger.repository.user_entries`)."""
    query = select(CacheEntry)
    if user is not None:  # the tenant is part of the user's definition (the footprint's too)
        query = query.where(user_entries(user, tenant))
    elif tenant is not None:
        query = query.where(CacheEntry.tenant == tenant)
    if sensitivity is not None:
        query = query.where(CacheEntry.sensitivity == sensitivity)
    if tier is not None:
        query = query.where(_json_list_contains(CacheEntry.tiers, tier))
    if state is not None:
        query = query.where(CacheEntry.state == state)
    if since is not None:
        query = query.where(CacheEntry.created_at >= since)
    if until is not None:
        query = query.where(CacheEntry.created_at < until)
    if after is not None:
        query = query.where(tuple_(CacheEntry.created_at, CacheEntry.key_digest) < after)
    query = query.order_by(CacheEntry.created_at.desc(), CacheEntry.key_digest.desc())
    return list(session.scalars(query.limit(limit)))


# -- provenance -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ProvenanceRow:
    """One cached chunk served to a request, and where that chunk came from."""

    chain_id: str
    seq: int
    served_at: datetime
    key_digest: str | None
    tier: str | None
    nbytes: int | None
    entry: CacheEntry | None


def get_request(session: Session, request_id: str, tenant: str | None) -> Request | None:
    return session.get(Request, (request_id, tenant or ""))


def request_tenants(session: Session, request_id: str) -> list[str | None]:
    """The tenants that used ``request_id`` (None: requests that carried no tenant), sorted.
    Request ids come from engines: two tenants may use the same one."""
    found = set(
        session.scalars(select(Request.tenant).where(Request.request_id == request_id)).all()
    )
    if not found:  # events whose index row was never written (or a ledger before 0004)
        events = select(LedgerEvent.tenant).where(LedgerEvent.request_id == request_id)
        found = {t or "" for t in session.scalars(events.distinct()).all()}
    return [t or None for t in sorted(found)]


def provenance(session: Session, request_id: str, tenant: str | None) -> list[ProvenanceRow]:
    """The chunks that fed ``request_id`` of ``tenant`` (``kv:get`` hits), in the order they
    were served. Another tenant's request with the same id is another request."""
    same_tenant = LedgerEvent.tenant.is_(None) if not tenant else LedgerEvent.tenant == tenant
    query = (
        select(LedgerEvent, CacheEntry)
        .outerjoin(CacheEntry, CacheEntry.key_digest == LedgerEvent.key_digest)
        .where(
            LedgerEvent.request_id == request_id,
            LedgerEvent.kind == EventKind.KV_GET.value,
            same_tenant,
        )
        .order_by(LedgerEvent.occurred_at, LedgerEvent.chain_id, LedgerEvent.seq)
    )
    return [
        ProvenanceRow(
            chain_id=event.chain_id,
            seq=event.seq,
            served_at=event.occurred_at,
            key_digest=event.key_digest,
            tier=event.tier,
            nbytes=event.nbytes,
            entry=entry,
        )
        for event, entry in session.execute(query)
    ]


# -- footprint --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Footprint:
    """What the ledger holds about one user pseudonym in one tenant."""

    entries_by_state: dict[str, int]
    live_bytes_by_tier: dict[str, int]
    live_until: datetime | None
    requests_served: int


def footprint_summary(session: Session, tenant: str, user: str) -> Footprint:
    mine = user_entries(user, tenant)
    by_state = {
        str(state): int(count)
        for state, count in session.execute(
            select(CacheEntry.state, func.count()).where(mine).group_by(CacheEntry.state)
        )
    }
    live = and_(mine, CacheEntry.state == EntryState.LIVE)
    sums = [
        func.coalesce(
            func.sum(case((_json_list_contains(CacheEntry.tiers, t), CacheEntry.size), else_=0)),
            0,
        )
        for t in KNOWN_TIERS
    ]
    row = session.execute(select(func.max(CacheEntry.expires_at), *sums).where(live)).one()
    digests = select(CacheEntry.key_digest).where(mine).scalar_subquery()
    served = session.scalar(
        select(func.count(func.distinct(LedgerEvent.request_id))).where(
            LedgerEvent.kind == EventKind.KV_GET.value,
            LedgerEvent.key_digest.in_(digests),
            LedgerEvent.request_id.is_not(None),
        )
    )
    return Footprint(
        entries_by_state=by_state,
        live_bytes_by_tier={t: int(v) for t, v in zip(KNOWN_TIERS, row[1:], strict=True) if v},
        live_until=row[0],
        requests_served=int(served or 0),
    )


# -- policy decisions -------------------------------------------------------------------------


def list_decisions(
    session: Session,
    *,
    tenant: str | None = None,
    allowed: bool | None = None,
    reason: str | None = None,
    operation: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    after: tuple[datetime, str] | None = None,
    limit: int = 50,
) -> list[PolicyDecision]:
    query = select(PolicyDecision)
    if tenant is not None:
        query = query.where(PolicyDecision.tenant == tenant)
    if allowed is not None:
        query = query.where(PolicyDecision.allowed.is_(allowed))
    if reason is not None:
        query = query.where(_json_list_contains(PolicyDecision.reasons, reason))
    if operation is not None:
        query = query.where(PolicyDecision.operation == operation)
    if since is not None:
        query = query.where(PolicyDecision.first_seen_at >= since)
    if until is not None:
        query = query.where(PolicyDecision.first_seen_at < until)
    if after is not None:
        query = query.where(
            tuple_(PolicyDecision.first_seen_at, PolicyDecision.decision_id) < after
        )
    query = query.order_by(PolicyDecision.first_seen_at.desc(), PolicyDecision.decision_id.desc())
    return list(session.scalars(query.limit(limit)))


def recent_denials(
    session: Session, *, tenant: str | None = None, limit: int = 20
) -> list[LedgerEvent]:
    """The latest ``kv:entry:denied`` events (newest first)."""
    query = select(LedgerEvent).where(LedgerEvent.kind == EventKind.KV_DENIED.value)
    if tenant is not None:
        query = query.where(LedgerEvent.tenant == tenant)
    query = query.order_by(LedgerEvent.occurred_at.desc(), LedgerEvent.seq.desc())
    return list(session.scalars(query.limit(limit)))


# -- checkpoints ------------------------------------------------------------------------------


def list_checkpoints(
    session: Session,
    *,
    chain_id: str | None = None,
    after: tuple[datetime, str, int, str] | None = None,
    limit: int = 50,
) -> list[Checkpoint]:
    """Checkpoint rows, newest first, after the key ``after`` (``(signed_at, chain_id, seq,
    nonce)``: the nonce tells apart rows equal on the rest, which 0013's key allows)."""
    query = select(Checkpoint)
    if chain_id is not None:
        query = query.where(Checkpoint.chain_id == chain_id)
    if after is not None:
        query = query.where(
            tuple_(Checkpoint.signed_at, Checkpoint.chain_id, Checkpoint.seq, Checkpoint.nonce)
            < after
        )
    query = query.order_by(
        Checkpoint.signed_at.desc(),
        Checkpoint.chain_id.desc(),
        Checkpoint.seq.desc(),
        Checkpoint.nonce.desc(),
    )
    return list(session.scalars(query.limit(limit)))


# -- per-tenant stats -------------------------------------------------------------------------


@dataclass
class TenantStats:
    tenant: str
    entries_by_state: dict[str, int] = field(default_factory=dict)
    live_bytes_by_tier: dict[str, int] = field(default_factory=dict)
    hits: int = 0
    misses: int = 0
    denials: int = 0
    puts: int = 0

    @property
    def live_entries(self) -> int:
        return self.entries_by_state.get(EntryState.LIVE.value, 0)

    @property
    def hit_rate(self) -> float | None:
        lookups = self.hits + self.misses
        return None if lookups == 0 else self.hits / lookups


_COUNTED = {
    EventKind.KV_GET.value: "hits",
    EventKind.KV_MISS.value: "misses",
    EventKind.KV_DENIED.value: "denials",
    EventKind.KV_PUT.value: "puts",
}


def tenant_stats(
    session: Session, *, tenants: Iterable[str] | None = None, since: datetime | None = None
) -> list[TenantStats]:
    """Stats per tenant (every tenant the ledger knows of, or just ``tenants``), by name.

    Entry counts and bytes describe the index now; hits, misses, denials and puts count ledger
    events (since ``since`` when given).
    """
    only = None if tenants is None else sorted(set(tenants))
    stats: dict[str, TenantStats] = {}

    def get(tenant: str) -> TenantStats:
        if tenant not in stats:
            stats[tenant] = TenantStats(tenant=tenant)
        return stats[tenant]

    for name in only if only is not None else session.scalars(select(Tenant.id)):
        get(name)

    states = select(CacheEntry.tenant, CacheEntry.state, func.count()).where(
        CacheEntry.tenant.is_not(None)
    )
    if only is not None:
        states = states.where(CacheEntry.tenant.in_(only))
    for tenant, state, count in session.execute(
        states.group_by(CacheEntry.tenant, CacheEntry.state)
    ):
        if tenant is not None:
            get(tenant).entries_by_state[str(state)] = int(count)

    sums = [
        func.coalesce(
            func.sum(case((_json_list_contains(CacheEntry.tiers, t), CacheEntry.size), else_=0)),
            0,
        )
        for t in KNOWN_TIERS
    ]
    tiers = select(CacheEntry.tenant, *sums).where(
        CacheEntry.tenant.is_not(None), CacheEntry.state == EntryState.LIVE
    )
    if only is not None:
        tiers = tiers.where(CacheEntry.tenant.in_(only))
    for row in session.execute(tiers.group_by(CacheEntry.tenant)):
        if row[0] is not None:
            get(row[0]).live_bytes_by_tier = {
                t: int(v) for t, v in zip(KNOWN_TIERS, row[1:], strict=True) if v
            }

    events = select(LedgerEvent.tenant, LedgerEvent.kind, func.count()).where(
        LedgerEvent.tenant.is_not(None), LedgerEvent.kind.in_(list(_COUNTED))
    )
    if only is not None:
        events = events.where(LedgerEvent.tenant.in_(only))
    if since is not None:
        events = events.where(LedgerEvent.occurred_at >= since)
    for tenant, kind, count in session.execute(
        events.group_by(LedgerEvent.tenant, LedgerEvent.kind)
    ):
        if tenant is not None:
            setattr(get(tenant), _COUNTED[kind], int(count))

    return [stats[t] for t in sorted(stats)]

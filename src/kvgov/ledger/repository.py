"""Read queries over the ledger that the proxy, the API and the purge need.

A ``LedgerRepository`` works inside the caller's :class:`~sqlalchemy.orm.Session` and never
commits: the edge (request handler, CLI command, purge step) owns the transaction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import (
    ColumnElement,
    CompoundSelect,
    Select,
    func,
    or_,
    select,
    tuple_,
    union,
    update,
)
from sqlalchemy.orm import Session, aliased

from kvgov.db.engine import utcnow
from kvgov.db.models import (
    CacheEntry,
    Checkpoint,
    EventPayload,
    LedgerEvent,
    PolicyDecision,
)
from kvgov.types import EntryState, EventKind

#: the chained events that say an actor put a key: a first put, and a re-put of a key that was
#: live or being stored (``kv:put:kept``: acknowledged, the stored bytes kept)
PUT_KINDS: tuple[str, ...] = (EventKind.KV_PUT.value, EventKind.KV_PUT_KEPT.value)


def put_digests(tenant: str | None, actor: str | None = None) -> Select[str | None]:
    """The key digests that chained put events (:data:`PUT_KINDS`) of ``tenant`` (by
    ``actor``, when given) name. The chained rows are append-only for the runtime database
    role, unlike ``cache_entries``: scope that stands on them cannot be edited away."""
    query = select(LedgerEvent.key_digest).where(
        LedgerEvent.kind.in_(PUT_KINDS), LedgerEvent.key_digest.is_not(None)
    )
    if actor is not None:
        query = query.where(LedgerEvent.actor == actor)
    if tenant is not None:
        query = query.where(LedgerEvent.tenant == tenant)
    return query


def user_entries(user: str, tenant: str | None = None) -> ColumnElement[bool]:
    """Entries that hold a user's data: owned by them, scoped to them, or put by them.

    A re-put of a live entry keeps its first owner (and is recorded ``kv:put:kept``), so
    ownership alone would miss what the user put later: every key the user ever put (in the
    tenant) counts too. That branch stands on the chained events alone, not on the row's
    ``tenant``: the runtime role may update ``cache_entries``, and a row moved to another
    tenant (or re-keyed) must not leave the user's purge. The one definition used by purge
    scope, the footprint and the entry filters, so they never disagree.
    """
    # one IN over a UNION (not an OR of three): Postgres plans it as a semi-join through the
    # owner, scope user and actor indexes and the primary key, not a scan of cache_entries
    return CacheEntry.key_digest.in_(user_digests(user, tenant))


def user_digests(user: str, tenant: str | None = None) -> CompoundSelect[str | None]:
    """The key digests of :func:`user_entries`, rows or not: those of the rows the user owns
    or is scoped to, and every digest a chained put by the user names (a digest whose row is
    gone or was never written included). What a query of chained events about the user's
    entries selects on (:func:`kvgov.services.purge.scope.engines_that_held`)."""
    row = aliased(CacheEntry)  # not correlated with the caller's CacheEntry
    held = select(row.key_digest).where(or_(row.owner == user, row.scope_user == user))
    if tenant is not None:
        held = held.where(row.tenant == tenant)
    return union(held, put_digests(tenant, user))


def tenant_entries(tenant: str) -> ColumnElement[bool]:
    """Entries of a tenant: its rows, and every key a chained put of the tenant names (a row
    moved to another tenant stays in the tenant's purge). A tenant is a large share of the
    table: one scan with the puts' digests hashed beats an index walk here (EXPLAIN)."""
    return or_(CacheEntry.tenant == tenant, CacheEntry.key_digest.in_(put_digests(tenant)))


@dataclass(frozen=True, slots=True)
class ChainHead:
    chain_id: str
    seq: int
    hash: str
    #: the newest signed checkpoint of the chain, if any
    checkpoint_seq: int | None


class LedgerRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

    def entries(
        self,
        *,
        tenant: str | None = None,
        owner: str | None = None,
        scope_user: str | None = None,
        user: str | None = None,
        states: Sequence[EntryState] | None = None,
        limit: int | None = None,
    ) -> list[CacheEntry]:
        """Cache entries matching every filter given. ``user`` matches :func:`user_entries`
        (what a purge of that user in ``tenant`` must erase, whatever tenant its row names)."""
        query = select(CacheEntry)
        if user is not None:  # the tenant is part of the user's definition
            query = query.where(user_entries(user, tenant))
        elif tenant is not None:
            query = query.where(CacheEntry.tenant == tenant)
        if owner is not None:
            query = query.where(CacheEntry.owner == owner)
        if scope_user is not None:
            query = query.where(CacheEntry.scope_user == scope_user)
        if states is not None:
            query = query.where(CacheEntry.state.in_(list(states)))
        query = query.order_by(CacheEntry.created_at, CacheEntry.key_digest)
        if limit is not None:
            query = query.limit(limit)
        return list(self.session.scalars(query))

    def entry(self, key_digest: str) -> CacheEntry | None:
        return self.session.get(CacheEntry, key_digest)

    def events_for_request(self, request_id: str) -> list[LedgerEvent]:
        """Every event of one request, in the order it happened."""
        query = (
            select(LedgerEvent)
            .where(LedgerEvent.request_id == request_id)
            .order_by(LedgerEvent.occurred_at, LedgerEvent.chain_id, LedgerEvent.seq)
        )
        return list(self.session.scalars(query))

    def events_for_key(self, key_digest: str) -> list[LedgerEvent]:
        query = (
            select(LedgerEvent)
            .where(LedgerEvent.key_digest == key_digest)
            .order_by(LedgerEvent.occurred_at, LedgerEvent.chain_id, LedgerEvent.seq)
        )
        return list(self.session.scalars(query))

    def chain_heads(self) -> list[ChainHead]:
        """The newest event and checkpoint of every chain."""
        last = (
            select(LedgerEvent.chain_id, func.max(LedgerEvent.seq).label("seq"))
            .group_by(LedgerEvent.chain_id)
            .subquery()
        )
        cps = (
            select(Checkpoint.chain_id, func.max(Checkpoint.seq).label("cp"))
            .group_by(Checkpoint.chain_id)
            .subquery()
        )
        query = (
            select(LedgerEvent.chain_id, LedgerEvent.seq, LedgerEvent.hash, cps.c.cp)
            .join(
                last,
                (last.c.chain_id == LedgerEvent.chain_id) & (last.c.seq == LedgerEvent.seq),
            )
            .outerjoin(cps, cps.c.chain_id == LedgerEvent.chain_id)
            .order_by(LedgerEvent.chain_id)
        )
        return [ChainHead(c, s, h, cp) for c, s, h, cp in self.session.execute(query)]

    def decision(self, decision_id: str) -> PolicyDecision | None:
        return self.session.get(PolicyDecision, decision_id)

    def erase_payloads(
        self, *, tenant: str, actor: str | None = None, key_digests: Sequence[str] = ()
    ) -> int:
        """Erase the payloads of a tenant's events (of one actor, or of some cache keys, when
        given): the payload and its salt are dropped, the chained row is untouched, so the
        chain still verifies and the digest can no longer confirm a guess. Returns the count.
        The caller records a ``ledger:payload:erased`` event and commits."""
        events = select(LedgerEvent.chain_id, LedgerEvent.seq).where(
            LedgerEvent.tenant == tenant, LedgerEvent.payload_digest.is_not(None)
        )
        if actor is not None:
            events = events.where(LedgerEvent.actor == actor)
        if key_digests:
            events = events.where(LedgerEvent.key_digest.in_(list(key_digests)))
        stmt = (
            update(EventPayload)
            .where(
                tuple_(EventPayload.chain_id, EventPayload.seq).in_(events),
                EventPayload.erased_at.is_(None),
            )
            .values(payload=None, salt=None, erased_at=utcnow())
            .execution_options(synchronize_session=False)
        )
        result = self.session.execute(stmt)
        return int(getattr(result, "rowcount", 0) or 0)

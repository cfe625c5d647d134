"""Retention: TTL expiry and tenant retention through the purge's deletion path.

:func:`apply_retention` finds, in the ledger's cache-entry index, every live entry whose TTL
has passed (``expires_at``) and every live entry older than its tenant's
``tenants.retention_s`` (set with ``kvgov tenant retention`` or ``PUT
/v1/tenants/{tenant}/retention``), deletes them from the given tiers with
:func:`~kvgov.services.purge.deletion.delete_entries` (verified absent) and records ``kv:expired``
events (``reason`` ``ttl`` or ``retention``) that mark them ``expired``. It is idempotent and
bounded per call (``limit``).

The sidecar's sweeper (``Sidecar.sweep``, every ``tiers.sweep_interval_s``) runs
:func:`apply_retention` over the entries this sidecar's chain created (another sidecar's
entries live in its own tiers: it expires them itself), adding what the sidecar's own index
and tiers know has expired (a memory-tier entry), and drops them from the in-memory index
before the tiers are touched, as a purge does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import and_, select
from sqlalchemy.orm import Session, sessionmaker

from kvgov.db.models import CacheEntry, Tenant
from kvgov.ledger.events import EventSink
from kvgov.services.purge.deletion import delete_entries
from kvgov.services.purge.ports import LocalIndex, TierSet
from kvgov.services.purge.scope import ScopedEntry
from kvgov.types import EntryState, EventKind


@dataclass(slots=True)
class RetentionReport:
    ttl_expired: int = 0
    retention_expired: int = 0
    deleted: dict[str, int] = field(default_factory=dict)


Due = tuple[ScopedEntry, str | None]


def _due(
    s: Session, now: datetime, limit: int, chain_id: str | None
) -> tuple[list[Due], list[Due]]:
    mine = () if chain_id is None else (CacheEntry.chain_id == chain_id,)
    ttl_rows = s.execute(
        select(
            CacheEntry.key_digest,
            CacheEntry.state,
            CacheEntry.tiers,
            CacheEntry.size,
            CacheEntry.tenant,
        )
        .where(
            CacheEntry.state == EntryState.LIVE,
            CacheEntry.expires_at.is_not(None),
            CacheEntry.expires_at <= now,
            *mine,
        )
        .order_by(CacheEntry.expires_at)
        .limit(limit)
    ).all()
    ttl = [(ScopedEntry(d, st, tuple(t or ()), sz), tn) for d, st, t, sz, tn in ttl_rows]
    seen = {e.key_digest for e, _ in ttl}
    retention: list[tuple[ScopedEntry, str | None]] = []
    for tenant_id, retention_s in s.execute(
        select(Tenant.id, Tenant.retention_s).where(Tenant.retention_s.is_not(None))
    ).all():
        cutoff = now - timedelta(seconds=int(retention_s or 0))
        rows = s.execute(
            select(CacheEntry.key_digest, CacheEntry.state, CacheEntry.tiers, CacheEntry.size)
            .where(
                and_(
                    CacheEntry.tenant == tenant_id,
                    CacheEntry.state == EntryState.LIVE,
                    CacheEntry.created_at <= cutoff,
                    *mine,
                )
            )
            .limit(limit)
        ).all()
        retention.extend(
            (ScopedEntry(d, st, tuple(t or ()), sz), tenant_id)
            for d, st, t, sz in rows
            if d not in seen
        )
    return ttl, retention


async def apply_retention(
    sessions: sessionmaker[Session],
    tiers: TierSet,
    sink: EventSink,
    *,
    now: datetime,
    principal: str = "retention",
    limit: int = 10_000,
    chain_id: str | None = None,
    expired_here: Sequence[Due] = (),
    local_index: LocalIndex | None = None,
) -> RetentionReport:
    """Delete every entry past its TTL or its tenant's retention (see the module docstring).

    ``chain_id`` limits it to the entries that chain created; ``expired_here`` adds entries the
    caller knows are past their TTL; ``local_index`` has them dropped before the tiers are
    touched (nothing serves an entry while it is being deleted)."""

    def read() -> tuple[list[Due], list[Due]]:
        with sessions.begin() as s:
            return _due(s, now, limit, chain_id)

    ttl, retention = await asyncio.to_thread(read)
    known = {e.key_digest for e, _ in ttl} | {e.key_digest for e, _ in retention}
    ttl.extend(d for d in expired_here if d[0].key_digest not in known)
    if local_index is not None:
        local_index.drop([e.key_digest for e, _ in (*ttl, *retention)])
    report = RetentionReport()
    for batch, reason in ((ttl, "ttl"), (retention, "retention")):
        if not batch:
            continue
        result = await delete_entries(
            tiers,
            sink,
            [e for e, _ in batch],
            tenant_of={e.key_digest: t for e, t in batch},
            new_state=EntryState.EXPIRED,
            kind=EventKind.KV_EXPIRED,
            reason=reason,
            principal=principal,
        )
        for name, n in result.sweep.deleted.items():
            report.deleted[name] = report.deleted.get(name, 0) + n
        if reason == "ttl":
            report.ttl_expired = result.recorded
        else:
            report.retention_expired = result.recorded
    return report

"""Retention: TTL expiry and tenant retention through the purge's deletion path.

:func:`apply_retention` is what the data plane's TTL sweeper calls: it finds, in the ledger's
cache-entry index, every live entry whose TTL has passed (``expires_at``) and every live entry
older than its tenant's ``tenants.retention_s``, deletes them from the given tiers with
:func:`~kvgov.proxy.purge.deletion.delete_entries` (verified absent) and records ``kv:expired``
events that mark them ``expired``. It is idempotent and bounded per call (``limit``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import and_, select
from sqlalchemy.orm import Session, sessionmaker

from kvgov.ledger.events import EventSink
from kvgov.ledger.models import CacheEntry, Tenant
from kvgov.proxy.purge.deletion import delete_entries
from kvgov.proxy.purge.ports import TierSet
from kvgov.proxy.purge.scope import ScopedEntry
from kvgov.types import EntryState, EventKind


@dataclass(slots=True)
class RetentionReport:
    ttl_expired: int = 0
    retention_expired: int = 0
    deleted: dict[str, int] = field(default_factory=dict)


def _due(s: Session, now: datetime, limit: int) -> tuple[list[tuple[ScopedEntry, str | None]], ...]:
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
) -> RetentionReport:
    """Delete every entry past its TTL or its tenant's retention (see the module docstring)."""

    def read() -> tuple[list[tuple[ScopedEntry, str | None]], ...]:
        with sessions.begin() as s:
            return _due(s, now, limit)

    ttl, retention = await asyncio.to_thread(read)
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

"""Startup state from the ledger: rebuild the entry index from ``cache_entries`` and register
this sidecar in ``sidecars`` (for purge fan-out). Blocking database code: run it in a thread.
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from kvgov.db.engine import SQLITE_BEGIN_IMMEDIATE
from kvgov.db.models import CacheEntry
from kvgov.db.models import Sidecar as SidecarRow
from kvgov.proxy.dataplane.index import EntryIndex, EntryMeta
from kvgov.types import EntryState


def load_index(engine: Engine, index: EntryIndex, now: float) -> int:
    """Load every live, unexpired entry; returns how many."""
    count = 0
    with Session(engine) as session:
        rows = session.scalars(select(CacheEntry).where(CacheEntry.state == EntryState.LIVE))
        for row in rows:
            expires = row.expires_at.timestamp() if row.expires_at is not None else None
            if expires is not None and expires <= now:
                continue
            if row.tenant is None:
                continue
            index.set(
                row.key_digest,
                EntryMeta(
                    tenant=row.tenant,
                    owner=row.owner,
                    scope_user=row.scope_user,
                    scope=row.scope,
                    sensitivity=row.sensitivity.value if row.sensitivity else None,
                    model=row.model,
                    size=row.size or 0,
                    tiers=tuple(row.tiers or ()),
                    key_id=row.key_id,
                    key_version=row.key_version,
                    expires_at=expires,
                ),
            )
            count += 1
    return count


def register_sidecar(engine: Engine, sidecar_id: str, chain_id: str, endpoint: str | None) -> None:
    """Upsert this sidecar's row; the edge (this function) owns the transaction."""
    now = datetime.now(UTC)
    with Session(engine) as session, session.begin():
        # a read, then a write: on SQLite take the write lock at BEGIN (another writer's commit
        # in between would fail the upgrade at once)
        session.connection(execution_options={SQLITE_BEGIN_IMMEDIATE: True})
        row = session.get(SidecarRow, sidecar_id)
        if row is None:
            session.add(
                SidecarRow(
                    id=sidecar_id,
                    chain_id=chain_id,
                    data_endpoint=endpoint,
                    started_at=now,
                    last_seen_at=now,
                )
            )
        else:
            row.chain_id = chain_id
            row.data_endpoint = endpoint
            row.started_at = now
            row.last_seen_at = now

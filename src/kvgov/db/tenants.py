"""Tenants as the ledger knows them: their retention period.

A tenant's ``retention_s`` bounds how long any of its entries stays cached, whatever TTL the
policy gave at put: the sidecars' sweepers delete older entries from every tier through the
purge's deletion path (:mod:`kvgov.services.purge.retention`). Operators set it with ``kvgov
tenant retention`` or ``PUT /v1/tenants/{tenant}/retention``; each change is a ledger event
(``tenant:retention:set``) recorded before the row is written.

Like every repository here, :class:`TenantRepository` never commits: the CLI command or the API
request that uses it owns the transaction.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from kvgov.db.engine import utcnow
from kvgov.db.models import TENANT, Tenant
from kvgov.errors import InvalidInputError

#: a tenant id as the cache keys' ``tenant%`` tag may carry it
TENANT_ID = re.compile(rf"^[A-Za-z0-9][A-Za-z0-9._-]{{0,{TENANT - 1}}}$")
#: the longest retention accepted (ten years): anything longer is a typo
MAX_RETENTION_S = 10 * 365 * 86_400


@dataclass(frozen=True, slots=True)
class TenantRecord:
    id: str
    retention_s: int | None
    created_at: datetime


def check_retention(tenant: str, retention_s: int | None) -> None:
    """Raise :class:`InvalidInputError` for a malformed tenant id or retention period."""
    if not TENANT_ID.fullmatch(tenant):
        raise InvalidInputError(f"invalid tenant id {tenant!r}")
    if retention_s is not None and not 1 <= retention_s <= MAX_RETENTION_S:
        raise InvalidInputError(f"retention must be between 1 and {MAX_RETENTION_S} seconds")


class TenantRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

    def get(self, tenant: str) -> TenantRecord | None:
        row = self.session.get(Tenant, tenant)
        return None if row is None else _record(row)

    def all(self) -> list[TenantRecord]:
        return [_record(r) for r in self.session.scalars(select(Tenant).order_by(Tenant.id))]

    def set_retention(self, tenant: str, retention_s: int | None) -> TenantRecord:
        """Set (or clear, with None) ``tenant``'s retention, creating its row if needed."""
        check_retention(tenant, retention_s)
        row = self.session.get(Tenant, tenant)
        if row is None:
            row = Tenant(id=tenant, created_at=utcnow())
            self.session.add(row)
        row.retention_s = retention_s
        self.session.flush()
        return _record(row)


def _record(row: Tenant) -> TenantRecord:
    return TenantRecord(id=row.id, retention_s=row.retention_s, created_at=row.created_at)

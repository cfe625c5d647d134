"""Provenance queries: which cached chunks fed a request, and whose chunks fed which requests.

Both directions are plain reads over ``ledger_events`` (every ``kv:get`` hit carries the serving
request's id) joined to ``cache_entries`` (who created each chunk, in which request, under which
policy revision). Nothing here writes or commits.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from kvgov.ledger.models import CacheEntry, LedgerEvent
from kvgov.ledger.queries_api import ProvenanceRow, provenance, request_tenants
from kvgov.types import EventKind

__all__ = ["ProvenanceRow", "Reuse", "provenance", "request_tenants", "reuse_of_user"]


@dataclass(frozen=True, slots=True)
class Reuse:
    """A request that was served a chunk created by the user in question."""

    request_id: str
    key_digest: str
    created_request_id: str | None
    served_at: datetime


def reuse_of_user(session: Session, tenant: str, pseudonym: str) -> list[Reuse]:
    """Every ``kv:get`` hit on a chunk that ``pseudonym`` created in ``tenant``, oldest first.

    Requests of the creator itself are included: the question is where the data went.
    """
    query = (
        select(
            LedgerEvent.request_id,
            LedgerEvent.key_digest,
            CacheEntry.created_request_id,
            LedgerEvent.occurred_at,
        )
        .join(CacheEntry, CacheEntry.key_digest == LedgerEvent.key_digest)
        .where(
            LedgerEvent.kind == EventKind.KV_GET.value,
            LedgerEvent.request_id.is_not(None),
            CacheEntry.tenant == tenant,
            CacheEntry.owner == pseudonym,
        )
        .order_by(LedgerEvent.occurred_at, LedgerEvent.chain_id, LedgerEvent.seq)
    )
    return [
        Reuse(request_id=r, key_digest=d, created_request_id=c, served_at=t)
        for r, d, c, t in session.execute(query)
        if r is not None and d is not None
    ]

"""Provenance: which cached chunks fed a request, and where a user's chunks went.

Both directions are plain reads over ``ledger_events`` (every ``kv:get`` hit carries the serving
request's id) joined to ``cache_entries`` (who created each chunk, in which request, under which
policy revision). "Which requests was a chunk served to" is one query, :func:`served_to`, used by
the API's footprint (``reused_by`` of each entry) and by :func:`user_reuse`, whose typed answer
the CLI prints (``kvgov provenance --user``). Nothing here writes or commits.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from kvgov.db.models import CacheEntry, LedgerEvent
from kvgov.ledger.queries_api import ProvenanceRow, provenance, request_tenants
from kvgov.types import EventKind

__all__ = [
    "ChunkReuse",
    "ProvenanceRow",
    "RequestReuse",
    "UserReuse",
    "provenance",
    "request_tenants",
    "served_to",
    "user_reuse",
]

#: at most this many request ids are listed per chunk
PER_ENTRY = 100


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ChunkReuse(_Frozen):
    """One chunk the user created and the requests it was later served to."""

    key_digest: str
    created_request_id: str | None
    reused_by: tuple[str, ...] = Field(description="request ids this chunk was served to")


class RequestReuse(_Frozen):
    """One request that was served the user's chunks, and how many of them."""

    request_id: str
    chunks: int


class UserReuse(_Frozen):
    """Where the chunks a user created in a tenant went (the user as its pseudonym only)."""

    tenant: str
    user: str
    entries: tuple[ChunkReuse, ...]
    requests: tuple[RequestReuse, ...]


def _first_serves(session: Session, key_digests: Sequence[str]) -> list[tuple[str, str, datetime]]:
    """The one query: (digest, request id, first served at), first served first."""
    if not key_digests:
        return []
    query = (
        select(LedgerEvent.key_digest, LedgerEvent.request_id, func.min(LedgerEvent.occurred_at))
        .where(
            LedgerEvent.kind == EventKind.KV_GET.value,
            LedgerEvent.key_digest.in_(list(key_digests)),
            LedgerEvent.request_id.is_not(None),
        )
        .group_by(LedgerEvent.key_digest, LedgerEvent.request_id)
        .order_by(func.min(LedgerEvent.occurred_at), LedgerEvent.request_id)
    )
    return [(d, r, t) for d, r, t in session.execute(query) if d is not None and r is not None]


def served_to(
    session: Session, key_digests: Sequence[str], *, per_entry: int = PER_ENTRY
) -> dict[str, list[str]]:
    """For each digest, the distinct request ids it was served to (first served first)."""
    out: dict[str, list[str]] = defaultdict(list)
    for digest, request_id, _first in _first_serves(session, key_digests):
        if len(out[digest]) < per_entry:
            out[digest].append(request_id)
    return dict(out)


def user_reuse(session: Session, tenant: str, pseudonym: str) -> UserReuse:
    """Every request served a chunk that ``pseudonym`` created in ``tenant``.

    Requests of the creator itself are included: the question is where the data went. A chunk
    another user re-put while it was live stays its creator's (it is not the re-putter's).
    Requests are listed first served first, each with how many of the user's chunks it got.
    """
    created = session.execute(
        select(CacheEntry.key_digest, CacheEntry.created_request_id)
        .where(CacheEntry.tenant == tenant, CacheEntry.owner == pseudonym)
        .order_by(CacheEntry.created_at, CacheEntry.key_digest)
    ).all()
    served: dict[str, list[str]] = defaultdict(list)
    counts: dict[str, int] = {}  # insertion order: first served first
    for digest, request_id, _first in _first_serves(session, [d for d, _ in created]):
        if len(served[digest]) < PER_ENTRY:
            served[digest].append(request_id)
        counts[request_id] = counts.get(request_id, 0) + 1
    return UserReuse(
        tenant=tenant,
        user=pseudonym,
        entries=tuple(
            ChunkReuse(key_digest=d, created_request_id=c, reused_by=tuple(served.get(d, ())))
            for d, c in created
        ),
        requests=tuple(RequestReuse(request_id=r, chunks=n) for r, n in counts.items()),
    )

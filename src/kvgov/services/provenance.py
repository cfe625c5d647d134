"""Provenance: which cached chunks fed a request, and where a user's chunks went.

Both directions are plain reads over ``ledger_events`` (every ``kv:get`` hit carries the serving
request's id) joined to ``cache_entries`` (who created each chunk, in which request, under which
policy revision). :func:`request_provenance` answers "which chunks fed request R of tenant T" as
one frozen :class:`RequestProvenance`: ``GET /v1/requests/{id}/provenance`` returns it and
``kvgov provenance R --json`` prints its ``model_dump(mode="json")``; the rule that an id several
tenants used needs a tenant is its :class:`~kvgov.errors.AmbiguousRequestError` (the API's 409,
the CLI's exit 2). "Which requests was a chunk served to" is one query, :func:`served_to`, used
by the API's footprint (``reused_by`` of each entry) and by :func:`user_reuse`, whose typed
answer the CLI prints (``kvgov provenance --user``). Nothing here writes or commits.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from kvgov.db.models import CacheEntry, LedgerEvent
from kvgov.errors import AmbiguousRequestError, NotFoundError
from kvgov.ledger.queries_api import ProvenanceRow, get_request, provenance, request_tenants
from kvgov.types import EntryState, EventKind, Sensitivity

__all__ = [
    "AmbiguousRequestError",
    "ChunkReuse",
    "Creation",
    "ProvenanceRow",
    "RequestProvenance",
    "RequestReuse",
    "ServedChunk",
    "UserReuse",
    "provenance",
    "request_provenance",
    "request_tenants",
    "served_to",
    "user_reuse",
]

#: at most this many request ids are listed per chunk
PER_ENTRY = 100


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


_PSEUDO = "3f9c2a51b0d84e6f9a7c11d2e8b45a90"
_DIGEST = "9b74c9897bac770ffc029102a200c5de3f1a8c1e0e0a7a3f0f3e6a1c8d2b4e55"


class Creation(_Frozen):
    """Who created a cached chunk."""

    request_id: str | None = Field(description="the request whose put created the chunk")
    user: str | None = Field(description="pseudonym of the creating user")
    created_at: datetime
    policy_revision: str | None = Field(description="the policy revision that admitted the put")
    decision_id: str | None


class ServedChunk(_Frozen):
    """One cached chunk a request loaded: when, from where, and who created it."""

    position: int = Field(description="0-based order in which the chunk was served")
    key_digest: str | None = Field(description="keyed digest of the cache key")
    served_at: datetime
    tier: str | None = Field(description="tier the chunk was read from")
    nbytes: int | None = Field(description="bytes served")
    chain_id: str = Field(description="ledger chain of the serving event")
    seq: int = Field(description="ledger position of the serving event")
    tenant: str | None = Field(description="the chunk's tenant")
    sensitivity: Sensitivity | None
    state: EntryState | None = Field(description="the entry's state now (null if unindexed)")
    created: Creation | None = Field(description="null when the ledger indexes no such entry")


class RequestProvenance(_Frozen):
    """Which cached chunks fed a request of a tenant, in order, and who created each."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "request_id": "req-9d21",
                    "tenant": "acme",
                    "user": _PSEUDO,
                    "chunks": [
                        {
                            "position": 0,
                            "key_digest": _DIGEST,
                            "served_at": "2026-11-21T10:20:40.002000Z",
                            "tier": "memory",
                            "nbytes": 4194304,
                            "chain_id": "node-a",
                            "seq": 1042,
                            "tenant": "acme",
                            "sensitivity": "internal",
                            "state": "live",
                            "created": {
                                "request_id": "req-7f3a",
                                "user": _PSEUDO,
                                "created_at": "2026-11-21T10:15:02.113000Z",
                                "policy_revision": "bundle-2026.11.20",
                                "decision_id": "d-1c9e",
                            },
                        }
                    ],
                }
            ]
        }
    )

    request_id: str
    tenant: str | None = Field(description="the tenant the request id belongs to")
    user: str | None = Field(description="pseudonym of the requesting user")
    chunks: tuple[ServedChunk, ...]


def request_provenance(session: Session, request_id: str, tenant: str | None) -> RequestProvenance:
    """The chunks that fed ``request_id`` of ``tenant``, in the order they were served.

    Request ids are scoped by tenant. Without a tenant, the only tenant that used the id is
    taken, and an id several tenants used raises :class:`AmbiguousRequestError`; an id the
    tenant (or anyone) never used raises :class:`NotFoundError`. A chunk the ledger does not
    index (its entry row is gone) is listed with ``created`` null and the request's tenant.
    """
    tenants = request_tenants(session, request_id)
    if tenant is not None and tenant not in tenants:
        raise NotFoundError(f"the ledger has no request {request_id!r} in tenant {tenant!r}")
    if tenant is None and len(tenants) > 1:
        raise AmbiguousRequestError(
            f"{len(tenants)} tenants used request id {request_id!r}: name the tenant",
            tenants=tuple(tenants),
        )
    if not tenants:
        raise NotFoundError(f"the ledger has no request {request_id!r}")
    tenant = tenant if tenant is not None else tenants[0]
    req = get_request(session, request_id, tenant)
    chunks = []
    for position, row in enumerate(provenance(session, request_id, tenant)):
        entry = row.entry
        chunks.append(
            ServedChunk(
                position=position,
                key_digest=row.key_digest,
                served_at=row.served_at,
                tier=row.tier,
                nbytes=row.nbytes,
                chain_id=row.chain_id,
                seq=row.seq,
                tenant=entry.tenant if entry else tenant,
                sensitivity=entry.sensitivity if entry else None,
                state=entry.state if entry else None,
                created=None
                if entry is None
                else Creation(
                    request_id=entry.created_request_id,
                    user=entry.owner,
                    created_at=entry.created_at,
                    policy_revision=entry.policy_revision,
                    decision_id=entry.decision_id,
                ),
            )
        )
    return RequestProvenance(
        request_id=request_id,
        tenant=tenant,
        user=req.actor if req is not None else None,
        chunks=tuple(chunks),
    )


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

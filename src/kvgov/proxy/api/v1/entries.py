"""``/v1`` routes about cached data: entries, request provenance and user footprints."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Query, Request

from kvgov.db.models import CacheEntry
from kvgov.errors import InvalidInputError
from kvgov.ledger import queries_api as q
from kvgov.proxy.api.auth import Context, DbSession, Reader
from kvgov.proxy.api.pagination import (
    DEFAULT_LIMIT,
    CursorParam,
    LimitParam,
    Page,
    next_link,
    time_key,
)
from kvgov.proxy.api.problems import problem_responses
from kvgov.proxy.api.v1.params import (
    RequestIdPath,
    RequiredTenantQuery,
    SinceQuery,
    TenantQuery,
    UntilQuery,
    UserPath,
    UserQuery,
    utc,
)
from kvgov.proxy.api.v1.schemas import Entry, Footprint, FootprintEntry
from kvgov.services import provenance
from kvgov.services.provenance import RequestProvenance
from kvgov.types import EntryState, Sensitivity

router = APIRouter(tags=["cache data"])

_TIER_PATTERN = r"^[a-z0-9_-]{1,64}$"


def entry_out(row: CacheEntry) -> Entry:
    return Entry(
        key_digest=row.key_digest,
        tenant=row.tenant,
        owner=row.owner,
        scope=row.scope,
        scope_user=row.scope_user,
        sensitivity=row.sensitivity,
        model=row.model,
        size=row.size,
        tiers=list(row.tiers or []),
        key_id=row.key_id,
        key_version=row.key_version,
        state=row.state,
        created_at=row.created_at,
        updated_at=row.updated_at,
        expires_at=row.expires_at,
        created_request_id=row.created_request_id,
        decision_id=row.decision_id,
        policy_revision=row.policy_revision,
    )


def _page_key(rows: list[CacheEntry], limit: int) -> tuple[datetime, str] | None:
    if len(rows) <= limit:
        return None
    last = rows[limit - 1]
    return (last.created_at, last.key_digest)


@router.get(
    "/entries",
    summary="List cache entries",
    description=(
        "Cache entries, newest first, filtered by tenant, user (raw id, pseudonymised "
        "server-side; needs `tenant`), sensitivity, tier, state and creation time."
    ),
    response_model=Page[Entry],
    responses=problem_responses(401, 403, 422),
)
def list_entries(
    *,
    request: Request,
    principal: Reader,
    ctx: Context,
    session: DbSession,
    tenant: TenantQuery = None,
    user: UserQuery = None,
    sensitivity: Annotated[
        Sensitivity | None, Query(description="Sensitivity class.", examples=["phi"])
    ] = None,
    tier: Annotated[
        str | None,
        Query(pattern=_TIER_PATTERN, description="Tier holding the entry.", examples=["memory"]),
    ] = None,
    state: Annotated[
        EntryState | None, Query(description="Entry state.", examples=["live"])
    ] = None,
    since: SinceQuery = None,
    until: UntilQuery = None,
    limit: LimitParam = DEFAULT_LIMIT,
    cursor: CursorParam = None,
) -> Page[Entry]:
    tenant = principal.tenant_filter(tenant)
    pseudonym = None
    if user is not None:
        if tenant is None:
            raise InvalidInputError("filtering by user needs a tenant (pseudonyms are per tenant)")
        pseudonym = ctx.pseudonymizer.user(tenant, user)
    rows = q.list_entries(
        session,
        tenant=tenant,
        user=pseudonym,
        sensitivity=sensitivity,
        tier=tier,
        state=state,
        since=utc(since, "since"),
        until=utc(until, "until"),
        after=time_key(cursor),
        limit=limit + 1,
    )
    return Page[Entry](
        items=[entry_out(r) for r in rows[:limit]],
        limit=limit,
        next=next_link(request, _page_key(rows, limit)),
    )


@router.get(
    "/requests/{request_id}/provenance",
    summary="Provenance of a request",
    description=(
        "The cached chunks that fed request R of a tenant, in the order they were served, and "
        "who created each one: the creating request, the user's pseudonym, the time and the "
        "policy revision. Request ids are scoped by tenant: a tenant-scoped token sees its "
        "tenant's request R only; without `tenant`, an id several tenants used is 409 "
        "`ambiguous_request`. `kvgov provenance R --json` prints the same document."
    ),
    response_model=RequestProvenance,
    responses=problem_responses(401, 403, 404, 409, 422),
)
def request_provenance(
    *,
    request_id: RequestIdPath,
    principal: Reader,
    session: DbSession,
    tenant: TenantQuery = None,
) -> RequestProvenance:
    # 404 for a request the tenant never used, 409 for an id several tenants used
    return provenance.request_provenance(session, request_id, principal.tenant_filter(tenant))


@router.get(
    "/users/{user}/footprint",
    summary="A user's footprint",
    description=(
        "What is cached for a user (owned by, scoped to or put by them) in a tenant: where, until "
        "when, and which requests reused each chunk. The user id is pseudonymised server-side "
        "exactly as the ledger does; only the pseudonym is returned."
    ),
    response_model=Footprint,
    responses=problem_responses(401, 403, 422),
)
def user_footprint(
    *,
    request: Request,
    user: UserPath,
    tenant: RequiredTenantQuery,
    principal: Reader,
    ctx: Context,
    session: DbSession,
    limit: LimitParam = DEFAULT_LIMIT,
    cursor: CursorParam = None,
) -> Footprint:
    principal.check_tenant(tenant)
    pseudonym = ctx.pseudonymizer.user(tenant, user)
    summary = q.footprint_summary(session, tenant, pseudonym)
    rows = q.list_entries(
        session, tenant=tenant, user=pseudonym, after=time_key(cursor), limit=limit + 1
    )
    page = rows[:limit]
    reuse = provenance.served_to(session, [r.key_digest for r in page])
    items = [
        FootprintEntry(**entry_out(r).model_dump(), reused_by=reuse.get(r.key_digest, []))
        for r in page
    ]
    return Footprint(
        tenant=tenant,
        user=pseudonym,
        entries_by_state=summary.entries_by_state,
        live_bytes_by_tier=summary.live_bytes_by_tier,
        live_until=summary.live_until,
        requests_served=summary.requests_served,
        items=items,
        limit=limit,
        next=next_link(request, _page_key(rows, limit)),
    )

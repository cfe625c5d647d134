"""``/v1`` routes for auditors: policy decisions, ledger integrity, checkpoints, tenant stats.

Ledger chains are per sidecar, not per tenant: every tenant's cache traffic is an event on the
same chain. A chain's event count, head and checkpoints therefore move with *every* tenant's
traffic, so (like ``/metrics``) they are shown only to callers that are not tenant-scoped. A
tenant-scoped caller of ``/v1/audit/verify`` learns whether the ledger verifies, nothing more,
and gets an empty page from ``/v1/audit/checkpoints``.
"""

from __future__ import annotations

import base64
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Literal

from fastapi import APIRouter, Path, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from kvgov.ledger import queries_api as q
from kvgov.ledger.verify import VerifyReport
from kvgov.proxy.api.auth import Context, DbSession, Reader
from kvgov.proxy.api.pagination import (
    DEFAULT_LIMIT,
    CursorParam,
    LimitParam,
    Page,
    checkpoint_key,
    next_link,
    time_key,
)
from kvgov.proxy.api.problems import problem_responses
from kvgov.proxy.api.v1.params import SAFE_TEXT, SinceQuery, TenantQuery, UntilQuery, utc
from kvgov.proxy.api.v1.schemas import (
    ChainReport,
    CheckpointOut,
    Decision,
    StatsOut,
    TenantStatsOut,
    VerifyOut,
)
from kvgov.types import Operation

router = APIRouter(tags=["audit"])


class DecisionOutcome(StrEnum):
    ALLOW = "allow"
    DENY = "deny"


@router.get(
    "/decisions",
    summary="List policy decisions",
    description="Recorded policy decisions, newest first, by outcome, reason, tenant, time.",
    response_model=Page[Decision],
    responses=problem_responses(401, 403, 422),
)
def list_decisions(
    *,
    request: Request,
    principal: Reader,
    session: DbSession,
    tenant: TenantQuery = None,
    outcome: Annotated[
        DecisionOutcome | None, Query(description="allow or deny.", examples=["deny"])
    ] = None,
    reason: Annotated[
        str | None,
        Query(
            max_length=256,
            pattern=SAFE_TEXT,
            description="A reason code the decision carries.",
            examples=["sensitivity_not_cacheable"],
        ),
    ] = None,
    operation: Annotated[
        Operation | None, Query(description="KV operation decided on.", examples=["put"])
    ] = None,
    since: SinceQuery = None,
    until: UntilQuery = None,
    limit: LimitParam = DEFAULT_LIMIT,
    cursor: CursorParam = None,
) -> Page[Decision]:
    rows = q.list_decisions(
        session,
        tenant=principal.tenant_filter(tenant),
        allowed=None if outcome is None else outcome is DecisionOutcome.ALLOW,
        reason=reason,
        operation=None if operation is None else operation.value,
        since=utc(since, "since"),
        until=utc(until, "until"),
        after=time_key(cursor),
        limit=limit + 1,
    )
    key = None
    if len(rows) > limit:
        key = (rows[limit - 1].first_seen_at, rows[limit - 1].decision_id)
    items = [
        Decision(
            decision_id=r.decision_id,
            tenant=r.tenant,
            operation=r.operation,
            outcome="allow" if r.allowed else "deny",
            reasons=list(r.reasons or []),
            tiers=list(r.tiers or []),
            ttl_s=r.ttl_s,
            scope=r.scope,
            policy_revision=r.policy_revision,
            data_revision=r.data_revision,
            input_digest=r.input_digest,
            first_seen_at=r.first_seen_at,
            chain_id=r.chain_id,
            seq=r.seq,
        )
        for r in rows[:limit]
    ]
    return Page[Decision](items=items, limit=limit, next=next_link(request, key))


def report_out(report: VerifyReport, verified_at: datetime) -> VerifyOut:
    """The ledger's :class:`~kvgov.ledger.verify.VerifyReport` in the API's shape
    (``verified_at``: when its verification began)."""
    chains = []
    for c in report.chains:
        first = c.first_bad
        chains.append(
            ChainReport(
                chain_id=c.chain_id,
                ok=c.ok,
                events=c.events,
                head_seq=c.head_seq,
                head_hash=c.head_hash,
                checkpoints=c.checkpoints,
                last_checkpoint_seq=c.last_checkpoint_seq,
                problem=None if first is None else first.problem.value,
                position=None if first is None else first.seq,
                detail=None if first is None else first.detail,
                findings=len(c.findings),
                unsigned_events=c.unsigned_events,
            )
        )
    return VerifyOut(
        ok=report.ok,
        verified_at=verified_at,
        chains=chains,
        problems=report.problems,
        trusted_keys=report.trusted or [],
    )


#: what a tenant-scoped caller is told when the ledger does not verify (the real problems name
#: chains, positions and what the database holds: other tenants' activity)
SCOPED_PROBLEM = (
    "the ledger failed verification; a token that is not tenant-scoped sees which chain and "
    "position"
)


class ScopedVerifyOut(BaseModel):
    """``/v1/audit/verify`` for a tenant-scoped caller: the verdict only. Chains are shared by
    every tenant, so their event counts, heads, checkpoints and bad positions are withheld."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "ok": True,
                    "verified_at": "2026-11-20T09:00:00Z",
                    "problems": [],
                    "trusted_keys": ["3f2a9c41d0e7b815"],
                    "scope": "tenant",
                }
            ]
        }
    )

    ok: bool
    verified_at: datetime
    problems: list[str] = Field(
        default_factory=list,
        description=f"empty when ok, else one generic statement ({SCOPED_PROBLEM!r})",
    )
    trusted_keys: list[str] = Field(
        default_factory=list, description="fingerprints of the keys chains were checked against"
    )
    scope: Literal["tenant"] = Field(
        default="tenant",
        description="the caller is tenant-scoped: per-chain detail (`chains`) is withheld",
    )


def scoped_report_out(report: VerifyReport, verified_at: datetime) -> ScopedVerifyOut:
    """The verdict of ``report`` without anything that moves with other tenants' traffic."""
    return ScopedVerifyOut(
        ok=report.ok,
        verified_at=verified_at,
        problems=[] if report.ok else [SCOPED_PROBLEM],
        trusted_keys=report.trusted or [],
    )


@router.get(
    "/audit/verify",
    summary="Verify the ledger",
    description=(
        "Recompute every hash chain and check every checkpoint signature against the trusted "
        "keys (this sidecar's own and `ledger.trusted_keys`, never keys stored in the ledger; "
        "the same check as `kvgov audit verify`). `ok` is false, with the first bad position "
        "per chain, when anything was modified, deleted, inserted or reordered, a chain is "
        "signed by an unknown key or missing, or the ledger was emptied (`problems`). "
        "Per-chain detail (`chains`: event counts, heads, checkpoints, bad positions) is for "
        "tokens that are not tenant-scoped: chains are shared by every tenant, so these move "
        "with other tenants' traffic. A tenant-scoped token gets the verdict only "
        "(`ScopedVerifyOut`: `ok`, `verified_at`, a generic `problems` line, `trusted_keys`, "
        '`scope: "tenant"`, no `chains`). '
        "One verification runs at a time per sidecar and its report is served again for "
        "`api.verify_cache_s` seconds (tenant-scoped tokens: `api.verify_scoped_refresh_s`); "
        "`verified_at` is when the report's verification began."
    ),
    response_model=VerifyOut | ScopedVerifyOut,
    responses=problem_responses(401, 403),
)
async def audit_verify(principal: Reader, ctx: Context) -> VerifyOut | ScopedVerifyOut:
    verified = await ctx.ledger_report(fleet_wide=principal.fleet_wide)
    if not principal.fleet_wide:
        return scoped_report_out(verified.report, verified.verified_at)
    return report_out(verified.report, verified.verified_at)


@router.get(
    "/audit/checkpoints",
    summary="List signed checkpoints",
    description=(
        "Signed chain heads, newest first (Ed25519 over chain id, size and head hash). "
        "For tokens that are not tenant-scoped: a checkpoint's size moves with every tenant's "
        "traffic, so a tenant-scoped token gets an empty page."
    ),
    response_model=Page[CheckpointOut],
    responses=problem_responses(401, 403, 422),
)
def list_checkpoints(
    *,
    request: Request,
    principal: Reader,
    session: DbSession,
    chain_id: Annotated[
        str | None,
        Query(
            max_length=255, pattern=SAFE_TEXT, description="Only this chain.", examples=["node-a"]
        ),
    ] = None,
    limit: LimitParam = DEFAULT_LIMIT,
    cursor: CursorParam = None,
) -> Page[CheckpointOut]:
    if not principal.fleet_wide:
        return Page[CheckpointOut](items=[], limit=limit, next=None)
    rows = q.list_checkpoints(
        session, chain_id=chain_id, after=checkpoint_key(cursor), limit=limit + 1
    )
    key: tuple[datetime, str, int, str] | None = None
    if len(rows) > limit:
        last = rows[limit - 1]
        key = (last.signed_at, last.chain_id, last.seq, last.nonce)
    items = [
        CheckpointOut(
            chain_id=r.chain_id,
            seq=r.seq,
            head_hash=r.head_hash,
            signed_at=r.signed_at,
            signature=base64.b64encode(r.signature).decode(),
            public_key=base64.b64encode(r.public_key).decode(),
        )
        for r in rows[:limit]
    ]
    return Page[CheckpointOut](items=items, limit=limit, next=next_link(request, key))


def stats_out(s: q.TenantStats) -> TenantStatsOut:
    return TenantStatsOut(
        tenant=s.tenant,
        entries=s.live_entries,
        entries_by_state=s.entries_by_state,
        live_bytes_by_tier=s.live_bytes_by_tier,
        puts=s.puts,
        hits=s.hits,
        misses=s.misses,
        hit_rate=s.hit_rate,
        denials=s.denials,
    )


@router.get(
    "/stats",
    summary="Per-tenant stats",
    description=(
        "For every tenant the caller may see: live entries, entries by state, live bytes per "
        "tier, and puts, hits, misses, hit rate and denials counted from ledger events "
        "(since `since` when given)."
    ),
    response_model=StatsOut,
    responses=problem_responses(401, 403, 422),
)
def all_stats(
    *, principal: Reader, session: DbSession, tenant: TenantQuery = None, since: SinceQuery = None
) -> StatsOut:
    tenant = principal.tenant_filter(tenant)
    stats = q.tenant_stats(
        session, tenants=None if tenant is None else [tenant], since=utc(since, "since")
    )
    return StatsOut(tenants=[stats_out(s) for s in stats])


@router.get(
    "/tenants/{tenant}/stats",
    summary="One tenant's stats",
    description="The same numbers as `/v1/stats` for one tenant (zeros for an unknown tenant).",
    response_model=TenantStatsOut,
    responses=problem_responses(401, 403, 422),
)
def tenant_stats(
    *,
    tenant: Annotated[
        str,
        Path(min_length=1, max_length=128, pattern=SAFE_TEXT, examples=["acme"]),
    ],
    principal: Reader,
    session: DbSession,
    since: SinceQuery = None,
) -> TenantStatsOut:
    principal.check_tenant(tenant)
    stats = q.tenant_stats(session, tenants=[tenant], since=utc(since, "since"))
    return stats_out(stats[0])

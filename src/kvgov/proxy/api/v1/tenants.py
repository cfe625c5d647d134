"""``/v1/tenants``: tenants' retention periods (the same as ``kvgov tenant``).

A tenant's retention bounds how long any of its entries stays cached; every sidecar's sweeper
deletes older entries from every tier, verifies them gone and records ``kv:expired`` (reason
``retention``). Setting it (admins; a tenant-scoped admin only for its tenant) is a ledger
event (``tenant:retention:set``) recorded before the row is written.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Path
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, ConfigDict, Field

from kvgov.db.tenants import MAX_RETENTION_S, TENANT_ID, TenantRecord, TenantRepository
from kvgov.errors import NotFoundError
from kvgov.ledger.events import Event
from kvgov.proxy.api.auth import Admin, Context, Reader
from kvgov.proxy.api.problems import problem_responses
from kvgov.types import EventKind

router = APIRouter(tags=["tenants"])

TenantPath = Annotated[
    str, Path(min_length=1, max_length=128, pattern=TENANT_ID.pattern, examples=["acme"])
]


class TenantOut(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {"id": "acme", "retention_s": 2592000, "created_at": "2026-11-25T10:00:00Z"}
            ]
        }
    )

    id: str
    retention_s: int | None = Field(description="entries older than this are deleted; null: none")
    created_at: datetime


class RetentionIn(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{"retention_s": 2592000}]})

    retention_s: int | None = Field(
        ge=1, le=MAX_RETENTION_S, description="seconds; null removes the retention"
    )


def _out(record: TenantRecord) -> TenantOut:
    return TenantOut(id=record.id, retention_s=record.retention_s, created_at=record.created_at)


@router.get(
    "/tenants",
    summary="List tenants",
    description="The tenants the ledger knows, with their retention (the caller's only, for "
    "tenant-scoped tokens).",
    response_model=list[TenantOut],
    responses=problem_responses(401, 403),
)
async def list_tenants(principal: Reader, ctx: Context) -> list[TenantOut]:
    def run() -> list[TenantRecord]:
        with ctx.session() as session:
            return TenantRepository(session).all()

    records = await run_in_threadpool(run)
    return [_out(r) for r in records if principal.tenant in (None, r.id)]


@router.get(
    "/tenants/{tenant}",
    summary="Show a tenant",
    description="One tenant and its retention (404 when the ledger knows no such tenant).",
    response_model=TenantOut,
    responses=problem_responses(401, 403, 404, 422),
)
async def get_tenant(tenant: TenantPath, principal: Reader, ctx: Context) -> TenantOut:
    principal.check_tenant(tenant)

    def run() -> TenantRecord | None:
        with ctx.session() as session:
            return TenantRepository(session).get(tenant)

    record = await run_in_threadpool(run)
    if record is None:
        raise NotFoundError(f"no tenant {tenant!r}")
    return _out(record)


@router.put(
    "/tenants/{tenant}/retention",
    summary="Set a tenant's retention",
    description="Entries of this tenant older than `retention_s` are deleted from every tier by "
    "the sweepers, verified gone and recorded. `null` removes the retention.",
    response_model=TenantOut,
    responses=problem_responses(401, 403, 422),
)
async def set_retention(
    tenant: TenantPath, body: RetentionIn, principal: Admin, ctx: Context
) -> TenantOut:
    principal.check_tenant(tenant)
    await ctx.sink.append(
        Event(
            kind=EventKind.TENANT_RETENTION_SET,
            tenant=tenant,
            principal=principal.id,
            attrs={"retention_s": body.retention_s},
        )
    )

    def run() -> TenantRecord:
        with ctx.session() as session:
            record = TenantRepository(session).set_retention(tenant, body.retention_s)
            session.commit()
            return record

    return _out(await run_in_threadpool(run))

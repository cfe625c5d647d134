"""``POST /v1/purges``: the right to be forgotten over REST (the same service as ``kvgov purge``).

It creates a durable purge job and answers 202 with it (the sidecars' purge executors run it;
poll ``GET /v1/purges/{id}`` until ``state`` is ``completed`` or ``incomplete`` and fetch
``/v1/purges/{id}/receipt``). With ``dry_run`` it answers 200 with what would be deleted and
changes nothing. Admins only; a tenant-scoped admin may purge only its tenant. The user id in
the body is pseudonymised at once and never stored or returned. The read routes (list, job,
receipt; auditors too) are in :mod:`kvgov.proxy.api.v1.purge_reads` and need no purge service.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, FastAPI, Request, status
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from kvgov.db.purge_views import PurgeRequest
from kvgov.proxy.api.auth import Admin
from kvgov.proxy.api.problems import problem_responses
from kvgov.proxy.api.v1.params import SAFE_TEXT
from kvgov.services.purge.documents import PurgeJobDocument, PurgePlan, job_document
from kvgov.services.purge.service import PurgeService

router = APIRouter(tags=["purges"])


class PurgeCreate(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{"tenant": "acme", "user": "u42", "dry_run": False}]},
    )

    tenant: str = Field(
        min_length=1, max_length=128, pattern=SAFE_TEXT, description="tenant to purge in"
    )
    user: str | None = Field(
        default=None,
        min_length=1,
        max_length=256,
        pattern=SAFE_TEXT,
        description="raw user id (pseudonymised on arrival); omit to purge the whole tenant",
    )
    dry_run: bool = Field(default=False, description="report what would be deleted, change nothing")


def _service(request: Request) -> PurgeService:
    service = getattr(request.app.state, "kvgov_purge", None)
    if not isinstance(service, PurgeService):
        raise RuntimeError("the purge routes were mounted without include_purges()")
    return service


@router.post(
    "/purges",
    summary="Purge a user or a tenant",
    description="Create a purge job (202) that every sidecar executes; with `dry_run`, report "
    "what would be deleted (200) and change nothing. Admins only; a tenant-scoped admin may "
    "purge only its tenant. Keys are crypto-shredded only this way over REST.",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=PurgeJobDocument,
    responses={
        200: {"description": "Dry run: what would be deleted", "model": PurgePlan},
        **problem_responses(401, 403, 422),
    },
)
async def create_purge(body: PurgeCreate, principal: Admin, request: Request) -> Any:
    principal.check_tenant(body.tenant)
    service = _service(request)
    req = PurgeRequest(
        tenant=body.tenant, user=body.user, dry_run=body.dry_run, requested_by=principal.id
    )
    if body.dry_run:
        plan = await service.plan(req)
        return JSONResponse(plan.model_dump(mode="json"), status_code=status.HTTP_200_OK)
    job = await service.create(req)
    wake: Callable[[], None] | None = getattr(request.app.state, "kvgov_purge_wake", None)
    if wake is not None:
        wake()
    return job_document(job)


def include_purges(
    app: FastAPI, service: PurgeService, *, wake: Callable[[], None] | None = None
) -> None:
    """Mount the purge routes (after :func:`kvgov.proxy.api.compliance.include_v1`)."""
    app.state.kvgov_purge = service
    app.state.kvgov_purge_wake = wake
    app.include_router(router, prefix="/v1")
    app.openapi_schema = None

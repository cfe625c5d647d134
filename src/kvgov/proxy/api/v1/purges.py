"""``POST /v1/purges``: the right to be forgotten over REST (the same service as ``kvgov purge``).

It creates a durable purge job and answers 202 with it (the sidecars' purge executors run it;
poll ``GET /v1/purges/{id}`` until ``state`` is ``completed`` or ``incomplete`` and fetch
``/v1/purges/{id}/receipt``). With ``dry_run`` it answers 200 with what would be deleted and
changes nothing. Admins only; a tenant-scoped admin may purge only its tenant. The user id in
the body is pseudonymised at once and never stored or returned. The read routes (list, job,
receipt; auditors too) are in :mod:`kvgov.proxy.api.v1.purge_reads` and need no purge service.

Every job resets every pod's whole vLLM prefix cache (all tenants') and is claimed before later
jobs, so what a tenant-scoped admin can start is bounded (review r15, F2): a user id the ledger
never saw in the tenant is refused (409 ``unknown_subject``) unless the body says ``force``
(every caller: it is the CLI's warning, which the API cannot ask to confirm), and a
tenant-scoped token is held to ``api.purges_open_per_tenant`` open jobs of its tenant and
``api.purges_per_minute_per_token`` creations (429 ``rate_limited`` with ``Retry-After``). Its
dry run leaves out the fleet's sidecar ids and engine URLs (counts only).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, FastAPI, Request, status
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from kvgov.db.purge_views import CreationBound, PurgeRequest
from kvgov.errors import RateLimitedError, UnknownSubjectError
from kvgov.proxy.api.auth import Admin, Principal
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
    force: bool = Field(
        default=False,
        description="purge the user even though the ledger never saw the id act in the tenant "
        "(ids are matched exactly, as the gateway sent them: such a purge finds nothing). "
        "Without it that request is refused with 409 `unknown_subject`; a dry run says "
        "`subject_known`",
    )


#: why ``POST /v1/purges`` refused to make a job (the refusal metric's label)
Refused = Callable[[str], None]


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
    "purge only its tenant, with at most `api.purges_open_per_tenant` jobs of it open and "
    "`api.purges_per_minute_per_token` made a minute (429 beyond), and its dry run names no "
    "sidecar or engine (counts only). A user id the ledger never saw in the tenant is refused "
    "(409) unless `force`. Keys are crypto-shredded only this way over REST.",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=PurgeJobDocument,
    responses={
        200: {"description": "Dry run: what would be deleted", "model": PurgePlan},
        **problem_responses(
            401,
            403,
            409,
            422,
            429,
            described={
                409: "The ledger never saw this user id act in the tenant (`unknown_subject`): "
                "check the id, or send `force: true`",
                429: "A tenant-scoped token's bound (`rate_limited`): its tenant's open jobs, "
                "or its creations this minute; try again after `Retry-After` seconds",
            },
        ),
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
        if not principal.fleet_wide:
            # which pods there are and where their engines listen is the operator's, not a
            # tenant's: a scoped token sees how many (review r15)
            plan = plan.model_copy(update={"sidecars": None, "vllm_engines": None})
        return JSONResponse(plan.model_dump(mode="json"), status_code=status.HTTP_200_OK)
    refused: Refused | None = getattr(request.app.state, "kvgov_purge_refused", None)
    if req.user is not None and not body.force:
        known, variants = await service.subject_check(req)
        if known is False:
            if refused is not None:
                refused("unknown_subject")
            raise UnknownSubjectError(_unknown_subject(req.tenant, variants))
    try:
        job = await service.create(req, bound=_bound(principal, service))
    except RateLimitedError as exc:
        if refused is not None:
            refused(exc.limit or "rate_limited")
        raise
    wake: Callable[[], None] | None = getattr(request.app.state, "kvgov_purge_wake", None)
    if wake is not None:
        wake()
    return job_document(job)


def _bound(principal: Principal, service: PurgeService) -> CreationBound | None:
    """A tenant-scoped admin's bounds; none for a global admin, who is the operator (it can
    mint tokens, so no bound on it would hold, and the operator's CLI writes the database
    directly): a bound there would only delay erasures the operator asked for."""
    if principal.fleet_wide:
        return None
    api = service.settings.api
    return CreationBound(
        open_per_tenant=api.purges_open_per_tenant, per_window=api.purges_per_minute_per_token
    )


def _unknown_subject(tenant: str, variants: int) -> str:
    """The refusal of an id the ledger never saw (never the id itself: it is personal data)."""
    text = (
        f"tenant {tenant!r} has no record of this user id: ids are matched exactly, as the"
        " gateway sent them, so this purge would find nothing; check the id, or send"
        " force: true to purge it anyway"
    )
    if variants:
        text += (
            f" ({variants} other spelling(s) of it, in case, surrounding spaces or Unicode"
            " form, have data there)"
        )
    return text


def include_purges(
    app: FastAPI,
    service: PurgeService,
    *,
    wake: Callable[[], None] | None = None,
    refused: Refused | None = None,
) -> None:
    """Mount the purge routes (after :func:`kvgov.proxy.api.compliance.include_v1`).
    ``refused`` counts each creation refused, by reason (``unknown_subject``, ``open_jobs``,
    ``per_minute``)."""
    app.state.kvgov_purge = service
    app.state.kvgov_purge_wake = wake
    app.state.kvgov_purge_refused = refused
    app.include_router(router, prefix="/v1")
    app.openapi_schema = None

"""Reading erasure requests: ``GET /v1/purges``, ``/v1/purges/{id}`` and its signed receipt.

Auditors and admins may read (a tenant-scoped token sees only its tenant); creating a purge
(``POST /v1/purges``, :mod:`kvgov.proxy.api.v1.purges`) is for admins. These routes read the
ledger database only, so every control plane serves them, with or without a purge executor.
The list and the dashboard's "Erasure requests" section are built by the same
:func:`purge_summary` over the same query, including whether each receipt's signature verifies
against the ledger's public key (:meth:`ApiContext.trusted_receipt_keys`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.orm import Session

from kvgov.db import purge_jobs as jobs
from kvgov.db import queries_admin as qa
from kvgov.errors import NotFoundError
from kvgov.ledger.purge_trail import late_evictions, late_evictions_of
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
from kvgov.proxy.api.v1.params import SinceQuery, TenantQuery, UntilQuery, utc
from kvgov.services.purge.documents import PurgeJobDocument, job_document
from kvgov.services.purge.receipts import ReceiptFor, verify_receipt
from kvgov.types import PurgeKind, PurgeState

router = APIRouter(tags=["purges"])

_JOB_ID = "0b7d4f0e-6a3c-4d8e-9b61-2f1c5a7e9d30"
_PSEUDO = "3f9c2a51b0d84e6f9a7c11d2e8b45a90"

PurgeIdPath = Annotated[
    str,
    Path(
        min_length=1,
        max_length=36,
        pattern=r"^[0-9a-f-]+$",
        description="Purge job id.",
        examples=[_JOB_ID],
    ),
]


class PurgeCounts(BaseModel):
    """What the purge found and deleted (from its receipt once finished)."""

    entries_in_scope: int | None = Field(description="entries the purge covered (null: running)")
    entries_purged: int | None = Field(description="entries this purge moved to purged")
    deleted_by_tier: dict[str, int] = Field(description="objects deleted per tier")
    keys_destroyed: int | None = Field(description="data key versions crypto-shredded")
    engines_acknowledged: int | None
    engines_unreachable: int | None


class ReceiptStatus(BaseModel):
    """Whether the purge has a signed receipt and whether its signature verifies."""

    present: bool
    signature_valid: bool | None = Field(
        description="verified against the ledger's public key (null: no receipt yet)"
    )
    key_id: str | None = Field(description="which key signed it (SHA-256 of the public key)")
    reason: str | None = Field(description="why it does or does not verify")
    url: str | None = Field(description="where to download it (`kvgov purge verify-receipt`)")


class PurgeSummary(BaseModel):
    """One erasure request in a list: its state, counts and receipt."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "id": _JOB_ID,
                    "kind": "user",
                    "tenant": "acme",
                    "subject": _PSEUDO,
                    "state": "completed",
                    "dry_run": False,
                    "requested_by": "token:5b0c8a8e-1f0e-4f55-9d73-2d7f9a3b8c11",
                    "created_at": "2026-11-21T10:15:02Z",
                    "updated_at": "2026-11-21T10:15:04Z",
                    "finished_at": "2026-11-21T10:15:04Z",
                    "steps_by_state": {"completed": 5},
                    "counts": {
                        "entries_in_scope": 12,
                        "entries_purged": 12,
                        "deleted_by_tier": {"memory": 12, "filesystem": 12},
                        "keys_destroyed": 1,
                        "engines_acknowledged": 2,
                        "engines_unreachable": 0,
                    },
                    "incomplete": [],
                    "late_evictions": 0,
                    "receipt": {
                        "present": True,
                        "signature_valid": True,
                        "key_id": "5f0c0b8e4c7d1a9e2b3c4d5e6f708192",
                        "reason": "signature valid",
                        "url": f"/v1/purges/{_JOB_ID}/receipt",
                    },
                }
            ]
        }
    )

    id: str
    kind: PurgeKind
    tenant: str
    subject: str | None = Field(description="pseudonym of the erased user (null: whole tenant)")
    state: PurgeState
    dry_run: bool
    requested_by: str | None
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None
    steps_by_state: dict[str, int]
    counts: PurgeCounts
    incomplete: list[str] = Field(description="what could not be reached or done")
    late_evictions: int = Field(
        description="EVICTs engines the purge could not reach acknowledged afterwards (chained"
        " `purge:evict:late` events that prove themselves; the job's `late_evictions` lists"
        " them; the receipt is not changed by them)"
    )
    receipt: ReceiptStatus


class SignatureOut(BaseModel):
    alg: str
    key_id: str
    public_key: str = Field(description="raw Ed25519 public key, base64")
    value: str = Field(description="signature over the canonical receipt, base64")


class SignedReceipt(BaseModel):
    """The signed receipt, byte for byte what ``kvgov purge verify-receipt FILE`` checks."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "receipt": {
                        "format": "kvgov-purge-receipt/1",
                        "purge_id": _JOB_ID,
                        "state": "completed",
                        "kind": "user",
                        "tenant": "acme",
                        "subject": _PSEUDO,
                        "tiers": {"memory": 12},
                        "keys_destroyed": [{"key_id": f"u:acme:{_PSEUDO}", "version": 1}],
                        "incomplete": [],
                    },
                    "signature": {
                        "alg": "Ed25519",
                        "key_id": "5f0c0b8e4c7d1a9e2b3c4d5e6f708192",
                        "public_key": "MCowBQYDK2VwAyEA...base64...",
                        "value": "k3Jx...base64...",
                    },
                }
            ]
        }
    )

    receipt: dict[str, Any]
    signature: SignatureOut


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def purge_summaries(
    session: Session,
    rows: Sequence[qa.PurgeRow],
    trusted: tuple[bytes, ...],
    ledger_keys: Collection[bytes],
) -> list[PurgeSummary]:
    """The purge jobs ``rows`` as the list and the dashboard show them, with the late
    evictions of each (:func:`~kvgov.ledger.purge_trail.late_evictions_of`, the reader of
    the job's document, for the page in one query; ``ledger_keys``: the keys a chain must be
    signed by for its events to count)."""
    late = late_evictions_of(session, [(r.job.id, r.job.tenant) for r in rows], ledger_keys)
    return [purge_summary(r, trusted, len(late.get(r.job.id, ()))) for r in rows]


def purge_summary(row: qa.PurgeRow, trusted: tuple[bytes, ...], late: int) -> PurgeSummary:
    """A purge job as the list and the dashboard show it (``late``: its late evictions)."""
    job = row.job
    doc = row.receipt
    body: dict[str, Any] = {}
    if doc is not None and isinstance(doc.get("receipt"), dict):
        body = doc["receipt"]
    result = job.result or {}
    tiers = body.get("tiers", result.get("tiers")) or {}
    engines = body.get("engines") or {}
    keys = body.get("keys_destroyed")
    status = ReceiptStatus(present=False, signature_valid=None, key_id=None, reason=None, url=None)
    if doc is not None:
        check = verify_receipt(doc, trusted, job=ReceiptFor.of(job))
        status = ReceiptStatus(
            present=True,
            signature_valid=check.ok,
            key_id=check.key_id,
            reason=check.reason,
            url=f"/v1/purges/{job.id}/receipt",
        )
    incomplete = body.get("incomplete", result.get("incomplete")) or []
    return PurgeSummary(
        id=job.id,
        kind=PurgeKind(job.kind),
        tenant=job.tenant,
        subject=job.subject,
        state=PurgeState(job.state),
        dry_run=job.dry_run,
        requested_by=job.requested_by,
        created_at=job.created_at,
        updated_at=job.updated_at,
        finished_at=job.finished_at,
        steps_by_state=row.steps_by_state,
        counts=PurgeCounts(
            entries_in_scope=_int(body.get("entries_in_scope")),
            entries_purged=_int(body.get("entries_purged")),
            deleted_by_tier={str(k): int(v) for k, v in tiers.items() if _int(v) is not None},
            keys_destroyed=len(keys) if isinstance(keys, list) else None,
            engines_acknowledged=len(engines["acknowledged"])
            if isinstance(engines.get("acknowledged"), list)
            else None,
            engines_unreachable=len(engines["unreachable"])
            if isinstance(engines.get("unreachable"), list)
            else None,
        ),
        incomplete=[str(i) for i in incomplete] if isinstance(incomplete, list) else [],
        late_evictions=late,
        receipt=status,
    )


@router.get(
    "/purges",
    summary="List erasure requests",
    description=(
        "Purge jobs, newest first, with their state, steps by state, counts (entries, "
        "deletions per tier, keys destroyed, engines), how many EVICTs engines it could not "
        "reach acknowledged late (`late_evictions`; the job lists them) and whether a signed "
        "receipt exists and verifies against the ledger's key. Filters: tenant, state, kind, "
        "creation time. "
        "Auditors and admins; a tenant-scoped token sees only its tenant."
    ),
    response_model=Page[PurgeSummary],
    responses=problem_responses(401, 403, 422),
)
def list_purges(
    *,
    request: Request,
    principal: Reader,
    ctx: Context,
    session: DbSession,
    tenant: TenantQuery = None,
    state: Annotated[
        PurgeState | None, Query(description="Job state.", examples=["completed"])
    ] = None,
    kind: Annotated[
        PurgeKind | None, Query(description="user or tenant purges.", examples=["user"])
    ] = None,
    since: SinceQuery = None,
    until: UntilQuery = None,
    limit: LimitParam = DEFAULT_LIMIT,
    cursor: CursorParam = None,
) -> Page[PurgeSummary]:
    rows = qa.list_purges(
        session,
        tenant=principal.tenant_filter(tenant),
        state=state,
        kind=kind,
        since=utc(since, "since"),
        until=utc(until, "until"),
        after=time_key(cursor),
        limit=limit + 1,
    )
    key = None
    if len(rows) > limit:
        key = (rows[limit - 1].job.created_at, rows[limit - 1].job.id)
    trusted = ctx.trusted_receipt_keys()
    return Page[PurgeSummary](
        items=purge_summaries(session, rows[:limit], trusted, ctx.ledger_keys()),
        limit=limit,
        next=next_link(request, key),
    )


@router.get(
    "/purges/{purge_id}",
    summary="A purge job",
    description=(
        "The job, its steps (each step's `detail` says what it did, or why it did not) and, "
        "once finished, its signed receipt, and `late_evictions`: the EVICTs engines the "
        "step could not reach acknowledged afterwards (chained `purge:evict:late` events; the "
        "receipt is not changed by them). `kvgov purge status ID --json` prints the same "
        "document. Auditors and admins."
    ),
    response_model=PurgeJobDocument,
    responses=problem_responses(401, 403, 404, 422),
)
def get_purge(
    *, purge_id: PurgeIdPath, principal: Reader, ctx: Context, session: DbSession
) -> PurgeJobDocument:
    job = jobs.load_job(session, purge_id)
    principal.check_tenant(job.tenant)  # before anything of the job is read
    # the job's own tenant only: another tenant's events never match
    late = late_evictions(session, job.id, job.tenant, ctx.ledger_keys())
    return job_document(job, late)


@router.get(
    "/purges/{purge_id}/receipt",
    summary="A purge's signed receipt",
    description=(
        "The signed receipt JSON exactly as stored, to save and check with `kvgov purge "
        "verify-receipt FILE` (against the ledger's public key). 404 while the job has no "
        "receipt yet (it is written when the job finishes)."
    ),
    response_model=SignedReceipt,
    responses=problem_responses(401, 403, 404, 422),
)
def get_receipt(*, purge_id: PurgeIdPath, principal: Reader, session: DbSession) -> JSONResponse:
    job = jobs.load_job(session, purge_id)
    principal.check_tenant(job.tenant)
    if job.receipt is None:
        raise NotFoundError(f"purge {purge_id} has no receipt yet (state {job.state})")
    return JSONResponse(
        job.receipt,
        headers={"Content-Disposition": f'attachment; filename="purge-{job.id}-receipt.json"'},
    )

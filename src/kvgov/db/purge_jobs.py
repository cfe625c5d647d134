"""Purge jobs and steps in the ledger database: create, claim, finish, read.

Functions take a :class:`Session` and never commit: the executor (or the API request) owns the
transaction. Claiming uses ``SELECT ... FOR UPDATE SKIP LOCKED`` on Postgres, so several
sidecars sharing one database never take the same step; SQLite serialises writers itself
(``BEGIN IMMEDIATE``). A claim commits ``running`` at once; a step left ``running`` by a process
that died is taken again once its lease has expired (or at once by its own sidecar restarting).
A step's ``detail`` is stored and read as plain JSON here; its typed model is the service's
(:mod:`kvgov.services.purge.documents`). Which sidecars are live is :mod:`kvgov.db.sidecars`.
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, and_, func, or_, select, text, update
from sqlalchemy.orm import Session

from kvgov.db.models import PurgeJob, PurgeReceipt, PurgeStep
from kvgov.db.purge_views import (
    CREATION_WINDOW_S,
    MAX_ATTEMPTS,
    TERMINAL_STEP_STATES,
    CreationBound,
    JobView,
    PurgeRequest,
    StepName,
    StepPlan,
    StepView,
    ledger_step_ready,
)
from kvgov.errors import NotFoundError, PurgeError, RateLimitedError
from kvgov.types import PurgeKind, PurgeState

_OPEN = (PurgeState.PENDING, PurgeState.RUNNING)
#: class (first key) of the transaction-level advisory lock on a tenant's bounded creations
#: (:func:`hold_to_bound`): the bytes ``kvpq``; the second key is the tenant's ``hashtext``
CREATION_LOCK_CLASS = int.from_bytes(b"kvpq", "big")


def hold_to_bound(
    s: Session,
    tenant: str,
    requested_by: str,
    bound: CreationBound,
    *,
    now: datetime,
    job_timeout_s: float,
) -> None:
    """Raise :class:`RateLimitedError` unless ``requested_by`` may create one more job of
    ``tenant`` now: fewer than ``bound.open_per_tenant`` open jobs of the tenant (whoever
    asked for them), and fewer than ``bound.per_window`` made by ``requested_by`` in the last
    minute. Called in the transaction that inserts the job: the tenant's creations are
    serialised until it ends (Postgres: an advisory lock, which the runtime role may take;
    SQLite: the write lock its ``BEGIN IMMEDIATE`` took), so requests at once cannot each count
    one below the bound and all insert. Both counts read the tenant's jobs only (its index)."""
    if s.get_bind().dialect.name == "postgresql":
        s.execute(
            text("SELECT pg_advisory_xact_lock(:cls, hashtext(:tenant))"),
            {"cls": CREATION_LOCK_CLASS, "tenant": tenant},
        )
    n_open, oldest_open = s.execute(
        select(func.count(), func.min(PurgeJob.created_at)).where(
            PurgeJob.tenant == tenant, PurgeJob.state.in_(_OPEN)
        )
    ).one()
    if n_open >= bound.open_per_tenant:
        # a slot frees when any open job ends: most end in seconds, the oldest by its timeout
        due = _seconds_until(oldest_open, job_timeout_s, now)
        raise RateLimitedError(
            f"tenant {tenant!r} has {n_open} purge job(s) open, the most a tenant-scoped token"
            f" may have ({bound.open_per_tenant}): wait for one to finish",
            retry_after_s=due,
            limit="open_jobs",
        )
    since = now - timedelta(seconds=CREATION_WINDOW_S)
    n_recent, oldest_recent = s.execute(
        select(func.count(), func.min(PurgeJob.created_at)).where(
            PurgeJob.tenant == tenant,
            PurgeJob.requested_by == requested_by,
            PurgeJob.created_at >= since,
        )
    ).one()
    if n_recent >= bound.per_window:
        raise RateLimitedError(
            f"this token made {n_recent} purge job(s) in the last minute, the most it may"
            f" ({bound.per_window})",
            retry_after_s=_seconds_until(oldest_recent, CREATION_WINDOW_S, now),
            limit="per_minute",
        )


def _seconds_until(start: datetime | None, after_s: float, now: datetime) -> int:
    """Whole seconds from ``now`` until ``after_s`` past ``start`` (1 to ``after_s``: a row
    stamped a moment after ``now`` was read, by another request's clock, must not ask for
    longer than the window itself)."""
    if start is None:  # pragma: no cover - counted rows have a creation time
        return 1
    left = math.ceil((start + timedelta(seconds=after_s) - now).total_seconds())
    return max(1, min(math.ceil(after_s), left))


def insert_job(
    s: Session,
    job_id: str,
    req: PurgeRequest,
    subject: str | None,
    steps: list[StepPlan],
    *,
    now: datetime,
) -> None:
    s.add(
        PurgeJob(
            id=job_id,
            kind=req.kind,
            tenant=req.tenant,
            subject=subject,
            state=PurgeState.PENDING,
            dry_run=req.dry_run,
            requested_by=req.requested_by,
            created_at=now,
            updated_at=now,
        )
    )
    s.flush()
    for plan in steps:
        s.add(
            PurgeStep(
                job_id=job_id,
                name=str(plan.name),
                sidecar_id=plan.sidecar_id,
                state=PurgeState.PENDING,
                attempts=0,
                detail={},
            )
        )
    s.flush()


def _step_view(row: PurgeStep) -> StepView:
    return StepView(
        id=row.id,
        name=StepName(row.name),
        sidecar_id=row.sidecar_id,
        state=row.state,
        attempts=row.attempts,
        detail=dict(row.detail or {}),
        started_at=row.started_at,
        finished_at=row.finished_at,
    )


def _steps(s: Session, job_id: str) -> list[StepView]:
    rows = s.scalars(select(PurgeStep).where(PurgeStep.job_id == job_id).order_by(PurgeStep.id))
    return [_step_view(r) for r in rows]


def load_job(s: Session, job_id: str) -> JobView:
    job = s.get(PurgeJob, job_id)
    if job is None:
        raise NotFoundError(f"no purge job {job_id}")
    receipt = s.get(PurgeReceipt, job_id)
    return JobView(
        id=job.id,
        kind=PurgeKind(job.kind),
        tenant=job.tenant,
        subject=job.subject,
        state=job.state,
        dry_run=job.dry_run,
        requested_by=job.requested_by or "",
        created_at=job.created_at,
        updated_at=job.updated_at,
        finished_at=job.finished_at,
        result=job.result,
        steps=_steps(s, job_id),
        receipt=dict(receipt.receipt) if receipt is not None else None,
    )


def open_job_ids(s: Session) -> list[str]:
    rows = s.scalars(
        select(PurgeJob.id).where(PurgeJob.state.in_(_OPEN)).order_by(PurgeJob.created_at)
    )
    return list(rows)


def claim_step(
    s: Session,
    *,
    sidecar_id: str | None,
    now: datetime,
    lease_s: float,
    job_timeout_s: float,
    job_id: str | None = None,
) -> tuple[JobView, StepView] | None:
    """Take one runnable step: a global step, or one of ``sidecar_id``'s own steps.

    The ledger step is only runnable once every other step of its job is terminal or the job has
    timed out; on timeout the steps nobody took are marked ``incomplete`` (unreachable) first.
    """
    stale = now - timedelta(seconds=lease_s)
    mine: ColumnElement[bool] = PurgeStep.sidecar_id.is_(None)
    if sidecar_id is not None:
        # the fleet-wide GPU step (planned when no sidecar was live: the CLI's) resets the
        # engines of whoever runs it; a sidecar would reset its own pod's only and call the
        # fleet done (review 5, finding F). Left to a sidecar-less executor, or unreachable.
        global_ = and_(mine, PurgeStep.name != str(StepName.GPU))
        mine = or_(global_, PurgeStep.sidecar_id == sidecar_id)
    query = (
        select(PurgeStep)
        .join(PurgeJob, PurgeJob.id == PurgeStep.job_id)
        .where(
            PurgeJob.state.in_(_OPEN),
            mine,
            or_(
                PurgeStep.state == PurgeState.PENDING,
                (PurgeStep.state == PurgeState.RUNNING) & (PurgeStep.started_at < stale),
            ),
        )
        .order_by(PurgeJob.created_at, PurgeStep.id)
        .limit(32)
        .with_for_update(of=PurgeStep, skip_locked=True)
    )
    if job_id is not None:
        query = query.where(PurgeStep.job_id == job_id)
    for row in s.scalars(query).all():
        job = s.get(PurgeJob, row.job_id)
        if job is None:  # pragma: no cover - foreign key
            continue
        if row.name == StepName.LEDGER:
            others = [v for v in _steps(s, job.id) if v.name is not StepName.LEDGER]
            if not ledger_step_ready(
                others, created_at=job.created_at, now=now, timeout_s=job_timeout_s
            ):
                continue
            _mark_unreachable(s, job.id, now=now)
        row.state = PurgeState.RUNNING
        row.attempts += 1
        row.started_at = now
        if job.state is PurgeState.PENDING:
            job.state = PurgeState.RUNNING
        job.updated_at = now
        s.flush()
        return load_job(s, job.id), _step_view(row)
    return None


def _mark_unreachable(s: Session, job_id: str, *, now: datetime) -> None:
    rows = s.scalars(
        select(PurgeStep)
        .where(PurgeStep.job_id == job_id, PurgeStep.name != str(StepName.LEDGER))
        .with_for_update()
    )
    for row in rows:
        if row.state in TERMINAL_STEP_STATES:
            continue
        who = f"sidecar {row.sidecar_id}" if row.sidecar_id else "no executor"
        row.state = PurgeState.INCOMPLETE
        row.detail = {
            **(row.detail or {}),
            "not_taken": True,
            "reason": f"{who} did not finish this step before the job timed out",
        }
        row.finished_at = now


def _step_row(s: Session, step_id: int) -> PurgeStep:
    row = s.get(PurgeStep, step_id, with_for_update=True)
    if row is None:  # pragma: no cover - foreign key
        raise NotFoundError(f"no purge step {step_id}")
    return row


def _held(s: Session, step_id: int, attempt: int) -> PurgeStep | None:
    """The step's row (locked) while claim ``attempt`` holds it; None once it was claimed
    again (its lease ran out): that attempt writes nothing."""
    row = _step_row(s, step_id)
    return row if row.attempts == attempt else None


def finish_step(
    s: Session,
    step_id: int,
    state: PurgeState,
    detail: dict[str, Any],
    *,
    now: datetime,
    attempt: int,
) -> bool:
    """Record a step's final state and its detail (the JSON of its typed detail), made by
    claim ``attempt``; False, writing nothing, when the step was claimed again since (its
    lease ran out: the later attempt's outcome, whose ``purge:step`` event the receipt is
    checked against, is the one the row keeps)."""
    row = _held(s, step_id, attempt)
    if row is None:
        return False
    row.state = state
    row.detail = detail
    row.finished_at = now
    return True


def fail_step(s: Session, step_id: int, error: str, *, now: datetime, attempt: int) -> PurgeState:
    """Record an error of claim ``attempt``: back to pending for a retry, or ``failed`` after
    ``MAX_ATTEMPTS``; nothing when the step was claimed again since (its state returned)."""
    row = _held(s, step_id, attempt)
    if row is None:
        return PurgeState(_step_row(s, step_id).state)
    row.detail = {**(row.detail or {}), "error": error}
    if row.attempts >= MAX_ATTEMPTS:
        row.state = PurgeState.FAILED
        row.finished_at = now
    else:
        row.state = PurgeState.PENDING
    return row.state


def release_own_steps(s: Session, sidecar_id: str) -> int:
    """A (re)starting sidecar takes back the steps its previous process left running."""
    result = s.execute(
        update(PurgeStep)
        .where(PurgeStep.sidecar_id == sidecar_id, PurgeStep.state == PurgeState.RUNNING)
        .values(state=PurgeState.PENDING)
    )
    return int(getattr(result, "rowcount", 0) or 0)


def close_refused(s: Session, job_id: str, step_id: int, *, now: datetime) -> None:
    """Close a job its final step could not finish (it has a receipt already, or a final
    state): the step ``failed`` and, unless final already, the job ``failed``, so that no
    executor claims its final step again and nobody waits on it for ever. The receipt found is
    left as it is (whoever reads it verifies its signature)."""
    row = _step_row(s, step_id)
    if row.state not in TERMINAL_STEP_STATES:
        row.state = PurgeState.FAILED
        row.detail = {**(row.detail or {}), "error": "the job was finished already"}
        row.finished_at = now
    job = s.get(PurgeJob, job_id, with_for_update=True)
    if job is not None and job.state not in TERMINAL_STEP_STATES:
        job.state = PurgeState.FAILED
        job.updated_at = now
        job.finished_at = now


def finish_job(
    s: Session,
    job_id: str,
    *,
    state: PurgeState,
    result: dict[str, Any],
    receipt: dict[str, Any],
    signature: bytes,
    now: datetime,
) -> None:
    """Set the job's final state and store its signed receipt, once.

    A job with a receipt (the runtime role may INSERT receipts, never UPDATE or DELETE them) or
    a final state is finished: a second finish, e.g. of a job whose rows were reopened so that
    its final step ran again over edited steps, raises instead of overwriting its state.
    """
    job = s.get(PurgeJob, job_id, with_for_update=True)
    if job is None:  # pragma: no cover
        raise NotFoundError(f"no purge job {job_id}")
    if job.state in TERMINAL_STEP_STATES or s.get(PurgeReceipt, job_id) is not None:
        raise PurgeError(f"purge {job_id} is already finished ({job.state}); not finished again")
    job.state = state
    job.result = result
    job.updated_at = now
    job.finished_at = now
    s.add(PurgeReceipt(job_id=job_id, receipt=receipt, signature=signature, created_at=now))

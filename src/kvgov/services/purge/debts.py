"""The EVICTs a sidecar still owes engines, rebuilt from the ledger when it (re)starts.

An ``engines@S`` step that could not reach an engine hands sidecar S the debt
(:mod:`kvgov.proxy.purge.late`), which S keeps in memory; a restart used to lose it, and the
engine's local tier kept the purged chunks. :func:`proven_debt` finds them again, one job at a
time (:func:`owed_jobs` says which), from what proves itself, not from rows the runtime role may
edit:

- the job's ``engines@S`` step, by its latest chained ``purge:step`` event (on a chain a trusted
  key vouches for, :func:`~kvgov.ledger.purge_trail.chained_steps`): the engines it names
  unreachable and when it ran. The ``purge_steps`` and ``purge_jobs`` rows only say which jobs
  to look at; the row's detail may only take an engine off (one it says answered with an error,
  which is not owed: :data:`~kvgov.services.purge.steps.UNANSWERED`), never add one;
- the digests: the purge's chained ``kv:delete`` events
  (:func:`~kvgov.ledger.purge_trail.purged_digests`), the entries its tier steps deleted. The
  step sent the digests of every entry in scope, so an entry an earlier purge had already
  deleted (its own debt names it) is not in the rebuilt one;
- minus the engines another ``engines`` step of the job acknowledged with the same EVICT
  (:mod:`kvgov.services.purge.reached`), those a chained ``purge:evict:late`` event recorded
  after the step shows reached, the ``lm://`` engine, and steps older than the debts' lifetime
  (``purge.pending_evict_ttl_s``).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from kvgov.db.models import PurgeJob, PurgeStep
from kvgov.db.purge_views import StepName
from kvgov.ledger.purge_trail import (
    ChainedStep,
    StepKey,
    chained_steps,
    late_evictions,
    purged_digests,
)
from kvgov.services.purge.documents import EnginesDetail, read_detail
from kvgov.services.purge.scope import LM_PRINCIPAL
from kvgov.services.purge.steps import UNANSWERED


@dataclass(frozen=True, slots=True)
class ProvenDebt:
    """EVICT(``digests``) of purge ``job_id`` (tenant ``tenant``), owed to ``engines`` since
    its ``engines@S`` step ran (``stepped_at``, the chained event's time)."""

    job_id: str
    tenant: str
    engines: tuple[str, ...]
    digests: tuple[str, ...]
    stepped_at: datetime


def _aware(at: datetime) -> datetime:
    """``at`` in UTC (SQLite hands back naive timestamps, written in UTC)."""
    return at if at.tzinfo is not None else at.replace(tzinfo=UTC)


@dataclass(frozen=True, slots=True)
class OwedJob:
    """A job whose ``engines@S`` step may still owe engines (where to look: nothing is owed
    until the chain says so)."""

    job_id: str
    tenant: str


def owed_jobs(
    s: Session, sidecar_id: str, *, now: datetime, max_age_s: float, job_window_s: float
) -> list[OwedJob]:
    """The jobs, oldest first, created within ``max_age_s + job_window_s`` of ``now`` that
    have an ``engines@S`` step of ``sidecar_id`` (see :func:`proven_debt`). Ids and tenants
    only: a step's ``detail`` is read in its own job's guard (one forged row, a JSON value
    nested thousands deep, hid every debt when all were read at once: review r14, F2)."""
    since = _aware(now) - timedelta(seconds=max_age_s + job_window_s)
    rows = s.execute(
        select(PurgeStep.job_id, PurgeJob.tenant)
        .join(PurgeJob, PurgeJob.id == PurgeStep.job_id)
        .where(
            PurgeStep.name == str(StepName.ENGINES),
            PurgeStep.sidecar_id == sidecar_id,
            PurgeJob.created_at >= since,
        )
        .order_by(PurgeJob.created_at, PurgeStep.job_id)
    )
    return [OwedJob(job_id, tenant) for job_id, tenant in rows]


def _stored_detail(s: Session, job_id: str, sidecar_id: str) -> object:
    """The stored detail of the job's ``engines@S`` step (None: no such row now)."""
    return s.execute(
        select(PurgeStep.detail).where(
            PurgeStep.job_id == job_id,
            PurgeStep.name == str(StepName.ENGINES),
            PurgeStep.sidecar_id == sidecar_id,
        )
    ).scalar()


def _answered_with_error(stored: object) -> set[str]:
    """The engines the step's row says answered EVICT with an error (not owed anything)."""
    if not isinstance(stored, Mapping):
        return set()
    try:
        detail = read_detail(StepName.ENGINES, dict(stored))
    except ValueError:  # pydantic's ValidationError: not a detail any executor writes
        return set()
    if not isinstance(detail, EnginesDetail):
        return set()
    return {u.engine for u in detail.unreachable if u.error not in UNANSWERED}


def _named(event: ChainedStep, key: str) -> set[str]:
    """The engine names the chained summary lists under ``key``."""
    names = (event.summary or {}).get(key)
    return {n for n in names if isinstance(n, str)} if isinstance(names, list) else set()


def _reached_elsewhere(event: ChainedStep, chained: Mapping[StepKey, ChainedStep]) -> set[str]:
    """The engines another ``engines`` step of the job acknowledged with the same EVICT (the
    same chained ``digests_hash``)."""
    mine = (event.summary or {}).get("digests_hash")
    if not isinstance(mine, str):
        return set()
    reached: set[str] = set()
    for other in chained.values():
        if other.step != str(StepName.ENGINES) or other.sidecar_id == event.sidecar_id:
            continue
        if (other.summary or {}).get("digests_hash") == mine:
            reached |= _named(other, "acknowledged")
    return reached


def _debt(
    s: Session,
    job_id: str,
    tenant: str,
    stored: object,
    *,
    sidecar_id: str,
    trusted: Collection[bytes],
    window: tuple[datetime, datetime],
) -> ProvenDebt | None:
    """What the ``engines@S`` step of one job still owes, when the chain proves it."""
    chained = chained_steps(s, job_id, tenant, trusted)
    event = chained.get((str(StepName.ENGINES), sidecar_id))
    if event is None or event.occurred_at is None:
        return None
    stepped_at = _aware(event.occurred_at)
    oldest, before = window
    if not oldest < stepped_at < before:
        return None  # past the debts' lifetime, or this process's own step (it holds that)
    owed = {e for e in _named(event, "unreachable") if not e.startswith(LM_PRINCIPAL)}
    owed -= _answered_with_error(stored)
    owed -= _reached_elsewhere(event, chained)
    if not owed:
        return None
    owed -= {
        late.engine
        for late in late_evictions(s, job_id, tenant, trusted)
        if _aware(late.recorded_at) >= stepped_at
    }
    digests = purged_digests(s, job_id, tenant, trusted) if owed else []
    if not digests:
        return None
    return ProvenDebt(job_id, tenant, tuple(sorted(owed)), tuple(digests), stepped_at)


def proven_debt(
    s: Session,
    job: OwedJob,
    *,
    sidecar_id: str,
    trusted: Collection[bytes],
    now: datetime,
    max_age_s: float,
    before: datetime,
) -> ProvenDebt | None:
    """What sidecar ``sidecar_id``'s ``engines`` step of ``job`` still owes engines (see the
    module docstring), when the chain proves it: a step chained within ``max_age_s`` of
    ``now`` and before ``before`` (when this process started: it holds what its own steps
    owe). One job at a time, so that a job whose rows cannot be read costs only itself."""
    window = (_aware(now) - timedelta(seconds=max_age_s), _aware(before))
    stored = _stored_detail(s, job.job_id, sidecar_id)
    return _debt(
        s, job.job_id, job.tenant, stored, sidecar_id=sidecar_id, trusted=trusted, window=window
    )

"""Read queries over purge jobs and data keys, for the compliance API and the dashboard.

The same conventions as :mod:`kvgov.ledger.queries_api`: a :class:`Session` in, ORM rows or
small frozen records out, nothing written or committed, keyset pagination (``after`` is the sort
key of the last row the caller has; ask for ``limit + 1`` rows to learn whether a next page
exists), and a ``None`` filter is not applied.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func, select, tuple_
from sqlalchemy.orm import Session

from kvgov.db.models import DataKey, PurgeJob, PurgeReceipt, PurgeStep
from kvgov.types import KeyState, PurgeKind, PurgeState

# -- purges -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PurgeRow:
    """A purge job as the list endpoint and the dashboard show it."""

    job: PurgeJob
    #: the stored signed receipt document (``{"receipt", "signature"}``), None until finished
    receipt: dict[str, Any] | None
    steps_by_state: dict[str, int]


def list_purges(
    session: Session,
    *,
    tenant: str | None = None,
    state: PurgeState | None = None,
    kind: PurgeKind | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    after: tuple[datetime, str] | None = None,
    limit: int = 50,
) -> list[PurgeRow]:
    """Purge jobs, newest first, with their receipts and how many steps are in each state."""
    query = select(PurgeJob, PurgeReceipt.receipt).outerjoin(
        PurgeReceipt, PurgeReceipt.job_id == PurgeJob.id
    )
    if tenant is not None:
        query = query.where(PurgeJob.tenant == tenant)
    if state is not None:
        query = query.where(PurgeJob.state == state)
    if kind is not None:
        query = query.where(PurgeJob.kind == kind)
    if since is not None:
        query = query.where(PurgeJob.created_at >= since)
    if until is not None:
        query = query.where(PurgeJob.created_at < until)
    if after is not None:
        query = query.where(tuple_(PurgeJob.created_at, PurgeJob.id) < after)
    query = query.order_by(PurgeJob.created_at.desc(), PurgeJob.id.desc()).limit(limit)
    rows = list(session.execute(query))
    steps: dict[str, dict[str, int]] = defaultdict(dict)
    if rows:
        counted = (
            select(PurgeStep.job_id, PurgeStep.state, func.count())
            .where(PurgeStep.job_id.in_([job.id for job, _ in rows]))
            .group_by(PurgeStep.job_id, PurgeStep.state)
        )
        for job_id, step_state, count in session.execute(counted):
            steps[job_id][str(step_state)] = int(count)
    return [
        PurgeRow(job=job, receipt=receipt, steps_by_state=steps.get(job.id, {}))
        for job, receipt in rows
    ]


# -- data keys --------------------------------------------------------------------------------


def list_keys(
    session: Session,
    *,
    tenant: str | None = None,
    user: str | None = None,
    state: KeyState | None = None,
    after: tuple[str, int] | None = None,
    limit: int = 50,
) -> list[DataKey]:
    """Data key versions ordered by key id and version. ``user`` is a pseudonym. Callers must
    not show ``wrapped`` (the API's schema has no such field)."""
    query = select(DataKey)
    if tenant is not None:
        query = query.where(DataKey.tenant == tenant)
    if user is not None:
        query = query.where(DataKey.user == user)
    if state is not None:
        query = query.where(DataKey.state == state)
    if after is not None:
        query = query.where(tuple_(DataKey.key_id, DataKey.version) > after)
    query = query.order_by(DataKey.key_id, DataKey.version)
    return list(session.scalars(query.limit(limit)))

"""A restarted sidecar owes engines again what its earlier purge steps still owe them.

:func:`restore_owed` runs in the background from the sidecar's start (an engine that connects
meanwhile is sent its debt once restored). It reads which jobs to look at (ids only), retried
every ``retry_s`` until the ledger can be read, then each job's debt as the chain proves it
(:func:`kvgov.services.purge.debts.proven_debt`), in a transaction and a guard of its own: a job
that cannot be read, whatever the error, is logged by the error's type and counted, tried again
at the next round (up to :data:`JOB_TRIES` rounds) and costs no other job its debt. One forged
``purge_steps`` row used to end the whole restore at every start, hiding every debt of the
sidecar (review r14, F2). Each round's debts are restored at once
(:meth:`LateEvictions.restore <kvgov.proxy.purge.late.LateEvictions.restore>`), oldest step
first; a job restored is never read again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Protocol

from kvgov.db.engine import utcnow
from kvgov.logging import get_logger

if TYPE_CHECKING:
    from kvgov.proxy.purge.late import LateEvictions
    from kvgov.services.purge.debts import OwedJob, ProvenDebt

log = get_logger(__name__)

#: rounds a job's debt is tried (a database that cannot be read at all fails the job list
#: first, which is tried until it can)
JOB_TRIES = 3


class _Debts(Protocol):  # the sidecar's PurgeService
    async def owed_jobs(self, sidecar_id: str) -> list[OwedJob]: ...

    async def owed_eviction(
        self, sidecar_id: str, job: OwedJob, *, before: datetime
    ) -> ProvenDebt | None: ...


async def restore_owed(
    debts: _Debts,
    late: LateEvictions,
    *,
    sidecar_id: str,
    before: datetime,
    retry_s: float,
    on_error: Callable[[Exception], None],
) -> None:
    """Owe again what ``sidecar_id``'s steps that ran before ``before`` still owe (see the
    module docstring); ``on_error`` is told of each failure."""
    jobs = await _owed_jobs(debts, sidecar_id, retry_s, on_error)
    tries = dict.fromkeys(jobs, 0)
    while True:
        found = []
        for job in list(tries):
            try:
                debt = await debts.owed_eviction(sidecar_id, job, before=before)
            except Exception as exc:  # noqa: BLE001 - one job's failure costs that job only
                tries[job] += 1
                _job_failed(job, exc, given_up=tries[job] >= JOB_TRIES)
                on_error(exc)
                if tries[job] >= JOB_TRIES:
                    del tries[job]
                continue
            del tries[job]
            if debt is not None:
                found.append(debt)
        late.restore(sorted(found, key=lambda d: d.stepped_at), now=utcnow())
        if not tries:
            return
        await asyncio.sleep(retry_s)


async def _owed_jobs(
    debts: _Debts, sidecar_id: str, retry_s: float, on_error: Callable[[Exception], None]
) -> list[OwedJob]:
    """Which jobs to look at, read again every ``retry_s`` until the ledger can be read."""
    while True:
        try:
            return await debts.owed_jobs(sidecar_id)
        except Exception as exc:  # noqa: BLE001 - by its type only: a message may quote data
            log.warning("purge.late_evict.restore_failed", extra={"error": type(exc).__name__})
            on_error(exc)
        await asyncio.sleep(retry_s)


def _job_failed(job: OwedJob, exc: Exception, *, given_up: bool) -> None:
    log.warning(
        "purge.late_evict.restore_job_failed",
        extra={"purge_id": job.job_id, "error": type(exc).__name__, "given_up": given_up},
    )

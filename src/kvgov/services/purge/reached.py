"""An engine one ``engines@S`` step could not reach, acknowledged by another step of the job.

Each ``engines@S`` answers for the engines that held the purge's data through sidecar S, and
sends EVICT to every engine connected to S that may hold the tenant's data. An engine that
moved from S to T (a reschedule, a rollout) is named ``unreachable`` by ``engines@S`` (no
control connection there) and acknowledged by ``engines@T``: the receipt said ``incomplete``
although the engine evicted.

:func:`count_acks_elsewhere` reads such an engine as reached when the ACK covered the same
EVICT: another ``engines`` step of the job acknowledged by it whose ``digests_hash`` (the hash
of the digests it sent, chained in its ``purge:step`` summary) equals this step's. Only an
engine that was sent nothing or whose EVICT went unanswered (:data:`~kvgov.services.purge.
steps.UNANSWERED`) is taken off: one that answered with an error said it cannot evict. A step
that has no hash (written before it) is matched with nothing. The receipt is built from the job
after its cross-check (:mod:`kvgov.services.purge.trail`), so a step whose row the chain does
not bear out lends no ACK; the rows themselves are not changed (the step's own record keeps
what it saw).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from kvgov.db.purge_views import JobView, StepName, StepView
from kvgov.services.purge.documents import EngineAnswer, EnginesDetail, read_detail
from kvgov.services.purge.steps import UNANSWERED, not_acknowledged
from kvgov.types import PurgeState

#: a step of the job: its label (``engines@S``)
_Label = str


def _engines_details(job: JobView) -> dict[_Label, EnginesDetail]:
    """The ``engines`` steps that ran (their typed detail), by label."""
    found: dict[_Label, EnginesDetail] = {}
    for step in job.steps:
        if step.name is not StepName.ENGINES:
            continue
        detail = read_detail(step.name, step.detail)
        if isinstance(detail, EnginesDetail):
            found[step.label] = detail
    return found


def acked_elsewhere(
    label: _Label, detail: EnginesDetail, others: Mapping[_Label, EnginesDetail]
) -> set[str]:
    """The engines another step of ``others`` acknowledged with the same EVICT as ``label``'s."""
    if detail.digests_hash is None:
        return set()
    return {
        engine
        for other, d in others.items()
        if other != label and d.digests_hash == detail.digests_hash
        for engine in d.acknowledged
    }


def still_missing(missing: Sequence[EngineAnswer], reached: set[str]) -> tuple[EngineAnswer, ...]:
    """``missing`` without the unanswered engines another step reached with the same EVICT."""
    return tuple(a for a in missing if not (a.error in UNANSWERED and a.engine in reached))


def count_acks_elsewhere(job: JobView) -> JobView:
    """``job`` with each ``engines@S`` step's unreachable engines that another step of the job
    reached with the same EVICT taken off (see the module docstring); a step left with none is
    read as ``completed``. A job where none is returns as it was (its receipt unchanged)."""
    details = _engines_details(job)
    steps: list[StepView] = []
    changed = False
    for step in job.steps:
        detail = details.get(step.label)
        if detail is None or step.state is not PurgeState.INCOMPLETE:
            steps.append(step)
            continue
        left = still_missing(detail.unreachable, acked_elsewhere(step.label, detail, details))
        if len(left) == len(detail.unreachable):
            steps.append(step)
            continue
        changed = True
        read = detail.model_copy(update={"unreachable": left, "reason": not_acknowledged(left)})
        steps.append(
            dataclasses.replace(
                step,
                state=PurgeState.INCOMPLETE if left else PurgeState.COMPLETED,
                detail=read.model_dump(mode="json"),
            )
        )
    return dataclasses.replace(job, steps=steps) if changed else job

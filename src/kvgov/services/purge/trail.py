"""The receipt's cross-check: every step it relies on must match its chained ``purge:step``.

A step's row (``purge_steps.state`` and ``.detail``) is mutable: the runtime database role,
which every sidecar holds, may UPDATE it. Its ``purge:step`` event is chained (see
:mod:`kvgov.ledger.purge_trail`). Before the receipt is built and signed, each step that calls
itself done, or whose detail says an executor ran it, must have a chained event with the same
state and the same summary (the event's ``summary`` against the stored detail's ``summary()``).
A step that does not is not done: it is read as ``incomplete`` with a reason naming the
disagreement and none of its stored figures, so the job ends ``incomplete`` and the receipt's
``incomplete`` list names the step. The rows themselves are left as they are (the evidence).
An untampered job passes through unchanged, so its receipt is byte for byte what it was.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass

from pydantic import ValidationError

from kvgov.db.purge_views import JobView, StepView
from kvgov.ledger.chain import normalize_json
from kvgov.ledger.purge_trail import ChainedStep, StepKey
from kvgov.services.purge.documents import read_detail
from kvgov.types import PurgeState

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Disagreement:
    """A step whose stored record the chain does not bear out."""

    label: str
    #: ``no-event``, ``state``, ``summary`` or ``detail`` (unreadable): what differs (no
    #: counts, no ids)
    what: str

    @property
    def reason(self) -> str:
        if self.what == "no-event":
            return "marked as run, but the ledger has no chained purge:step event for it"
        if self.what == "detail":
            return "its stored detail is not one any executor writes"
        return f"its stored {self.what} disagrees with the chained purge:step event"


def _needs_event(step: StepView) -> bool:
    """A step the receipt would take as done, or whose figures it would report."""
    return step.state is PurgeState.COMPLETED or "executed_by" in step.detail


def _disagreement(step: StepView, event: ChainedStep | None) -> Disagreement | None:
    try:
        detail = read_detail(step.name, step.detail)
    except ValidationError:  # no executor wrote that: the receipt is built without it
        return Disagreement(step.label, "detail")
    if not _needs_event(step):
        return None
    if event is None:
        return Disagreement(step.label, "no-event")
    if event.state != str(step.state):
        return Disagreement(step.label, "state")
    summary = normalize_json(detail.summary())
    if event.summary is None or normalize_json(event.summary) != summary:
        return Disagreement(step.label, "summary")
    return None


def cross_check(
    job: JobView, chained: Mapping[StepKey, ChainedStep]
) -> tuple[JobView, list[Disagreement]]:
    """``job`` with every step the chain does not bear out read as ``incomplete`` (see the
    module docstring), and those steps; logs ``purge.receipt.mismatch`` for each."""
    found: list[Disagreement] = []
    steps: list[StepView] = []
    for step in job.steps:
        wrong = _disagreement(step, chained.get((str(step.name), step.sidecar_id)))
        if wrong is None:
            steps.append(step)
            continue
        found.append(wrong)
        log.error(
            "purge.receipt.mismatch",
            extra={"purge_id": job.id, "step": wrong.label, "differs": wrong.what},
        )
        steps.append(
            dataclasses.replace(step, state=PurgeState.INCOMPLETE, detail={"reason": wrong.reason})
        )
    if not found:
        return job, found
    return dataclasses.replace(job, steps=steps), found

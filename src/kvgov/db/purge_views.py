"""Purge vocabulary and the job/step state machine (pure: no I/O).

A job is ``pending`` until an executor claims its first step, ``running`` while steps remain,
and ends ``completed`` (every step done, nothing unreachable) or ``incomplete`` (something could
not be reached or failed; the receipt names it). ``failed`` is kept for a job whose final ledger
step itself could not run.

Steps: ``tiers`` and ``engines`` exist once per registered live sidecar (``sidecar_id`` set) and
once without a sidecar for what any executor reaches from its configuration; ``keys`` and
``gpu`` are global; ``ledger`` (payload erasure, erasure event, checkpoint, receipt) runs last,
once every other step is terminal or the job timed out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from kvgov.types import PurgeKind, PurgeState


class StepName(StrEnum):
    TIERS = "tiers"
    KEYS = "keys"
    ENGINES = "engines"
    GPU = "gpu"
    LEDGER = "ledger"


#: a step's state uses the job vocabulary: ``completed`` (done), ``incomplete`` (ran, but
#: something it had to reach did not answer, or its sidecar never took it: the detail says which),
#: ``failed`` (errored ``MAX_ATTEMPTS`` times)
TERMINAL_STEP_STATES = frozenset({PurgeState.COMPLETED, PurgeState.INCOMPLETE, PurgeState.FAILED})
#: a step is retried this many times after an error before it is marked failed
MAX_ATTEMPTS = 3


@dataclass(frozen=True, slots=True)
class PurgeRequest:
    """What an operator asks for. ``user`` is the raw id: pseudonymised at once, never stored."""

    tenant: str
    user: str | None = None
    dry_run: bool = False
    requested_by: str = "cli"

    @property
    def kind(self) -> PurgeKind:
        return PurgeKind.TENANT if self.user is None else PurgeKind.USER


@dataclass(frozen=True, slots=True)
class CreationBound:
    """What a tenant-scoped admin's ``POST /v1/purges`` is held to (``api.purges_*``): the
    tenant's open jobs, and the jobs its token made in the last :data:`CREATION_WINDOW_S`."""

    open_per_tenant: int
    per_window: int


#: the window ``CreationBound.per_window`` counts a token's creations in (a minute)
CREATION_WINDOW_S = 60.0


@dataclass(frozen=True, slots=True)
class StepPlan:
    name: StepName
    sidecar_id: str | None = None


@dataclass(frozen=True, slots=True)
class StepView:
    """One step as stored. ``detail`` is the stored JSON; its typed reading is
    :func:`kvgov.services.purge.documents.read_detail`."""

    id: int
    name: StepName
    sidecar_id: str | None
    state: PurgeState
    attempts: int
    detail: dict[str, Any]
    started_at: datetime | None
    finished_at: datetime | None

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STEP_STATES

    @property
    def label(self) -> str:
        return f"{self.name}@{self.sidecar_id}" if self.sidecar_id else str(self.name)


@dataclass(frozen=True, slots=True)
class JobView:
    """One job as stored, with its steps and (once finished) its signed receipt."""

    id: str
    kind: PurgeKind
    tenant: str
    subject: str | None
    state: PurgeState
    dry_run: bool
    requested_by: str
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None
    result: dict[str, Any] | None
    steps: list[StepView] = field(default_factory=list)
    receipt: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        return self.state in (PurgeState.COMPLETED, PurgeState.INCOMPLETE, PurgeState.FAILED)


def plan_steps(live_sidecars: list[str]) -> list[StepPlan]:
    """The steps of a new job: global ones plus ``tiers``/``engines``/``gpu`` per live sidecar.

    The GPU prefix-cache reset is each sidecar's own (``gpu@S``): ``purge.vllm_engines`` is
    set per pod, and in the shipped manifests it is the pod's own vLLM on loopback, so a
    single fleet-wide step, taken by whichever executor came first, reset one pod's engine and
    the receipt still said ``completed``. Only with no live sidecar (the CLI alone) is the
    reset one global step, run with the executor's own configuration."""
    sidecars = sorted(set(live_sidecars))
    plans = [StepPlan(StepName.KEYS), StepPlan(StepName.TIERS)]
    if not sidecars:
        plans.append(StepPlan(StepName.GPU))
    for sid in sidecars:
        plans.append(StepPlan(StepName.TIERS, sid))
        plans.append(StepPlan(StepName.ENGINES, sid))
        plans.append(StepPlan(StepName.GPU, sid))
    plans.append(StepPlan(StepName.LEDGER))
    return plans


def ledger_step_ready(
    steps: list[StepView], *, created_at: datetime, now: datetime, timeout_s: float
) -> bool:
    """The final step may run once every other step is terminal or the job has timed out."""
    others = [s for s in steps if s.name is not StepName.LEDGER]
    if all(s.terminal for s in others):
        return True
    return now >= created_at + timedelta(seconds=timeout_s)


def final_state(steps: list[StepView]) -> PurgeState:
    """``completed`` only when every step is done; anything partial/failed/unreachable makes
    the job ``incomplete``."""
    if all(s.state is PurgeState.COMPLETED for s in steps if s.name is not StepName.LEDGER):
        return PurgeState.COMPLETED
    return PurgeState.INCOMPLETE

"""A purge's chained step events, read back for its receipt.

Each purge step that ran chains a ``purge:step`` event: ``attrs`` names the purge, the step and
its sidecar and carries the step detail's ``summary()``; ``reason`` is the state the step ended
in. Those are the facts ``kvgov audit verify`` proves untampered, unlike the mutable
``purge_steps`` rows the runtime database role may UPDATE, so the receipt is checked against
them (:mod:`kvgov.services.purge.trail`). The rows are read the way verification reads them, and
a row whose own hash does not cover its columns is ignored: it proves nothing. Linking to the
rest of the chain (and the chain's seals and checkpoints) stays ``audit verify``'s job.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import String, cast, select
from sqlalchemy.orm import Session

from kvgov.db.models import LedgerEvent
from kvgov.ledger.chain import ChainedFields, link
from kvgov.types import EventKind

#: a step of one job: its name and its sidecar (None: a global step)
StepKey = tuple[str, str | None]


@dataclass(frozen=True, slots=True)
class ChainedStep:
    """What the chain says one step did (its latest attempt's event)."""

    step: str
    sidecar_id: str | None
    #: the state the step ended in (the event's ``reason``)
    state: str | None
    summary: Mapping[str, Any] | None
    attempt: int
    chain_id: str
    seq: int


def _fields(row: LedgerEvent) -> ChainedFields:
    return ChainedFields(
        chain_id=row.chain_id,
        seq=row.seq,
        prev_hash=row.prev_hash,
        occurred_at=row.occurred_at,
        kind=row.kind,
        tenant=row.tenant,
        actor=row.actor,
        request_id=row.request_id,
        key_digest=row.key_digest,
        tier=row.tier,
        nbytes=row.nbytes,
        outcome=row.outcome,
        reason=row.reason,
        decision_id=row.decision_id,
        policy_revision=row.policy_revision,
        principal=row.principal,
        attrs=row.attrs if row.attrs is not None else {},
        payload_digest=row.payload_digest,
        encoding_version=row.encoding_version,
    )


def _like(value: str) -> str:
    return "%" + value.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


def chained_steps(session: Session, purge_id: str, tenant: str) -> dict[StepKey, ChainedStep]:
    """The latest chained ``purge:step`` event of each step of purge ``purge_id``.

    A step retried after its event was chained (its row could not be written) has several;
    the row holds the last attempt's detail, so the last attempt's event is the one to match.
    """
    query = (
        select(LedgerEvent)
        .where(
            LedgerEvent.tenant == tenant,
            LedgerEvent.kind == EventKind.PURGE_STEP.value,
            # a coarse text filter (the index is on tenant and kind); the exact test is below
            cast(LedgerEvent.attrs, String).like(_like(purge_id), escape="\\"),
        )
        .order_by(LedgerEvent.occurred_at, LedgerEvent.chain_id, LedgerEvent.seq)
    )
    found: dict[StepKey, ChainedStep] = {}
    for row in session.scalars(query):
        attrs = row.attrs if isinstance(row.attrs, Mapping) else {}
        if attrs.get("purge_id") != purge_id or link(_fields(row)) != row.hash:
            continue
        sidecar = attrs.get("sidecar_id")
        attempt = attrs.get("attempt")
        summary = attrs.get("summary")
        event = ChainedStep(
            step=str(attrs.get("step")),
            sidecar_id=sidecar if isinstance(sidecar, str) else None,
            state=row.reason,
            summary=summary if isinstance(summary, Mapping) else None,
            attempt=attempt if isinstance(attempt, int) else 0,
            chain_id=row.chain_id,
            seq=row.seq,
        )
        key = (event.step, event.sidecar_id)
        earlier = found.get(key)
        if earlier is None or event.attempt >= earlier.attempt:
            found[key] = event
    return found

"""Decision records for the ledger: one ``policy:decision`` event per recorded decision.

:class:`EventDecisionRecorder` is the :class:`DecisionRecorder` the data plane wires to the
ledger's event sink; the ledger writer inserts the event into ``policy_decisions`` from its
``attrs``. Only pseudonyms, digests and policy vocabulary go into the event: the acting user is
already a keyed-HMAC pseudonym, and the input itself is represented by its digest.

:class:`InMemoryDecisionRecorder` keeps records in a list (tests, ``kvgov policy eval``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from kvgov.errors import LedgerError
from kvgov.ledger.events import Event, EventSink, JSONValue, QueuedEventSink
from kvgov.logging import get_logger
from kvgov.policy.interfaces import Decision, PolicyInput
from kvgov.types import EventKind, Outcome

log = get_logger(__name__)


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None


def decision_event(inp: PolicyInput, decision: Decision) -> Event:
    """The ledger event for one decision."""
    attrs: dict[str, JSONValue] = {
        "decision_id": decision.decision_id,
        "policy_revision": decision.policy_revision,
        "data_revision": decision.data_revision,
        "input_digest": decision.input_digest,
        "allowed": decision.allowed,
        "reasons": list(decision.reasons),
        "tiers": list(decision.tiers),
        "ttl_s": decision.ttl_s,
        "scope": None if decision.scope is None else decision.scope.value,
        "sensitivity": decision.sensitivity,
        "operation": _text(decision.operation) or _text(inp.operation),
        "model": _text(inp.model),
    }
    return Event(
        kind=EventKind.POLICY_DECISION,
        tenant=_text(inp.tenant),
        actor=_text(inp.actor_user),
        request_id=_text(inp.request_id),
        tier=_text(inp.tier),
        outcome=Outcome.ALLOW if decision.allowed else Outcome.DENY,
        reason=decision.reason,
        decision_id=decision.decision_id,
        policy_revision=decision.policy_revision,
        principal=_text(inp.engine),
        attrs=attrs,
    )


class EventDecisionRecorder:
    """Hands decisions to an :class:`EventSink` (the ledger writer).

    With ``durable=False`` (the default) a decision counts as recorded once the writer has
    queued it (into its local journal when it has one, so it survives a crash of the process);
    with ``durable=True`` it waits for the commit. A full queue raises
    :class:`kvgov.errors.LedgerBackpressureError`, which the caching engine turns into a deny
    for allows.
    """

    def __init__(self, sink: EventSink, *, durable: bool = False) -> None:
        self.sink = sink
        self.durable = durable
        # checked once: an isinstance against a runtime Protocol walks its attributes
        self._queued = sink if isinstance(sink, QueuedEventSink) else None

    async def record(self, inp: PolicyInput, decision: Decision) -> None:
        event = decision_event(inp, decision)
        if self.durable:
            await self.sink.append(event)
            return
        if self._queued is not None:  # into the local journal, when there is one
            # nobody awaits it: it shares the next sync (the operation's own, when that one is
            # acknowledged) rather than forcing one of its own
            future = self._queued.submit_queued(event, hold=True)
        else:
            future = self.sink.submit(event)
        future.add_done_callback(_log_failure)


def _log_failure(future: asyncio.Future[Any]) -> None:
    if future.cancelled():
        return
    exc = future.exception()
    if exc is not None:
        code = exc.code if isinstance(exc, LedgerError) else type(exc).__name__
        log.error("policy.decision_record_failed", extra={"error": code})


class InMemoryDecisionRecorder:
    """Keeps ``(input, decision)`` pairs in a list."""

    def __init__(self) -> None:
        self.records: list[tuple[PolicyInput, Decision]] = []

    async def record(self, inp: PolicyInput, decision: Decision) -> None:
        self.records.append((inp, decision))

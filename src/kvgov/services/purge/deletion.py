"""The one deletion path: remove entries from tiers, verify, record the change in the ledger.

A purge's tier step, TTL expiry and tenant retention all call :func:`delete_entries`, so every
way data leaves kvgov is deleted, verified absent and recorded the same way (one ledger event per
entry with its :class:`EntryChange`, applied by the ledger writer in the event's transaction).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass

from kvgov.errors import LedgerBackpressureError, TierError
from kvgov.ledger.events import Appended, EntryChange, Event, EventSink, JSONValue
from kvgov.services.purge.ports import TierSet, TierSweep
from kvgov.services.purge.scope import ScopedEntry
from kvgov.types import EntryState, EventKind, Outcome


@dataclass(frozen=True, slots=True)
class DeletionResult:
    sweep: TierSweep
    #: entries whose ledger state changed (or that a tier here still held)
    recorded: int


async def emit_all(sink: EventSink, events: Sequence[Event]) -> list[Appended]:
    """Queue every event, then wait until all are durable (waiting for room when full)."""
    futures: list[Awaitable[Appended]] = []
    for event in events:
        try:
            futures.append(sink.submit(event))
        except LedgerBackpressureError:
            futures.append(sink.append(event))
    return list(await asyncio.gather(*futures))


async def delete_entries(
    tiers: TierSet,
    sink: EventSink,
    entries: Sequence[ScopedEntry],
    *,
    tenant_of: Mapping[str, str | None] | None = None,
    tenant: str | None = None,
    new_state: EntryState,
    kind: EventKind,
    reason: str,
    principal: str,
    attrs: Mapping[str, JSONValue] | None = None,
) -> DeletionResult:
    """Delete ``entries`` from every tier in ``tiers``, verify they are gone, and record one
    event per entry that changed state (or was still held here). Raises :class:`TierError`
    when a backend failed (the caller retries); absence that could not be verified is reported
    in the result's ``sweep.still_present``."""
    sweep = await tiers.delete_all([e.key_digest for e in entries])
    if sweep.errors:
        failures = "; ".join(f"{k}: {v}" for k, v in sweep.errors.items())
        raise TierError("tier delete failed: " + failures)
    removed = sweep.removed_keys
    changed = [e for e in entries if e.state is not new_state or e.key_digest in removed]
    extra = dict(attrs or {})
    events = [
        Event(
            kind=kind,
            tenant=(tenant_of or {}).get(e.key_digest, tenant),
            key_digest=e.key_digest,
            principal=principal,
            outcome=Outcome.OK,
            reason=reason,
            attrs={**extra, "removed_here": e.key_digest in removed},
            entry=EntryChange(key_digest=e.key_digest, state=new_state),
        )
        for e in changed
    ]
    await emit_all(sink, events)
    return DeletionResult(sweep=sweep, recorded=len(changed))

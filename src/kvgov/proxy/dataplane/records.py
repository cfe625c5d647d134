"""The ledger events the data plane writes about entries: put, gone (deleted/expired), evicted.

Each carries the :class:`~kvgov.ledger.events.EntryChange` that keeps the ledger's entry index
in step with the tiers, so the index explains every entry the tiers hold or dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from kvgov.ledger.events import EntryChange, Event
from kvgov.policy.interfaces import Decision
from kvgov.types import EntryState, EventKind, Outcome, Sensitivity

if TYPE_CHECKING:
    from kvgov.proxy.dataplane.identity import Who
    from kvgov.proxy.dataplane.index import EntryMeta

_SENSITIVITIES = frozenset(s.value for s in Sensitivity)


def put_event(
    make: Callable[..., Event],
    who: Who,
    decision: Decision,
    entry: EntryMeta,
    written: tuple[str, ...],
) -> Event:
    """``kv:put`` with the entry as it now lives in ``written``."""
    sens = entry.sensitivity if entry.sensitivity in _SENSITIVITIES else None
    return make(
        EventKind.KV_PUT,
        who,
        tier=",".join(written),
        nbytes=entry.size,
        outcome=Outcome.OK,
        decision_id=decision.decision_id,
        policy_revision=decision.policy_revision,
        entry=EntryChange(
            key_digest=who.digest,
            state=EntryState.LIVE,
            tenant=entry.tenant,
            owner=entry.owner,
            scope_user=entry.scope_user,
            scope=entry.scope,
            sensitivity=Sensitivity(sens) if sens else None,
            model=entry.model,
            size=entry.size,
            tiers=written,
            key_id=entry.key_id,
            key_version=entry.key_version,
            expires_at=datetime.fromtimestamp(entry.expires_at, UTC) if entry.expires_at else None,
            request_id=who.ctx.request_id,
            decision_id=decision.decision_id,
            policy_revision=decision.policy_revision,
        ),
    )


def entry_gone(event: Event, state: EntryState) -> Event:
    """The event with the entry-index change that marks its key ``state`` (deleted/expired)."""
    digest = event.key_digest or ""
    return replace(event, entry=EntryChange(key_digest=digest, state=state))


def evict_event(digest: str, entry: EntryMeta, tier: str, remaining: tuple[str, ...]) -> Event:
    """``kv:evict``: ``tier`` dropped the entry to make room. It stays live in ``remaining``
    (its index row lists only those tiers); with none left it is gone (state ``deleted``)."""
    state = EntryState.LIVE if remaining else EntryState.DELETED
    return Event(
        kind=EventKind.KV_EVICT,
        tenant=entry.tenant,
        key_digest=digest,
        tier=tier,
        nbytes=entry.size,
        outcome=Outcome.OK,
        reason="capacity",
        entry=EntryChange(key_digest=digest, state=state, tiers=remaining),
    )

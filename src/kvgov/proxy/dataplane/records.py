"""The ledger events the data plane writes, and how it hands them to the event sink.

:func:`op_event` builds an operation's event (who, what, the request); :class:`Recorder` records
it: durably (a put, a delete, a denial of a put: the caller waits for it), lazily (a get, a
miss: nothing waits, a sink that can may hold it back briefly to commit it with others), queued
(a ``kv:put``: its ack waits for what :meth:`Recorder.queue` returns) or in the background
(:meth:`Recorder.note`, :meth:`Recorder.soon`: a kept put, an eviction, a denial summary).

The entry events (put, gone: deleted/expired, evicted) carry the
:class:`~kvgov.ledger.events.EntryChange` that keeps the ledger's entry index in step with the
tiers, so the index explains every entry the tiers hold or dropped. The orphan deletions of a
start or of a shared tier's periodic pass (:func:`orphan_event`, :func:`orphans_event`) carry
none: their entries are gone already.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from kvgov.errors import KvgovError, LedgerBackpressureError
from kvgov.ledger.events import EntryChange, Event, EventSink, LazyEventSink, QueuedEventSink
from kvgov.policy.interfaces import Decision
from kvgov.types import EntryState, EventKind, Outcome, Sensitivity

if TYPE_CHECKING:
    from kvgov.proxy.dataplane.identity import Who
    from kvgov.proxy.dataplane.index import EntryMeta

log = logging.getLogger("kvgov.dataplane")

_SENSITIVITIES = frozenset(s.value for s in Sensitivity)


def op_event(kind: EventKind, who: Who, **fields: Any) -> Event:
    """An event about ``who``'s operation (tenant, actor, request, key digest, principal)."""
    return Event(
        kind=kind,
        tenant=who.tenant,
        actor=who.actor,
        request_id=who.ctx.request_id,
        key_digest=who.digest,
        principal=who.identity.principal,
        **fields,
    )


class Recorder:
    """Hands the data plane's events to its event sink (see the module docstring)."""

    def __init__(self, sink: EventSink) -> None:
        self.sink = sink
        self._background: set[asyncio.Task[None]] = set()

    @property
    def sink(self) -> EventSink:
        """Where events go."""
        return self._sink

    @sink.setter
    def sink(self, sink: EventSink) -> None:
        self._sink = sink
        # the sink when it can hold events back (an isinstance check against a runtime
        # Protocol walks its attributes: once here, not per event)
        self._lazy_sink = sink if isinstance(sink, LazyEventSink) else None
        self._queued_sink = sink if isinstance(sink, QueuedEventSink) else None

    async def record(self, event: Event, *, durable: bool) -> None:
        if durable:
            await self.sink.append(event)
            return
        try:
            self.submit_lazy(event)
        except KvgovError:  # queue full: wait for room rather than drop the record
            await self.sink.append(event)

    def submit_lazy(self, event: Event) -> None:
        """Queue an event nothing waits on (a sink that can may hold it back briefly to commit
        it with others; see ``ledger.lazy_max_delay_ms``)."""
        if self._lazy_sink is not None:
            self._lazy_sink.submit_lazy(event)
        else:
            self.sink.submit(event)

    async def record_all(self, events: Sequence[Event]) -> None:
        """Record every event durably: all queued at once (to share commits), then waited for;
        a full queue waits for room (and that event's commit) before queueing the rest."""
        pending: list[Awaitable[Any]] = []
        for event in events:
            try:
                pending.append(self.sink.submit(event))
            except LedgerBackpressureError:
                await self.sink.append(event)
        if pending:
            await asyncio.gather(*pending)

    def note(self, event: Event, unrecorded: str = "dataplane.event.unrecorded") -> None:
        """Queue an event nothing waits on; a full queue records it as soon as there is room
        (:meth:`soon`); any other failure is logged as ``unrecorded``."""
        try:
            self.submit_lazy(event)
        except LedgerBackpressureError:  # record it as soon as there is room
            self.soon(event)
        except KvgovError as exc:
            log.error(unrecorded, extra={"error": exc.code})

    async def queue(self, event: Event, *, hold: bool = False) -> Awaitable[Any]:
        """Queue ``event``; returns what resolves once it is durable (``hold``: more follow
        right behind it, see ``QueuedEventSink``). A full queue is backpressure: wait here (in
        order) until the event is written."""
        try:
            if self._queued_sink is not None:  # acknowledged once journaled
                return self._queued_sink.submit_queued(event, hold=hold)
            return self.sink.submit(event)
        except LedgerBackpressureError:
            done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            done.set_result(await self.sink.append(event))
            return done

    def soon(self, event: Event) -> None:
        """Record ``event`` durably in the background (:meth:`recorded` waits for it)."""
        task = asyncio.get_running_loop().create_task(self._later(event))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _later(self, event: Event) -> None:
        try:
            await self.record(event, durable=True)
        except KvgovError as exc:
            log.error("dataplane.event.unrecorded", extra={"error": exc.code})

    async def recorded(self, timeout_s: float = 10.0) -> None:
        """Wait (at most ``timeout_s``) for the events being recorded in the background
        (denial summaries of closed connections, ...): before the ledger writer closes."""
        if self._background:
            await asyncio.wait(list(self._background), timeout=timeout_s)


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


#: ``reason`` of the ``kv:delete`` of a value found at start that no live entry names
ORPHAN = "orphan"


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    """What the ledger's entry index (``cache_entries``) says of a key digest."""

    tenant: str | None
    state: EntryState


def orphan_event(
    digest: str,
    tier: str,
    nbytes: int | None,
    known: LedgerEntry | None,
    *,
    removed: bool,
    principal: str | None,
) -> Event:
    """``kv:delete``, reason ``orphan``: at start (or, for a shared tier, in a periodic pass),
    ``tier`` held a value under ``digest`` that no live entry names (purged, deleted or expired
    while this sidecar was down, or without a sidecar sharing the tier), and it was deleted
    (``removed``: a live value was there). The tenant and ``attrs.entry_state`` are what the
    ledger's row says (None: it has no row).

    It carries no entry-index change: a ``purged``, ``deleted`` or ``expired`` row already
    says the entry is gone (rewriting it would lose which); a digest without a row would get
    one, naming no tenant; and a row still ``live`` is past its TTL (the owning chain's
    sweeper expires it through the deletion path) or was put by another sidecar after this
    one loaded its index (live there)."""
    return Event(
        kind=EventKind.KV_DELETE,
        tenant=known.tenant if known is not None else None,
        key_digest=digest,
        tier=tier,
        nbytes=nbytes,
        outcome=Outcome.OK,
        reason=ORPHAN,
        principal=principal,
        attrs={
            "entry_state": str(known.state) if known is not None else None,
            "removed_here": removed,
        },
    )


def orphans_event(tier: str, count: int, nbytes: int, principal: str | None) -> Event:
    """The ``kv:delete`` (reason ``orphan``, no key digest) that counts the orphans deleted
    from ``tier`` past those recorded one event each (``attrs.orphans``; ``nbytes`` their
    total size)."""
    return Event(
        kind=EventKind.KV_DELETE,
        tier=tier,
        nbytes=nbytes,
        outcome=Outcome.OK,
        reason=ORPHAN,
        principal=principal,
        attrs={"orphans": count},
    )

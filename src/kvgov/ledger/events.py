"""What the rest of kvgov hands to the ledger: :class:`Event` and the :class:`EventSink` protocol.

An event is a compliance fact. Its chained part holds only pseudonyms, digests, enums and
counts; anything that may ever have to be erased goes in ``payload``, which the ledger stores
apart from the hash chain (the chain keeps only a salted digest of it).

``entry`` optionally carries the change this event makes to the cache-entry index (created on
put, state changes on evict/delete/expiry/purge); the writer applies it in the same transaction
as the event, so the index and the log never disagree.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol, runtime_checkable

from kvgov.types import EntryState, EventKind, Outcome, Scope, Sensitivity

JSONValue = str | int | float | bool | None | list[Any] | dict[str, Any]


def utcnow() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True, slots=True)
class EntryChange:
    """Create or update a row of the cache-entry index (keyed by ``key_digest``)."""

    key_digest: str
    state: EntryState
    tenant: str | None = None
    #: pseudonym of the user who created the entry
    owner: str | None = None
    #: pseudonym of the user the key is scoped to (the key's ``user`` tag), if any
    scope_user: str | None = None
    scope: Scope | None = None
    sensitivity: Sensitivity | None = None
    model: str | None = None
    size: int | None = None
    tiers: tuple[str, ...] | None = None
    key_id: str | None = None
    key_version: int | None = None
    expires_at: datetime | None = None
    request_id: str | None = None
    decision_id: str | None = None
    policy_revision: str | None = None


@dataclass(frozen=True, slots=True)
class Event:
    """One ledger event. Only ``kind`` is required."""

    kind: EventKind
    tenant: str | None = None
    #: pseudonym of the acting user (never a raw id)
    actor: str | None = None
    request_id: str | None = None
    #: hex digest of the cache key string (see ``kvgov.keys`` / the pipeline for the function)
    key_digest: str | None = None
    tier: str | None = None
    nbytes: int | None = None
    outcome: Outcome | None = None
    reason: str | None = None
    decision_id: str | None = None
    policy_revision: str | None = None
    #: identity of the engine connection or API principal that caused the event
    principal: str | None = None
    #: non-personal details, part of the hash chain
    attrs: Mapping[str, JSONValue] = field(default_factory=dict)
    #: erasable details, stored apart from the chain (only a salted digest is chained)
    payload: Mapping[str, JSONValue] | None = None
    entry: EntryChange | None = None
    occurred_at: datetime = field(default_factory=utcnow)


#: the :class:`Event` fields that hold text (all optional), in the order they are declared
EVENT_TEXT_FIELDS = (
    "tenant",
    "actor",
    "request_id",
    "key_digest",
    "tier",
    "reason",
    "decision_id",
    "policy_revision",
    "principal",
)


@dataclass(frozen=True, slots=True)
class Appended:
    """Where an event landed: its chain and position."""

    chain_id: str
    seq: int


class EventSink(Protocol):
    """Where events go. The ledger's batched writer is the real one."""

    def submit(self, event: Event) -> asyncio.Future[Appended]:
        """Queue an event; the future resolves once it is durable in the database.

        Raises :class:`kvgov.errors.LedgerBackpressureError` when the queue is full.
        """
        ...

    async def append(self, event: Event) -> Appended:
        """Queue an event and wait until it is durable (waiting for room when the queue is full)."""
        ...


@runtime_checkable
class LazyEventSink(EventSink, Protocol):
    """An :class:`EventSink` that can hold back events nothing waits on, to commit them with
    others (the ledger writer: up to ``ledger.lazy_max_delay_ms``)."""

    def submit_lazy(self, event: Event) -> asyncio.Future[Appended]:
        """Queue an event nobody awaits now; the future still resolves once it is durable."""
        ...


@runtime_checkable
class QueuedEventSink(EventSink, Protocol):
    """An :class:`EventSink` that can acknowledge an event once it is *durably queued* (the
    ledger writer with its local journal), before the database has it."""

    def submit_queued(self, event: Event, *, hold: bool = False) -> asyncio.Future[Any]:
        """Queue an event; the future resolves once it is durable locally or committed.
        ``hold``: more acknowledged events follow right behind it (the sink may let it wait
        briefly to make them durable together)."""
        ...


class InMemoryEventSink:
    """An :class:`EventSink` that keeps events in a list: for unit tests of other packages."""

    def __init__(self, chain_id: str = "memory") -> None:
        self.chain_id = chain_id
        self.events: list[Event] = []

    def submit(self, event: Event) -> asyncio.Future[Appended]:
        self.events.append(event)
        fut: asyncio.Future[Appended] = asyncio.get_running_loop().create_future()
        fut.set_result(Appended(self.chain_id, len(self.events)))
        return fut

    async def append(self, event: Event) -> Appended:
        return await self.submit(event)

    def submit_lazy(self, event: Event) -> asyncio.Future[Appended]:
        return self.submit(event)

    def kinds(self) -> list[EventKind]:
        return [e.kind for e in self.events]

"""Data-key management shared by ``kvgov keys`` and ``/v1/keys``: show, rotate, record.

Both edges call these functions so a rotation means the same thing wherever it was asked for:
the keyring retires the active version and creates the next one, and one ``key:rotated`` (or
``key:created`` for a scope's first version) ledger event names the key id and version, the
principal who asked and the user's pseudonym (never the raw id). The caller owns the sink: the
CLI writes on a chain of its own, the API on the sidecar's writer.

A sidecar's keyring also creates and rotates keys on its own (a scope's first sealed chunk, the
usage bound, new data after a shred elsewhere): :class:`KeyEventRecorder` is its ``on_change``
listener and records those with the same :func:`key_event`, handing each to the event loop
without blocking the seal path.

Shredding is deliberately not offered here. Destroying the wrapped data keys alone is half an
erasure: the ciphertext stays in every tier (unreadable, but still counted, listed and
indexed as live), the engines still hold the plaintext KV in their own CPU and GPU caches, and
no receipt says what was done. Over REST the only way to shred is a purge (``POST
/v1/purges``), which shreds *and* deletes from every tier, evicts from every engine, erases the
ledger payloads and signs a receipt. ``kvgov keys shred`` stays an operator's tool.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from kvgov.errors import KvgovError, LedgerBackpressureError
from kvgov.keys.ids import KeyInfo, key_id_for
from kvgov.ledger.events import Appended, Event, EventSink
from kvgov.types import EventKind, Outcome, WrappedKey

log = logging.getLogger(__name__)

#: set while :func:`rotate_key` rotates: the keyring tells its listener in the same thread, and
#: :class:`KeyEventRecorder` leaves that change to the events :func:`rotate_key` returns
_RECORDED_BY_CALLER: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "kvgov_key_change_recorded_by_caller", default=False
)


class KeyRotator(Protocol):
    """What rotation needs: :class:`kvgov.keys.keyring.Keyring` is one."""

    def rotate(self, tenant: str, user: str | None = None) -> KeyInfo: ...

    def next_version(self, tenant: str, user: str | None = None) -> int: ...


@dataclass(frozen=True, slots=True)
class Rotation:
    """A rotation done: the new version and the ledger events still to record (none when
    the event :func:`planned_rotation` gave, recorded beforehand, names it)."""

    key: KeyInfo
    events: list[Event]


def key_record(key: KeyInfo) -> dict[str, Any]:
    """What may be shown about a key version (JSON-ready): never material, not even wrapped."""
    return {
        "key_id": key.key_id,
        "version": key.version,
        "tenant": key.tenant,
        "user": key.user,
        "state": str(key.state),
        "usage_count": key.usage_count,
        "kek_id": key.kek_id,
        "created_at": key.created_at.isoformat(),
        "destroyed_at": key.destroyed_at.isoformat() if key.destroyed_at else None,
    }


def key_event(
    kind: EventKind,
    key: KeyInfo,
    subject: str | None,
    *,
    principal: str,
    reason: str,
    outcome: Outcome = Outcome.OK,
) -> Event:
    """The ledger event for one key version created, rotated or shredded (``outcome=ERROR``:
    a change that was asked for and did not happen, or not that anyone saw)."""
    return _event(kind, key.key_id, key.tenant, subject, key.version, principal, reason, outcome)


def _event(  # noqa: PLR0917 - the event's fields, each once
    kind: EventKind,
    key_id: str,
    tenant: str,
    subject: str | None,
    version: int,
    principal: str,
    reason: str,
    outcome: Outcome = Outcome.OK,
) -> Event:
    return Event(
        kind=kind,
        tenant=tenant,
        actor=subject,
        principal=principal,
        outcome=outcome,
        reason=reason,
        attrs={"key_id": key_id, "version": version},
    )


def check_scope(tenant: str, subject: str | None) -> str:
    """The key id of a scope; :class:`~kvgov.errors.KeyManagementError` for names a key id
    cannot hold (empty, ``:``, whitespace, too long)."""
    return key_id_for(tenant, subject)


def _rotation_event(
    key_id: str, tenant: str, subject: str | None, version: int, *, principal: str, reason: str
) -> Event:
    kind = EventKind.KEY_CREATED if version == 1 else EventKind.KEY_ROTATED
    return _event(kind, key_id, tenant, subject, version, principal, reason)


def planned_rotation(
    rotator: KeyRotator, tenant: str, subject: str | None, *, principal: str, reason: str
) -> Event:
    """The event of the rotation :func:`rotate_key` is about to make, to record *before* it
    (as token and tenant changes are): a run whose ledger cannot record then changes nothing.
    Hand it to :func:`rotate_key` as ``recorded``. Blocking (one database read)."""
    key_id = check_scope(tenant, subject)
    version = rotator.next_version(tenant, subject)
    return _rotation_event(key_id, tenant, subject, version, principal=principal, reason=reason)


def rotate_key(
    rotator: KeyRotator,
    tenant: str,
    subject: str | None,
    *,
    principal: str,
    reason: str,
    recorded: Event | None = None,
) -> Rotation:
    """Start a new version of the scope's key (the first one if it has none yet).

    ``subject`` is the user's pseudonym (None: the tenant key). Older versions stay readable
    (retired). ``recorded``: the :func:`planned_rotation` event already in the ledger; the
    returned events are then empty, unless another process rotated in between and this made
    a later version (then its event: the ledger may name a version another process made, it
    never misses one this made). Blocking (database and KEK calls): run it off the event loop.
    """
    key_id = check_scope(tenant, subject)
    token = _RECORDED_BY_CALLER.set(True)  # the returned events record it, not a listener
    try:
        info = rotator.rotate(tenant, subject)
    finally:
        _RECORDED_BY_CALLER.reset(token)
    event = _rotation_event(
        key_id, tenant, subject, info.version, principal=principal, reason=reason
    )
    if recorded is not None and replace(event, occurred_at=recorded.occurred_at) == recorded:
        return Rotation(info, [])
    return Rotation(info, [event])


async def record(sink: EventSink, events: Sequence[Event]) -> list[dict[str, Any]]:
    """Append ``events`` and wait until all are durable; where each landed."""
    done = await asyncio.gather(*(sink.submit(e) for e in events))
    return [{"chain_id": a.chain_id, "seq": a.seq} for a in done]


class KeyEventRecorder:
    """A keyring's ``on_change`` listener on a sidecar: records the versions the keyring created
    by itself (``key:created`` for a scope's first, ``key:rotated`` for an automatic next one)
    on the sidecar's ledger writer, with the key id and version (never material).

    The keyring calls it with its lock held, from whichever thread sealed: it only hands the
    event to the event loop (``call_soon_threadsafe``), which submits it without waiting.
    ``key:shredded`` is not recorded here: a sidecar's keyring shreds only in a purge's key
    step, which records it with the purge job; a rotation asked through :func:`rotate_key`
    (CLI, ``POST /v1/keys/rotate``) is recorded by its caller with the principal who asked.
    """

    REASONS = {EventKind.KEY_CREATED: "first use", EventKind.KEY_ROTATED: "automatic"}

    def __init__(self, sink: EventSink, loop: asyncio.AbstractEventLoop, *, principal: str):
        self._sink = sink
        self._loop = loop
        self._principal = principal
        self._pending: set[asyncio.Future[Appended]] = set()

    def __call__(self, kind: EventKind, row: WrappedKey) -> None:
        reason = self.REASONS.get(kind)
        if reason is None or _RECORDED_BY_CALLER.get():
            return
        event = key_event(
            kind, KeyInfo.of(row), row.user, principal=self._principal, reason=f"sidecar {reason}"
        )
        try:
            self._loop.call_soon_threadsafe(self._submit, event)
        except RuntimeError:  # the loop is closed: the sidecar is gone
            log.error("keys.event.unrecorded", extra={"key_id": row.key_id, "reason": "closed"})

    def _submit(self, event: Event) -> None:
        try:
            fut: asyncio.Future[Appended] = self._sink.submit(event)
        except LedgerBackpressureError:  # wait for room in the background, never drop it
            fut = asyncio.ensure_future(self._sink.append(event))
        except KvgovError as exc:
            log.error("keys.event.unrecorded", extra={"error": exc.code})
            return
        self._pending.add(fut)
        fut.add_done_callback(self._done)

    def _done(self, fut: asyncio.Future[Appended]) -> None:
        self._pending.discard(fut)
        if not fut.cancelled() and fut.exception() is not None:
            log.error("keys.event.unrecorded", extra={"error": type(fut.exception()).__name__})

    async def drain(self) -> None:
        """Wait until every event handed over so far is durable (before closing the writer)."""
        await asyncio.sleep(0)  # the hand-offs queued before this call run first
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)

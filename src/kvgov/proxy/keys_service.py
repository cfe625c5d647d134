"""Data-key management shared by ``kvgov keys`` and ``/v1/keys``: show, rotate, record.

Both edges call these functions so a rotation means the same thing wherever it was asked for:
the keyring retires the active version and creates the next one, and one ``key:rotated`` (or
``key:created`` for a scope's first version) ledger event names the key id and version, the
principal who asked and the user's pseudonym (never the raw id). The caller owns the sink: the
CLI writes on a chain of its own, the API on the sidecar's writer.

Shredding is deliberately not offered here. Destroying the wrapped data keys alone is half an
erasure: the ciphertext stays in every tier (unreadable, but still counted, listed and
indexed as live), the engines still hold the plaintext KV in their own CPU and GPU caches, and
no receipt says what was done. Over REST the only way to shred is a purge (``POST
/v1/purges``), which shreds *and* deletes from every tier, evicts from every engine, erases the
ledger payloads and signs a receipt. ``kvgov keys shred`` stays an operator's tool.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvgov.keys.ids import KeyInfo, key_id_for
from kvgov.ledger.events import Event, EventSink
from kvgov.types import EventKind, Outcome


class KeyRotator(Protocol):
    """What rotation needs: :class:`kvgov.keys.keyring.Keyring` is one."""

    def rotate(self, tenant: str, user: str | None = None) -> KeyInfo: ...


@dataclass(frozen=True, slots=True)
class Rotation:
    """A rotation done: the new version and the ledger events that record it."""

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
    kind: EventKind, key: KeyInfo, subject: str | None, *, principal: str, reason: str
) -> Event:
    """The ledger event for one key version created, rotated or shredded."""
    return Event(
        kind=kind,
        tenant=key.tenant,
        actor=subject,
        principal=principal,
        outcome=Outcome.OK,
        reason=reason,
        attrs={"key_id": key.key_id, "version": key.version},
    )


def check_scope(tenant: str, subject: str | None) -> str:
    """The key id of a scope; :class:`~kvgov.errors.KeyManagementError` for names a key id
    cannot hold (empty, ``:``, whitespace, too long)."""
    return key_id_for(tenant, subject)


def rotate_key(
    rotator: KeyRotator, tenant: str, subject: str | None, *, principal: str, reason: str
) -> Rotation:
    """Start a new version of the scope's key (the first one if it has none yet).

    ``subject`` is the user's pseudonym (None: the tenant key). Older versions stay readable
    (retired). Blocking (database and KEK calls): run it off the event loop.
    """
    check_scope(tenant, subject)
    info = rotator.rotate(tenant, subject)
    kind = EventKind.KEY_CREATED if info.version == 1 else EventKind.KEY_ROTATED
    return Rotation(info, [key_event(kind, info, subject, principal=principal, reason=reason)])


async def record(sink: EventSink, events: Sequence[Event]) -> list[dict[str, Any]]:
    """Append ``events`` and wait until all are durable; where each landed."""
    done = await asyncio.gather(*(sink.submit(e) for e in events))
    return [{"chain_id": a.chain_id, "seq": a.seq} for a in done]

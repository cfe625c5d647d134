"""The in-memory index of live cache entries, and the small envelope stored in the tiers.

The index answers "is this entry live, unexpired and readable by this requester?" without a
database round trip on the data path. It is rebuilt from the ledger's ``cache_entries`` at
startup (the ledger is the source of truth; the index is a cache of it) and updated by the
pipeline as it records puts, deletes and expiries.

Every value stored in a tier is an *envelope*: ``b"KVGE" | u32 meta length | meta JSON |
body``, where the meta holds the engine's per-entry metadata (e.g. LMCache fmt/dtype/shape,
never KV bytes) and whether the body is sealed. The body is the sealed chunk (governed) or the
plain bytes (governance off).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvgov.errors import TierError
from kvgov.types import Scope

ENVELOPE_MAGIC = b"KVGE"
_ENV_HEAD = struct.Struct("<4sI")


@dataclass(slots=True)
class EntryMeta:
    """What the data plane knows about one live entry (keyed by key digest)."""

    tenant: str
    owner: str | None
    scope_user: str | None
    scope: Scope | None
    sensitivity: str | None
    model: str | None
    size: int
    tiers: tuple[str, ...]
    key_id: str | None
    key_version: int | None
    #: absolute expiry, ``time.time()`` seconds; None for none
    expires_at: float | None
    extra: dict[str, Any] = field(default_factory=dict)

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and self.expires_at <= now


class EntryIndex:
    def __init__(self) -> None:
        self._entries: dict[str, EntryMeta] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, digest: str) -> EntryMeta | None:
        return self._entries.get(digest)

    def set(self, digest: str, meta: EntryMeta) -> None:
        self._entries[digest] = meta

    def pop(self, digest: str) -> EntryMeta | None:
        return self._entries.pop(digest, None)

    def expired(self, now: float) -> list[str]:
        return [d for d, e in self._entries.items() if e.expired(now)]

    def items(self) -> Iterable[tuple[str, EntryMeta]]:
        return list(self._entries.items())


def envelope_head(meta: Mapping[str, Any]) -> bytes:
    body = json.dumps(meta, separators=(",", ":")).encode()
    return _ENV_HEAD.pack(ENVELOPE_MAGIC, len(body)) + body


def parse_envelope(value: memoryview) -> tuple[dict[str, Any], int]:
    """The envelope's meta and the offset of its body. Raises :class:`TierError`."""
    if value.nbytes < _ENV_HEAD.size:
        raise TierError("stored value is too short for an envelope")
    magic, meta_len = _ENV_HEAD.unpack_from(value)
    end = _ENV_HEAD.size + meta_len
    if magic != ENVELOPE_MAGIC or end > value.nbytes:
        raise TierError("stored value is not a kvgov envelope")
    try:
        meta = json.loads(bytes(value[_ENV_HEAD.size : end]))
    except ValueError as exc:
        raise TierError("stored envelope meta is not JSON") from exc
    if not isinstance(meta, dict):
        raise TierError("stored envelope meta is not an object")
    return meta, end

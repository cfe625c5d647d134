"""The in-memory index of live cache entries.

The index answers "is this entry live, unexpired and readable by this requester?" without a
database round trip on the data path. It is rebuilt from the ledger's ``cache_entries`` at
startup (the ledger is the source of truth; the index is a cache of it) and updated by the
pipeline as it records puts, deletes and expiries. What a tier stores per entry (the envelope:
length, item metadata, sealed chunk) is :mod:`kvgov.keys.sealformat`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kvgov.types import Scope


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

    @property
    def sealed_with(self) -> tuple[str, int] | None:
        """The key id and version the value was sealed under at put (None: not sealed)."""
        if self.key_id is None or self.key_version is None:
            return None
        return self.key_id, self.key_version


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

"""Where wrapped data keys live: the :class:`WrappedKeyStore` protocol and an in-memory store.

The production store is ``kvgov.db.keystore.SqlKeyStore`` (rows in the ledger database);
it satisfies this protocol structurally, so ``kvgov.keys`` never imports the ledger.
"""

from __future__ import annotations

import threading
from collections.abc import Collection
from dataclasses import replace
from datetime import UTC, datetime
from typing import Protocol

from kvgov.types import KeyState, WrappedKey


class WrappedKeyStore(Protocol):
    def add(self, key: WrappedKey) -> None:
        """Store a new key version. ``(key_id, version)`` must be new."""
        ...

    def get(self, key_id: str, version: int) -> WrappedKey | None:
        """That version, whatever its state (a destroyed one has ``wrapped=None``)."""
        ...

    def latest(self, key_id: str) -> WrappedKey | None:
        """The highest version of ``key_id`` whatever its state, or None if it never existed."""
        ...

    def versions(self, tenant: str | None = None) -> list[WrappedKey]:
        """Every version (of one tenant, or all), ordered by key id and version."""
        ...

    def states(self, key_ids: Collection[str]) -> dict[tuple[str, int], KeyState]:
        """The state of every version of those key ids, in one read (what a keyring checks
        its in-memory copies against: destroyed versions, newer active ones). A version
        without wrapped bytes is reported destroyed whatever its state says."""
        ...

    def set_state(self, key_id: str, version: int, state: KeyState) -> bool:
        """Change a live version's state (``active`` to ``retired``). A destroyed version is
        never changed (a shred racing the caller wins): False then. KeyError if there is no
        such version."""
        ...

    def add_usage(self, key_id: str, version: int, count: int) -> None:
        """Add ``count`` sealed chunks to that version's usage counter."""
        ...

    def destroy(self, tenant: str, user: str | None) -> list[WrappedKey]:
        """Shred: drop the wrapped bytes of every version of that scope (``user=None``: every
        key of the tenant, tenant key and user keys alike) and mark them destroyed.
        Returns the versions destroyed by this call (already destroyed ones are not repeated)."""
        ...


class InMemoryKeyStore:
    """A :class:`WrappedKeyStore` in a dict: for tests and throwaway sidecars."""

    def __init__(self) -> None:
        self._rows: dict[tuple[str, int], WrappedKey] = {}
        self._lock = threading.Lock()

    def add(self, key: WrappedKey) -> None:
        with self._lock:
            if (key.key_id, key.version) in self._rows:
                raise ValueError(f"key {key.key_id} v{key.version} exists")
            self._rows[(key.key_id, key.version)] = key

    def get(self, key_id: str, version: int) -> WrappedKey | None:
        return self._rows.get((key_id, version))

    def latest(self, key_id: str) -> WrappedKey | None:
        versions = [k for (kid, _), k in self._rows.items() if kid == key_id]
        return max(versions, key=lambda k: k.version, default=None)

    def versions(self, tenant: str | None = None) -> list[WrappedKey]:
        rows = [k for k in self._rows.values() if tenant is None or k.tenant == tenant]
        return sorted(rows, key=lambda k: (k.key_id, k.version))

    def states(self, key_ids: Collection[str]) -> dict[tuple[str, int], KeyState]:
        wanted = set(key_ids)
        with self._lock:
            return {
                ident: KeyState.DESTROYED if row.wrapped is None else row.state
                for ident, row in self._rows.items()
                if ident[0] in wanted
            }

    def set_state(self, key_id: str, version: int, state: KeyState) -> bool:
        with self._lock:
            row = self._rows[(key_id, version)]
            if row.state is KeyState.DESTROYED or row.wrapped is None:
                return False
            self._rows[(key_id, version)] = replace(row, state=state)
            return True

    def add_usage(self, key_id: str, version: int, count: int) -> None:
        with self._lock:
            row = self._rows[(key_id, version)]
            self._rows[(key_id, version)] = replace(row, usage_count=row.usage_count + count)

    def destroy(self, tenant: str, user: str | None) -> list[WrappedKey]:
        now = datetime.now(UTC)
        out = []
        with self._lock:
            for ident, row in list(self._rows.items()):
                if row.tenant != tenant or row.state is KeyState.DESTROYED:
                    continue
                if user is not None and row.user != user:
                    continue
                gone = replace(row, state=KeyState.DESTROYED, wrapped=None, destroyed_at=now)
                self._rows[ident] = gone
                out.append(gone)
        return out

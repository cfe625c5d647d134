"""The keyring: versioned data keys per tenant and per (tenant, user), wrapped by the KEK.

Key ids: ``t:<tenant>`` for a tenant's key, ``u:<tenant>:<pseudonym>`` for a user-scoped key
(the caller pseudonymises user ids first). Every version is a row in a
:class:`~kvgov.keys.store.WrappedKeyStore`, wrapped by the :class:`~kvgov.keys.kek.KekProvider`
with AAD ``key_id | version | tenant``. Unwrapped keys live only in memory, in a bounded LRU of
:class:`~kvgov.keys.handle.KeyHandle`\\ s.

Every sealed chunk counts against its key version (counted in memory, added to the store in
batches); once a version reaches ``rotate_after_chunks`` the next :meth:`Keyring.current`
rotates, well before AES-GCM's 2**32 random-nonce bound. :meth:`Keyring.shred` destroys the
wrapped rows and every in-memory copy: data sealed under them can no longer be opened.
:meth:`Keyring.revalidate` catches up with shreds and rotations done by other processes
sharing the store (see :mod:`kvgov.keys.revalidate`); a sidecar runs it every
``keys.revalidate_interval_s``.

Thread-safe: one lock guards the cache and counters; sealing itself runs outside it.
The keyring records no ledger events itself; ``on_change`` hears about created, rotated and
shredded versions so the caller (proxy, CLI, purge) can. It is called with the lock held, in
the thread that sealed, rotated or shredded: a listener hands off and returns at once (it
never blocks and never calls back into the keyring).
"""

from __future__ import annotations

import builtins
import logging
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable
from datetime import UTC, datetime

from kvgov.config import Settings
from kvgov.errors import KeyDestroyedError, KeyManagementError, KeyNotFoundError
from kvgov.keys.handle import DEK_BYTES, KeyHandle
from kvgov.keys.ids import (
    MAX_TENANT_BYTES,
    KeyInfo,
    check_name,
    key_id_for,
    tenant_key_id,
    tenant_of,
    user_key_id,
    wrap_aad,
)
from kvgov.keys.kek import KekProvider, load_kek_provider
from kvgov.keys.revalidate import Revalidation, batches, plan
from kvgov.keys.sealing import Sealing
from kvgov.keys.store import WrappedKeyStore
from kvgov.types import EventKind, KeyState, WrappedKey

log = logging.getLogger(__name__)

__all__ = [
    "KeyInfo",
    "KeyListener",
    "Keyring",
    "Revalidation",
    "key_id_for",
    "tenant_key_id",
    "tenant_of",
    "user_key_id",
]

#: hears ``(KEY_CREATED | KEY_ROTATED | KEY_SHREDDED, the version concerned)``
KeyListener = Callable[[EventKind, WrappedKey], None]


def _live(row: WrappedKey, state: KeyState) -> bool:
    """``row`` is in ``state`` and still has its wrapped bytes (a row without them is
    destroyed, whatever its state column says)."""
    return row.state is state and row.wrapped is not None


class _Entry:
    """A cached key version with its usage: known total and not yet added to the store."""

    __slots__ = ("handle", "pending", "used")

    def __init__(self, handle: KeyHandle, used: int) -> None:
        self.handle = handle
        self.used = used
        self.pending = 0


class Keyring(Sealing):
    """Data keys for every tenant and user scope (see the module docstring)."""

    def __init__(
        self,
        store: WrappedKeyStore,
        kek: KekProvider,
        *,
        cache_max: int = 4096,
        rotate_after_chunks: int = 2**28,
        segment_size: int = 1 << 20,
        usage_batch: int = 1024,
        on_change: KeyListener | None = None,
    ) -> None:
        if cache_max < 1 or rotate_after_chunks < 1 or usage_batch < 1:
            raise ValueError("cache_max, rotate_after_chunks and usage_batch must be positive")
        self._store = store
        self._kek = kek
        self._cache_max = cache_max
        self._rotate_after = rotate_after_chunks
        self.segment_size = segment_size
        self._usage_batch = usage_batch
        self._on_change = on_change
        self._lock = threading.RLock()
        self._cache: OrderedDict[tuple[str, int], _Entry] = OrderedDict()
        self._active: OrderedDict[str, int] = OrderedDict()
        self._dirty: dict[tuple[str, int], _Entry] = {}
        self._pending_total = 0
        self._flush_at = usage_batch

    @classmethod
    def from_settings(
        cls,
        settings: Settings,
        store: WrappedKeyStore,
        kek: KekProvider | None = None,
        *,
        on_change: KeyListener | None = None,
    ) -> Keyring:
        return cls(
            store,
            kek if kek is not None else load_kek_provider(settings),
            cache_max=settings.keys.dek_cache_max,
            rotate_after_chunks=settings.keys.rotate_after_chunks,
            segment_size=settings.keys.segment_size,
            on_change=on_change,
        )

    # -- keys --------------------------------------------------------------------------------

    def current(self, tenant: str, user: str | None = None) -> KeyHandle:
        """The active version for new data of that scope: created on first use, rotated when
        its usage reached the bound."""
        key_id = key_id_for(tenant, user)
        with self._lock:
            version = self._active.get(key_id)
            if version is not None:
                entry = self._cache.get((key_id, version))
                if entry is not None and entry.used < self._rotate_after:
                    self._cache.move_to_end((key_id, version))
                    self._active.move_to_end(key_id)
                    return entry.handle
            row = self._store.latest(key_id)
            if row is None or not _live(row, KeyState.ACTIVE):
                entry = self._create(key_id, tenant, user, row)
            else:
                entry = self._cache.get((key_id, row.version)) or self._load(row)
                if entry.used >= self._rotate_after:
                    log.info("keys.rotate.usage", extra={"key_id": key_id, "used": entry.used})
                    entry = self._rotate_locked(key_id, tenant, user)
            self._set_active(key_id, entry.handle.version)
            return entry.handle

    def get(self, key_id: str, version: int) -> KeyHandle:
        """That version, to open data sealed under it (any state but destroyed)."""
        with self._lock:
            entry = self._cache.get((key_id, version))
            if entry is not None:
                self._cache.move_to_end((key_id, version))
                return entry.handle
            row = self._store.get(key_id, version)
            if row is None:
                raise KeyNotFoundError(f"no data key {key_id} v{version}")
            return self._load(row).handle

    def rotate(self, tenant: str, user: str | None = None) -> KeyInfo:
        """Start a new version for new data; older versions stay readable (retired)."""
        key_id = key_id_for(tenant, user)
        with self._lock:
            entry = self._rotate_locked(key_id, tenant, user)
            self._set_active(key_id, entry.handle.version)
            row = self._store.get(key_id, entry.handle.version)
        if row is None:  # pragma: no cover - the store lost a row it just accepted
            raise KeyManagementError(f"key {key_id} v{entry.handle.version} vanished")
        return KeyInfo.of(row)

    def next_version(self, tenant: str, user: str | None = None) -> int:
        """The version :meth:`rotate` would create now (1 for a scope without a key): what a
        caller records before it rotates. Another process rotating meanwhile moves it on."""
        latest = self._store.latest(key_id_for(tenant, user))
        return 1 if latest is None else latest.version + 1

    def shred(self, tenant: str, user: str | None = None) -> builtins.list[KeyInfo]:
        """Crypto-shred: destroy every version of the scope (``user=None``: every key of the
        tenant, user keys included) in the store and in memory. Returns what was destroyed."""
        check_name("tenant", tenant, MAX_TENANT_BYTES)
        if user is not None:
            user_key_id(tenant, user)
        with self._lock:
            self._flush_locked()
            destroyed = self._store.destroy(tenant, user)
            for ident, entry in list(self._cache.items()):
                handle = entry.handle
                if handle.tenant == tenant and (user is None or handle.user == user):
                    self._uncache_locked(ident)
            for key_id in [k for k in self._active if tenant_of(k) == tenant]:
                if user is None or key_id == user_key_id(tenant, user):
                    del self._active[key_id]
        for row in destroyed:
            log.info("keys.shredded", extra={"key_id": row.key_id, "version": row.version})
            self._notify(EventKind.KEY_SHREDDED, row)
        return [KeyInfo.of(row) for row in destroyed]

    def revalidate(self) -> Revalidation:
        """Catch up with changes made elsewhere (see :mod:`kvgov.keys.revalidate`): drop the
        cached versions destroyed in the store, seal under a newer active version. One store
        read per batch of key ids, outside the lock. Blocking: run it off the event loop."""
        with self._lock:
            cached = builtins.list(self._cache)
            active = dict(self._active)
        states = {}
        for batch in batches({key_id for key_id, _ in cached} | active.keys()):
            states.update(self._store.states(batch))
        todo = plan(cached, active, states)
        fresh = [self._store.get(key_id, version) for key_id, version in todo.renew.items()]
        renewed: builtins.list[tuple[str, int]] = []
        with self._lock:
            for ident in todo.drop:
                self._uncache_locked(ident)
            for key_id in todo.forget:
                if self._active.get(key_id) == active[key_id]:  # not changed here meanwhile
                    del self._active[key_id]
            for row in fresh:
                if row is None or not _live(row, KeyState.ACTIVE):
                    continue  # changed again since: the next seal reads the store
                if self._active.get(row.key_id, 0) < row.version:
                    ident = (row.key_id, row.version)
                    entry = self._cache.get(ident) or self._load(row)
                    self._set_active(row.key_id, entry.handle.version)
                    renewed.append(ident)
        done = Revalidation(len(cached), tuple(todo.drop), tuple(renewed), tuple(todo.forget))
        if done.changed:
            log.info("keys.revalidated", extra={"dropped": done.dropped, "renewed": done.renewed})
        return done

    def list(self, tenant: str | None = None) -> builtins.list[KeyInfo]:
        """Every version (of one tenant, or all) with its state and usage; no material."""
        with self._lock:
            self._flush_locked()
            return [KeyInfo.of(row) for row in self._store.versions(tenant)]

    def flush_usage(self) -> None:
        """Add the usage counted in memory to the store (also done every ``usage_batch``)."""
        with self._lock:
            self._flush_locked()

    def close(self) -> None:
        """Flush usage and drop every in-memory key (call on shutdown)."""
        with self._lock:
            self._flush_locked()
            self._cache.clear()
            self._active.clear()

    # -- internals (call with the lock held) -------------------------------------------------

    def _create(
        self, key_id: str, tenant: str, user: str | None, previous: WrappedKey | None
    ) -> _Entry:
        version = 1 if previous is None else previous.version + 1
        dek = secrets.token_bytes(DEK_BYTES)
        row = WrappedKey(
            key_id=key_id,
            version=version,
            tenant=tenant,
            user=user,
            state=KeyState.ACTIVE,
            wrapped=self._kek.wrap(dek, wrap_aad(key_id, version, tenant)),
            kek_id=self._kek.kek_id,
            created_at=datetime.now(UTC),
        )
        try:
            self._store.add(row)
        except ValueError:
            # another process created that version first: use theirs
            theirs = self._store.get(key_id, version)
            if theirs is None or not _live(theirs, KeyState.ACTIVE):
                raise
            log.info("keys.create.lost_race", extra={"key_id": key_id, "version": version})
            return self._load(theirs)
        entry = self._cache_entry(row, dek)
        kind = EventKind.KEY_CREATED if version == 1 else EventKind.KEY_ROTATED
        log.info("keys.created", extra={"key_id": key_id, "version": version})
        self._notify(kind, row)
        return entry

    def _rotate_locked(self, key_id: str, tenant: str, user: str | None) -> _Entry:
        self._flush_locked()
        latest = self._store.latest(key_id)
        if (
            latest is not None
            and _live(latest, KeyState.ACTIVE)
            and not self._store.set_state(key_id, latest.version, KeyState.RETIRED)
        ):
            # shredded since it was read (the store never changes a destroyed row): drop this
            # process's copy now rather than at the next revalidation
            self._drop_locked((key_id, latest.version))
        return self._create(key_id, tenant, user, latest)

    def _drop_locked(self, ident: tuple[str, int]) -> None:
        """Forget a version destroyed elsewhere: uncached, and no longer the one sealed with."""
        self._uncache_locked(ident)
        if self._active.get(ident[0]) == ident[1]:
            del self._active[ident[0]]

    def _uncache_locked(self, ident: tuple[str, int]) -> None:
        """Destroy a cached version's AES context and drop its unflushed usage (a destroyed
        row takes no more): every later use of the handle raises KeyDestroyedError."""
        entry = self._cache.pop(ident, None)
        if entry is not None:
            entry.handle.destroy()
            if self._dirty.pop(ident, None) is not None:
                self._pending_total -= entry.pending

    def _load(self, row: WrappedKey) -> _Entry:
        if row.state is KeyState.DESTROYED or row.wrapped is None:
            when = f" at {row.destroyed_at.isoformat()}" if row.destroyed_at else ""
            raise KeyDestroyedError(
                f"data key {row.key_id} v{row.version} was destroyed (crypto-shredded){when}",
                hint="data sealed under it is unrecoverable by design",
            )
        dek = self._kek.unwrap(row.wrapped, wrap_aad(row.key_id, row.version, row.tenant))
        return self._cache_entry(row, dek)

    def _cache_entry(self, row: WrappedKey, dek: bytes) -> _Entry:
        cell: builtins.list[_Entry] = []
        handle = KeyHandle(
            row.key_id,
            row.version,
            row.tenant,
            row.user,
            dek,
            on_use=lambda _h: self._count(cell[0]),
        )
        entry = _Entry(handle, row.usage_count)
        cell.append(entry)
        self._cache[(row.key_id, row.version)] = entry
        while len(self._cache) > self._cache_max:
            self._cache.popitem(last=False)
        return entry

    def _set_active(self, key_id: str, version: int) -> None:
        self._active[key_id] = version
        self._active.move_to_end(key_id)
        while len(self._active) > self._cache_max:
            self._active.popitem(last=False)

    def _count(self, entry: _Entry) -> None:
        with self._lock:
            entry.used += 1
            entry.pending += 1
            handle = entry.handle
            self._dirty[(handle.key_id, handle.version)] = entry
            self._pending_total += 1
            if self._pending_total >= self._flush_at:
                try:
                    self._flush_locked()
                except Exception:
                    log.warning("keys.usage.flush_failed", exc_info=True)
                self._flush_at = self._pending_total + self._usage_batch

    def _flush_locked(self) -> None:
        for ident, entry in list(self._dirty.items()):
            if entry.pending:
                self._store.add_usage(ident[0], ident[1], entry.pending)
                self._pending_total -= entry.pending
                entry.pending = 0
            del self._dirty[ident]
        self._pending_total = max(self._pending_total, 0)

    def _notify(self, kind: EventKind, row: WrappedKey) -> None:
        if self._on_change is not None:
            self._on_change(kind, row)

"""The small interfaces the purge steps drive, and their plain implementations.

* :class:`TierSet` deletes a key from every tier of a list of real :class:`Tier` backends
  (the sidecar's chain, or the filesystem/Redis tiers a CLI reaches from its configuration),
  counting per tier and verifying absence afterwards.
* :class:`KeyShredder` is what ``kvgov.keys.keyring.Keyring.shred`` offers (and, without a
  keyring, ``WrappedKeyStore.destroy``).
* :class:`EngineEvictor` tells every connected engine connector to evict keys and waits for the
  acknowledgements; :class:`NoEngines` is the evictor of a process with no engine connections
  (the CLI). A :class:`LateEvictor` (the sidecar's) also keeps an EVICT an engine missed and
  sends it when that engine's control channel is back.
* :class:`Checkpointer` signs the ledger's chain head after each step's ``purge:step`` event
  (before the step is marked finished) and after the erasure event (before the receipt).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from kvgov.connectors.tiers.base import Tier
from kvgov.types import KeyState

#: deletes run this many keys at a time (filesystem deletes go to threads)
DELETE_CONCURRENCY = 64


@dataclass(slots=True)
class TierSweep:
    """What deleting a set of keys from some tiers did."""

    deleted: dict[str, int] = field(default_factory=dict)
    #: digests of the keys that some tier held (the entries actually removed here)
    removed_keys: set[str] = field(default_factory=set)
    #: keys still present after delete (should always be empty), per tier
    still_present: dict[str, list[str]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)

    @property
    def verified(self) -> bool:
        return not self.still_present and not self.errors


class TierSet:
    """Delete keys from a fixed list of tiers and verify they are gone."""

    def __init__(self, tiers: Sequence[Tier]) -> None:
        self.tiers = list(tiers)

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tiers]

    async def delete_all(self, keys: Sequence[str]) -> TierSweep:
        sweep = TierSweep(deleted={t.name: 0 for t in self.tiers})
        sem = asyncio.Semaphore(DELETE_CONCURRENCY)

        async def one(tier: Tier, key: str) -> None:
            async with sem:
                try:
                    if await tier.delete(key):
                        sweep.deleted[tier.name] += 1
                        sweep.removed_keys.add(key)
                    if await tier.contains(key):
                        sweep.still_present.setdefault(tier.name, []).append(key)
                except Exception as exc:  # noqa: BLE001 - recorded, the step reports it
                    sweep.errors[tier.name] = f"{type(exc).__name__}: {exc}"

        for tier in self.tiers:
            await asyncio.gather(*(one(tier, k) for k in keys))
        return sweep

    async def count_present(self, keys: Sequence[str]) -> dict[str, int]:
        """How many of ``keys`` each tier holds now (for a dry run)."""
        out: dict[str, int] = {}
        for tier in self.tiers:
            flags = await asyncio.gather(*(tier.contains(k) for k in keys))
            out[tier.name] = sum(1 for f in flags if f)
        return out


class KeyRef(Protocol):
    """What a shred reports per destroyed version (``KeyInfo`` and ``WrappedKey`` both fit)."""

    @property
    def key_id(self) -> str: ...

    @property
    def version(self) -> int: ...


class KeyShredder(Protocol):
    def shred(self, tenant: str, user: str | None = None) -> Sequence[KeyRef]:
        """Destroy the data keys of that scope (``user=None``: every key of the tenant) and
        return the versions destroyed by this call."""
        ...

    def pending(self, tenant: str, user: str | None = None) -> list[tuple[str, int]]:
        """(key id, version) of the versions a shred would destroy now (for a dry run)."""
        ...


class _KeyRow(KeyRef, Protocol):
    @property
    def tenant(self) -> str: ...

    @property
    def user(self) -> str | None: ...

    @property
    def state(self) -> KeyState: ...


def _pending(rows: Sequence[_KeyRow], tenant: str, user: str | None) -> list[tuple[str, int]]:
    return [
        (r.key_id, r.version)
        for r in rows
        if r.tenant == tenant
        and r.state is not KeyState.DESTROYED
        and (user is None or r.user == user)
    ]


class _Keyring(Protocol):
    def shred(self, tenant: str, user: str | None = None) -> Sequence[_KeyRow]: ...

    def list(self, tenant: str | None = None) -> Sequence[_KeyRow]: ...


class KeyringShredder:
    """Shred through a process's :class:`~kvgov.keys.keyring.Keyring` (store and in-memory
    copies alike): what a sidecar uses."""

    def __init__(self, keyring: _Keyring) -> None:
        self._keyring = keyring

    def shred(self, tenant: str, user: str | None = None) -> Sequence[KeyRef]:
        return self._keyring.shred(tenant, user)

    def pending(self, tenant: str, user: str | None = None) -> list[tuple[str, int]]:
        return _pending(self._keyring.list(tenant), tenant, user)


class _Store(Protocol):
    def destroy(self, tenant: str, user: str | None) -> Sequence[_KeyRow]: ...

    def versions(self, tenant: str | None = None) -> Sequence[_KeyRow]: ...


class StoreShredder:
    """Shred through the wrapped-key store alone (no KEK needed): what the CLI uses."""

    def __init__(self, store: _Store) -> None:
        self._store = store

    def shred(self, tenant: str, user: str | None = None) -> Sequence[KeyRef]:
        return self._store.destroy(tenant, user)

    def pending(self, tenant: str, user: str | None = None) -> list[tuple[str, int]]:
        return _pending(self._store.versions(tenant), tenant, user)


@dataclass(frozen=True, slots=True)
class EngineEviction:
    """One engine connection's answer to an EVICT."""

    engine: str
    acked: bool
    removed: int = 0
    error: str | None = None


class EngineEvictor(Protocol):
    async def evict(
        self,
        tenant: str,
        key_digests: Sequence[str],
        timeout_s: float,
        holders: Collection[str] = (),
    ) -> list[EngineEviction]:
        """Send EVICT for those entries of ``tenant`` to the connected engines that may hold
        its data (the policy admits them for it, or they are among ``holders``: engine ids
        the ledger saw store or read it); one result per engine connection."""
        ...


@runtime_checkable
class LateEvictor(Protocol):
    """An evictor that can send an EVICT later (the sidecar's): to an engine the step could
    not reach, once that engine's control channel is back (``docs/purge.md``, "Engines not
    reached"). An optional ability: the CLI's evictor has none."""

    def owe(
        self, job_id: str, tenant: str, engines: Collection[str], key_digests: Sequence[str]
    ) -> None:
        """Keep EVICT(``key_digests``) of purge ``job_id`` for each of ``engines`` until it
        is acknowledged (bounded in number and time; never more than the digests)."""
        ...


class NoEngines:
    """The evictor of a process that has no engine connections (the CLI, a test)."""

    async def evict(
        self,
        tenant: str,
        key_digests: Sequence[str],
        timeout_s: float,
        holders: Collection[str] = (),
    ) -> list[EngineEviction]:
        return []


class LocalIndex(Protocol):
    """A process's own in-memory view of entries (the sidecar's index): a purge drops the
    entries from it before deleting them from the tiers, so they are never served again.

    Before the tier step reads its scope it fences the process's data plane (:meth:`fence`),
    so no put of that scope still arriving is made visible after the read, and waits until the
    puts it acknowledged are in the database (:meth:`settle`); entries the index holds in that
    scope which the database did not show (:meth:`held`) are deleted with the rest."""

    def drop(self, key_digests: Sequence[str]) -> None: ...

    def fence(self, job_id: str, tenant: str, subject: str | None, until: float) -> int:
        """Raise purge job ``job_id``'s erasure fence (``subject`` None: the whole tenant; it
        lapses at ``until``, ``time.time()``); returns how many puts in flight it caught."""
        ...

    def lift(self, job_ids: Sequence[str]) -> None:
        """Those purge jobs are finished: lift their fences."""
        ...

    def fenced(self) -> list[str]:
        """The purge jobs whose fences stand here."""
        ...

    async def settle(self) -> None:
        """Wait until the puts this process acknowledged are in the database."""
        ...

    def held(self, tenant: str, subject: str | None) -> list[str]:
        """Digests of the entries the index holds of ``tenant`` (owned by or scoped to
        ``subject``, when given)."""
        ...


class NoLocalIndex:
    """The index of a process that serves nothing (the CLI): nothing to fence or hold."""

    def drop(self, key_digests: Sequence[str]) -> None:
        return None

    def fence(self, job_id: str, tenant: str, subject: str | None, until: float) -> int:
        return 0

    def lift(self, job_ids: Sequence[str]) -> None:
        return None

    def fenced(self) -> list[str]:
        return []

    async def settle(self) -> None:
        return None

    def held(self, tenant: str, subject: str | None) -> list[str]:
        return []


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    chain_id: str
    seq: int
    head_hash: str
    signature: str  # base64 Ed25519 signature


#: sign the chain head now (after a step's event, or the erasure event, is durable)
Checkpointer = Callable[[], Awaitable[CheckpointInfo | None]]

"""What a keyring's in-memory keys must become after a change made elsewhere.

A :class:`~kvgov.keys.keyring.Keyring` caches unwrapped data keys and the active version of
each scope. Another process sharing the key store (``kvgov keys shred``/``rotate``, a purge run
by the CLI or another sidecar, ``POST /v1/keys/rotate`` on another node) changes the rows, not
this process's memory. :meth:`Keyring.revalidate` reads the state of every cached version (one
:meth:`~kvgov.keys.store.WrappedKeyStore.states` call per :data:`REVALIDATE_BATCH` key ids) and
:func:`plan` says what to do with it:

* a cached version that is destroyed, or no longer in the store at all, is dropped (its handle
  destroyed, so even an operation holding it fails with ``KeyDestroyedError``);
* a scope with a newer active version seals new data under that one from now on;
* a scope whose active version is no longer active, with nothing newer active, is forgotten:
  the next seal reads the store again (and creates a new version if the scope was shredded).

Pure functions; the keyring applies the plan under its lock.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from kvgov.types import KeyState

#: key ids per store read (bounds the ``IN (...)`` list of one query)
REVALIDATE_BATCH = 500

Ident = tuple[str, int]


@dataclass(frozen=True, slots=True)
class Revalidation:
    """What one revalidation found and did."""

    #: cached versions checked against the store
    checked: int = 0
    #: versions dropped from memory: destroyed (or gone) in the store
    dropped: tuple[Ident, ...] = ()
    #: scopes now sealing under a newer active version: ``(key id, version)``
    renewed: tuple[Ident, ...] = ()
    #: scopes whose active version is no longer active: the next seal reads the store
    forgotten: tuple[str, ...] = field(default=())

    @property
    def changed(self) -> bool:
        return bool(self.dropped or self.renewed or self.forgotten)


@dataclass(frozen=True, slots=True)
class Plan:
    drop: frozenset[Ident]
    renew: dict[str, int]
    forget: frozenset[str]


def batches(key_ids: Collection[str], size: int = REVALIDATE_BATCH) -> Iterator[list[str]]:
    ordered: Sequence[str] = sorted(key_ids)
    for start in range(0, len(ordered), size):
        yield list(ordered[start : start + size])


def plan(
    cached: Collection[Ident], active: Mapping[str, int], states: Mapping[Ident, KeyState]
) -> Plan:
    """What to change, given the cached versions and active versions this process holds and
    ``states``, the store's state of every version of those key ids."""
    drop = frozenset(
        ident for ident in cached if states.get(ident, KeyState.DESTROYED) is KeyState.DESTROYED
    )
    newest: dict[str, int] = {}
    for (key_id, version), state in states.items():
        if state is KeyState.ACTIVE and version > newest.get(key_id, 0):
            newest[key_id] = version
    renew: dict[str, int] = {}
    forget: set[str] = set()
    for key_id, version in active.items():
        latest = newest.get(key_id)
        if latest is not None and latest > version:
            renew[key_id] = latest
        elif states.get((key_id, version)) is not KeyState.ACTIVE:
            forget.add(key_id)
    return Plan(drop, renew, frozenset(forget))

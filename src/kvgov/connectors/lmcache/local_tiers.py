"""Remove entries from an engine's own local tiers (CPU and disk): the EVICT side of a purge.

A connector gets only LMCache's local CPU backend. The disk tier, when configured, belongs to
the same ``StorageManager``, which is found through ``LMCacheEngineBuilder``'s registry: the
engine whose storage manager holds this very CPU backend.

The sidecar names entries by the keyed digest of their key strings (the ledger holds nothing
else), so eviction walks the keys each local tier holds, computes each key's digest with the
sidecar's key-digest key (:class:`kvgov.wire.EvictRequest`) and removes the ones named. A key
string is ``CacheEngineKey.to_string()``, the same string the connector sends the sidecar, so
the digests agree.
"""

from __future__ import annotations

import logging
from typing import Any

from kvgov.wire import EvictRequest

log = logging.getLogger("kvgov.connectors.lmcache")

#: LMCache's names of the engine-local tiers (remote backends are never touched here)
LOCAL_TIERS = ("LocalCPUBackend", "LocalDiskBackend")


def local_backends(local_cpu_backend: Any) -> list[Any]:
    """The engine's local tiers: its CPU backend, plus its disk backend when it has one."""
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    for engine in list(LMCacheEngineBuilder._instances.values()):
        manager = getattr(engine, "storage_manager", None)
        backends = getattr(manager, "storage_backends", None) or {}
        if any(b is local_cpu_backend for b in backends.values()):
            return [backends[name] for name in LOCAL_TIERS if name in backends]
    return [local_cpu_backend]


def backend_keys(backend: Any) -> list[Any]:
    """A snapshot of the keys a local tier holds (taken under the tier's own lock)."""
    get_keys = getattr(backend, "get_keys", None)
    if callable(get_keys):  # LocalCPUBackend
        return list(get_keys())
    index = getattr(backend, "dict", None)  # LocalDiskBackend: its key -> file index
    lock = getattr(backend, "disk_lock", None)
    if index is None or lock is None:
        log.warning("lmcache.evict.unknown_tier", extra={"tier": type(backend).__name__})
        return []
    with lock:
        return list(index.keys())


def evict(local_cpu_backend: Any, request: EvictRequest) -> list[str]:
    """Remove the entries ``request`` names from every local tier; return the digests of the
    entries that were present and removed."""
    backends = local_backends(local_cpu_backend)
    removed: set[str] = set()
    for backend in backends:
        for key, digest in request.matching(backend_keys(backend)):
            if backend.remove(key):
                removed.add(digest)
    log.info(
        "lmcache.evict.done",
        extra={
            "requested": len(request.digests),
            "removed": len(removed),
            "tiers": [type(b).__name__ for b in backends],
        },
    )
    return sorted(removed)

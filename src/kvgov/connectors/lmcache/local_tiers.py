"""Remove keys from an engine's own local tiers (CPU and disk): the EVICT side of a purge.

A connector gets only LMCache's local CPU backend. The disk tier, when configured, belongs to
the same ``StorageManager``, which is found through ``LMCacheEngineBuilder``'s registry: the
engine whose storage manager holds this very CPU backend. Keys come from the sidecar as
strings; ``CacheEngineKey.from_string`` rebuilds them with their tags, so they compare equal
to the keys LMCache indexed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

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


def evict(local_cpu_backend: Any, keys: Iterable[str]) -> list[str]:
    """Remove ``keys`` from every local tier; return the keys that were present and removed."""
    from lmcache.utils import CacheEngineKey

    wanted = list(keys)
    backends = local_backends(local_cpu_backend)
    removed: list[str] = []
    for raw in wanted:
        try:
            key = CacheEngineKey.from_string(raw)
        except (ValueError, IndexError, TypeError):
            log.warning("lmcache.evict.bad_key")
            continue
        hit = False
        for backend in backends:
            if backend.contains(key):
                hit = bool(backend.remove(key)) or hit
        if hit:
            removed.append(raw)
    log.info(
        "lmcache.evict.done",
        extra={
            "requested": len(wanted),
            "removed": len(removed),
            "tiers": [type(b).__name__ for b in backends],
        },
    )
    return removed

"""Build the configured tier chain from ``Settings`` through an explicit registry.

A configured tier that fails to load or connect stops startup with :class:`StartupError`:
silently skipping one would let chunks bypass where the operator said they must (or must not)
live. Adding a backend is one builder function and one registry entry (see ``docs/tiers.md``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from kvgov.config import Settings
from kvgov.connectors.tiers.base import EvictListener, Tier
from kvgov.connectors.tiers.chain import TierChain
from kvgov.connectors.tiers.filesystem import STRAY_MIN_AGE_S, FilesystemTier
from kvgov.connectors.tiers.memory import MemoryTier
from kvgov.errors import ConfigError, KvgovError, StartupError, TierError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TierHooks:
    """What the data plane hands every tier it builds."""

    on_evict: EvictListener | None = None
    #: the process is the tiers' owner (the sidecar: :func:`build_tiers`), the only one that
    #: writes them; another (``kvgov purge``) leaves what may be the owner's puts in progress
    owner: bool = False


TierBuilder = Callable[[Settings, TierHooks], Awaitable[Tier]]


async def _memory(settings: Settings, hooks: TierHooks) -> Tier:
    return MemoryTier(settings.tiers.memory_max_bytes, on_evict=hooks.on_evict)


async def _filesystem(settings: Settings, hooks: TierHooks) -> Tier:
    return await FilesystemTier.open(
        settings.filesystem_tier_path,
        fsync=settings.tiers.filesystem_fsync,
        stray_min_age_s=0.0 if hooks.owner else STRAY_MIN_AGE_S,
        max_bytes=settings.filesystem_tier_max_bytes,
        on_evict=hooks.on_evict,
    )


async def _redis(settings: Settings, hooks: TierHooks) -> Tier:
    from kvgov.connectors.tiers.redis import RedisTier

    url = settings.redis_url  # tiers.redis_url or its file; a bad file raises ConfigError
    try:
        return await RedisTier.connect(url, prefix=settings.tiers.redis_prefix)
    except Exception as exc:
        said = " ".join(str(e) for e in (exc, exc.__cause__) if e is not None)
        if any(secret in said for secret in _redis_passwords(url)):
            # the URL's password must never reach an error message or a log line
            raise TierError(
                f"tier redis: {type(exc).__name__} connecting to {_redis_where(url)}"
                " (details withheld: they held the Redis password)"
            ) from None
        raise


def _redis_passwords(url: str) -> set[str]:
    """The URL's password as written and decoded (empty: none)."""
    try:
        raw = urlsplit(url).password or ""
    except ValueError:
        return set()
    return {p for p in (raw, unquote(raw)) if p}


def _redis_where(url: str) -> str:
    """Host and port of a Redis URL, for messages (never its credentials)."""
    try:
        parts = urlsplit(url)
        return f"{parts.hostname or '?'}:{parts.port or 6379}"
    except ValueError:
        return "the configured Redis"


#: every tier backend kvgov can build, by the name used in ``tiers.chain`` and in policy
REGISTRY: Mapping[str, TierBuilder] = {
    "memory": _memory,
    "filesystem": _filesystem,
    "redis": _redis,
}


async def build_tiers(
    settings: Settings,
    *,
    on_evict: EvictListener | None = None,
    registry: Mapping[str, TierBuilder] = REGISTRY,
) -> TierChain:
    """Build ``settings.tiers.chain`` in order; any failure closes what was built and raises."""
    names = list(settings.tiers.chain)
    if not names:
        raise StartupError("no tiers configured", hint="set tiers.chain, e.g. [memory, filesystem]")
    if len(set(names)) != len(names):
        raise StartupError(f"tiers.chain names a tier twice: {names}")
    hooks = TierHooks(on_evict=on_evict, owner=True)
    built: list[Tier] = []
    try:
        for name in names:
            builder = registry.get(name)
            if builder is None:
                raise StartupError(
                    f"unknown tier {name!r}", hint=f"known tiers: {', '.join(sorted(registry))}"
                )
            try:
                built.append(await builder(settings, hooks))
            except KvgovError as exc:
                if isinstance(exc, StartupError | ConfigError):
                    raise  # a misconfiguration (a bad tiers.redis_url_file) reads as one
                raise StartupError(
                    f"tier {name} failed to start: {exc.message}", hint=exc.hint
                ) from exc
            except Exception as exc:
                raise StartupError(
                    f"tier {name} failed to start: {type(exc).__name__}: {exc}"
                ) from exc
    except BaseException:
        await TierChain(built).close()
        raise
    log.info("tiers.built", extra={"tiers": names})
    return TierChain(built)

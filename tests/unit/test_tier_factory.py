"""Building the configured chain from Settings; a tier that cannot start stops startup."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvgov.config import Settings, TierSettings
from kvgov.connectors.tiers.base import Tier
from kvgov.connectors.tiers.factory import REGISTRY, TierHooks, build_tiers
from kvgov.connectors.tiers.filesystem import FilesystemTier
from kvgov.errors import StartupError


def settings(tmp_path: Path, **tiers: object) -> Settings:
    return Settings(data_dir=tmp_path, tiers=TierSettings(**tiers))  # type: ignore[arg-type]


async def test_default_chain_is_memory_then_filesystem(tmp_path: Path) -> None:
    chain = await build_tiers(settings(tmp_path))
    try:
        assert chain.names == ("memory", "filesystem")
        await chain.put("k", b"v", allowed=chain.names)
        assert (tmp_path / "tiers" / "fs").is_dir()
    finally:
        await chain.close()


async def test_eviction_listener_reaches_the_memory_tier(tmp_path: Path) -> None:
    seen: list[str] = []
    chain = await build_tiers(
        settings(tmp_path, chain=["memory"], memory_max_bytes=1024 * 1024),
        on_evict=lambda _t, k, _n: seen.append(k),
    )
    try:
        for i in range(3):
            await chain.put(f"k{i}", b"x" * (512 * 1024), allowed={"memory"})
        assert seen == ["k0"]
    finally:
        await chain.close()


@pytest.mark.redis
async def test_redis_tier_from_settings(tmp_path: Path, redis_url: str, redis_prefix: str) -> None:
    conf = settings(
        tmp_path, chain=["memory", "redis"], redis_url=redis_url, redis_prefix=redis_prefix
    )
    chain = await build_tiers(conf)
    try:
        await chain.put("k", b"v", allowed={"redis"})
        assert await chain.where("k") == ["redis"]
    finally:
        await chain.close()


async def test_unreachable_redis_stops_startup(tmp_path: Path) -> None:
    with pytest.raises(StartupError, match="tier redis failed to start"):
        await build_tiers(
            settings(tmp_path, chain=["memory", "redis"], redis_url="redis://127.0.0.1:1/0")
        )


async def test_unusable_filesystem_root_stops_startup(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"not a directory")
    with pytest.raises(StartupError, match="tier filesystem failed to start"):
        await build_tiers(settings(tmp_path, chain=["filesystem"], filesystem_path=blocker / "fs"))


async def test_unknown_duplicate_or_empty_chains_are_refused(tmp_path: Path) -> None:
    with pytest.raises(StartupError, match="unknown tier 'memory'"):
        await build_tiers(settings(tmp_path, chain=["memory"]), registry={})
    with pytest.raises(StartupError, match="twice"):
        await build_tiers(settings(tmp_path, chain=["memory", "memory"]))
    with pytest.raises(StartupError, match="no tiers"):
        await build_tiers(settings(tmp_path, chain=[]))


async def test_a_builder_that_raises_anything_stops_startup(tmp_path: Path) -> None:
    async def broken(_s: Settings, _h: TierHooks) -> Tier:
        raise RuntimeError("plugin bug")

    with pytest.raises(StartupError, match="plugin bug"):
        await build_tiers(
            settings(tmp_path, chain=["memory", "filesystem"]),
            registry={**REGISTRY, "filesystem": broken},
        )


async def test_a_process_beside_the_sidecar_keeps_its_puts_in_progress(tmp_path: Path) -> None:
    """``kvgov purge`` opens the filesystem tier in its own process while the sidecar that owns
    it runs: its recovery removed every ``*.tmp``, so the sidecar's puts in progress failed at
    their rename. Another process now removes only leftovers old enough to be a crash's; the
    owner (``build_tiers``: the sidecar, at its start) removes them all."""
    import os
    import time

    owner = await build_tiers(settings(tmp_path, chain=["filesystem"]))
    await owner.put("a" * 64, b"stored", allowed=owner.names)
    fs = owner.tier("filesystem")
    assert isinstance(fs, FilesystemTier)
    fanout = fs.path_of("a" * 64).parent
    await owner.close()
    in_progress = fanout / f".{'b' * 64}.0123456789ab.tmp"
    crashed = fanout / f".{'c' * 64}.ba9876543210.tmp"
    in_progress.write_bytes(b"half a put")
    crashed.write_bytes(b"a crash's half put")
    hour_ago = time.time() - 3600
    os.utime(crashed, (hour_ago, hour_ago))

    other = await REGISTRY["filesystem"](settings(tmp_path, chain=["filesystem"]), TierHooks())
    try:
        assert in_progress.exists(), "another process removed a put in progress"
        assert not crashed.exists()
        assert await other.get("a" * 64) == b"stored"
    finally:
        await other.close()
    owner = await build_tiers(settings(tmp_path, chain=["filesystem"]))
    try:
        assert not in_progress.exists()  # the owner's own, at its start: a crash's
    finally:
        await owner.close()

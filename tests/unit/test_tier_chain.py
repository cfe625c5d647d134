"""The tier chain over real tiers: write-through, allowed-tier filtering, promotion, sweep."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvgov.connectors.tiers.base import DestinationTooSmallError
from kvgov.connectors.tiers.chain import TierChain
from kvgov.connectors.tiers.filesystem import FilesystemTier
from kvgov.connectors.tiers.memory import MemoryTier
from kvgov.errors import TierError

MIB = 1024 * 1024
ALL = ("memory", "filesystem")


@pytest.fixture
async def chain(tmp_path: Path) -> AsyncIterator[TierChain]:
    built = TierChain([MemoryTier(8 * MIB), await FilesystemTier.open(tmp_path / "fs")])
    yield built
    await built.close()


async def test_write_through_to_allowed_tiers_only(chain: TierChain) -> None:
    assert await chain.put("k1", b"both", allowed=ALL) == ALL
    assert await chain.where("k1") == ["memory", "filesystem"]
    assert await chain.put("k2", b"disk only", allowed={"filesystem", "s3"}) == ("filesystem",)
    assert await chain.where("k2") == ["filesystem"]
    assert await chain.put("k3", b"nowhere", allowed=()) == ()
    assert await chain.where("k3") == []
    assert not await chain.contains("k3")


async def test_a_put_moves_the_entry_to_exactly_the_allowed_tiers(chain: TierChain) -> None:
    await chain.put("k", b"v1", allowed=ALL)
    await chain.put("k", b"v2", allowed={"memory"})
    assert await chain.where("k") == ["memory"]
    assert await chain.tier("filesystem").get("k") is None  # no stale copy left behind


async def test_hit_in_a_slower_tier_is_promoted_to_allowed_faster_tiers(chain: TierChain) -> None:
    value = bytes(range(256)) * 4096
    expiry = time.time() + 600
    await chain.put("k", value, allowed={"filesystem"}, expires_at=expiry)
    dst = bytearray(len(value))
    hit = await chain.get_into("k", memoryview(dst), allowed=ALL)
    assert hit is not None
    assert (hit.tier, hit.nbytes, hit.promoted) == ("filesystem", len(value), ("memory",))
    assert dst == value
    assert await chain.where("k") == ["memory", "filesystem"]
    info = await chain.tier("memory").info("k")
    assert info is not None
    assert info.expires_at == expiry  # the promoted copy expires with the original
    hit = await chain.get_into("k", memoryview(dst), allowed=ALL)
    assert hit is not None
    assert hit.tier == "memory"
    assert hit.promoted == ()


async def test_no_promotion_into_a_tier_the_policy_does_not_allow(chain: TierChain) -> None:
    await chain.put("k", b"restricted", allowed={"filesystem"})
    assert await chain.get("k", allowed={"filesystem"}) == b"restricted"
    hit = await chain.get_into("k", memoryview(bytearray(64)), allowed={"filesystem"})
    assert hit is not None
    assert hit.promoted == ()
    assert await chain.where("k") == ["filesystem"]


async def test_a_memory_eviction_falls_back_to_the_slower_tier(tmp_path: Path) -> None:
    evicted: list[str] = []
    memory = MemoryTier(MIB, on_evict=lambda _t, k, _n: evicted.append(k))
    chain = TierChain([memory, await FilesystemTier.open(tmp_path / "fs")])
    try:
        for i in range(3):
            await chain.put(f"k{i}", bytes([i]) * (MIB // 2), allowed=ALL)
        assert evicted == ["k0"]
        assert await chain.where("k0") == ["filesystem"]
        assert await chain.get("k0", allowed=ALL) == bytes([0]) * (MIB // 2)
        assert await chain.where("k0") == ["memory", "filesystem"]
    finally:
        await chain.close()


async def test_delete_removes_from_every_tier(chain: TierChain) -> None:
    await chain.put("k", b"v", allowed=ALL)
    assert await chain.delete("k") == ["memory", "filesystem"]
    assert await chain.where("k") == []
    assert await chain.delete("k") == []


async def test_sweep_removes_expired_entries_from_every_tier(chain: TierChain) -> None:
    now = time.time()
    await chain.put("old", b"1", allowed=ALL, expires_at=now + 1)
    await chain.put("disk-old", b"2", allowed={"filesystem"}, expires_at=now + 2)
    await chain.put("fresh", b"3", allowed=ALL, expires_at=now + 3600)
    await chain.put("forever", b"4", allowed=ALL)
    swept = await chain.sweep(now + 10)
    assert sorted(swept) == ["disk-old", "old"]
    assert await chain.where("old") == []
    assert await chain.where("disk-old") == []
    assert await chain.where("fresh") == ["memory", "filesystem"]
    assert await chain.sweep(now + 10) == []


async def test_size_first_then_get_into(chain: TierChain) -> None:
    await chain.put("k", b"x" * 1000, allowed={"filesystem"})
    assert await chain.size_of("k") == 1000
    with pytest.raises(DestinationTooSmallError):
        await chain.get_into("k", memoryview(bytearray(999)), allowed=ALL)
    assert await chain.size_of("missing") is None
    assert await chain.get_into("missing", memoryview(bytearray(1)), allowed=ALL) is None


async def test_a_failed_write_through_leaves_the_key_nowhere(tmp_path: Path) -> None:
    broken = await FilesystemTier.open(tmp_path / "fs")
    await broken.close()  # a real tier that now fails every operation
    memory = MemoryTier(MIB)
    chain = TierChain([memory, broken])
    with pytest.raises(TierError, match="write-through failed on tier filesystem"):
        await chain.put("k", b"v", allowed=ALL)
    assert not await memory.contains("k")


async def test_names_must_be_unique() -> None:
    with pytest.raises(TierError, match="unique"):
        TierChain([MemoryTier(MIB), MemoryTier(MIB)])


async def test_stats_per_tier(chain: TierChain) -> None:
    await chain.put("k", b"abc", allowed=ALL)
    stats = await chain.stats()
    assert [(s.name, s.entries, s.bytes) for s in stats] == [
        ("memory", 1, 3),
        ("filesystem", 1, 3),
    ]


async def test_a_reserved_put_is_written_through_and_kept_by_the_fastest_tier(
    chain: TierChain,
) -> None:
    value = bytes(range(256)) * 1024
    res = chain.reserve(len(value), allowed=ALL)
    assert res is not None
    res.view[:] = value
    assert await chain.put_reserved("k", res, allowed=ALL) == ALL
    assert await chain.where("k") == ["memory", "filesystem"]
    fs = chain.tier("filesystem")
    assert await fs.get("k") == value
    assert await chain.tier("memory").get("k") == value
    # the policy keeps it out of memory: no reservation, the caller puts a copy instead
    assert chain.reserve(len(value), allowed=("filesystem",)) is None


async def test_a_reserved_put_limited_to_memory_leaves_the_slower_tiers(
    chain: TierChain,
) -> None:
    await chain.put("k", b"old value", allowed=ALL)
    res = chain.reserve(MIB, allowed=("memory",))
    assert res is not None
    res.view[:] = b"n" * MIB
    assert await chain.put_reserved("k", res, allowed=("memory",)) == ("memory",)
    assert await chain.where("k") == ["memory"]


async def test_a_failed_reserved_write_through_cancels_and_leaves_the_key_nowhere(
    tmp_path: Path,
) -> None:
    broken = await FilesystemTier.open(tmp_path / "fs")
    await broken.close()
    memory = MemoryTier(4 * MIB)
    chain = TierChain([memory, broken])
    await memory.put("k", b"older")
    res = chain.reserve(MIB, allowed=ALL)
    assert res is not None and memory.reserved_bytes == MIB
    with pytest.raises(TierError, match="write-through failed on tier filesystem"):
        await chain.put_reserved("k", res, allowed=ALL)
    assert not await memory.contains("k")
    assert memory.reserved_bytes == 0

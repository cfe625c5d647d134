"""The one contract every tier backend keeps, run against memory, filesystem and real Redis."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from kvgov.connectors.tiers.base import DestinationTooSmallError, Tier
from kvgov.connectors.tiers.filesystem import FilesystemTier
from kvgov.connectors.tiers.memory import MemoryTier

MIB = 1024 * 1024

TierFactory = Callable[[], Awaitable[Tier]]


@pytest.fixture(
    params=[
        "memory",
        "filesystem",
        "filesystem-nofsync",
        pytest.param("redis", marks=pytest.mark.redis),
    ]
)
async def tier(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Tier]:
    kind = request.param
    built: Tier
    if kind == "memory":
        built = MemoryTier(64 * MIB)
    elif kind.startswith("filesystem"):
        built = await FilesystemTier.open(tmp_path / "fs", fsync=kind == "filesystem")
    else:
        from kvgov.connectors.tiers.redis import RedisTier

        redis_url = request.getfixturevalue("redis_url")
        prefix = request.getfixturevalue("redis_prefix")
        built = await RedisTier.connect(redis_url, prefix=prefix)
    try:
        yield built
    finally:
        await built.close()


def pattern(size: int, seed: int = 0) -> bytes:
    """Bytes where a shifted or truncated copy would not compare equal."""
    block = bytes((i * 31 + seed * 7 + (i >> 8)) % 251 for i in range(min(size, 65_521)))
    reps, rest = divmod(size, len(block)) if block else (0, 0)
    return block * reps + block[:rest]


def key(n: int | str) -> str:
    """Keys look like what the data plane passes: hex digests."""
    return f"{hash(str(n)) & (2**128 - 1):032x}"


@pytest.mark.parametrize("size", [0, 1, 4099, 4 * MIB])
async def test_round_trip_byte_for_byte(tier: Tier, size: int) -> None:
    value = pattern(size, seed=size)
    await tier.put(key(size), value)
    assert await tier.get(key(size)) == value
    assert await tier.size_of(key(size)) == size
    dst = bytearray(size + 17)
    assert await tier.get_into(key(size), memoryview(dst)) == size
    assert bytes(dst[:size]) == value


async def test_put_accepts_views_and_copies_them(tier: Tier) -> None:
    buf = bytearray(pattern(100_000))
    await tier.put(key("v"), memoryview(buf)[10:90_010])
    expected = bytes(buf[10:90_010])
    buf[:] = b"\0" * len(buf)  # the caller reuses its buffer right after put
    assert await tier.get(key("v")) == expected


async def test_overwrite_replaces_value_and_expiry(tier: Tier) -> None:
    await tier.put(key("o"), pattern(5000, 1), expires_at=time.time() + 0.2)
    await tier.put(key("o"), pattern(300, 2))
    assert await tier.get(key("o")) == pattern(300, 2)
    info = await tier.info(key("o"))
    assert info is not None
    assert info.size == 300
    assert info.expires_at is None
    await asyncio.sleep(0.3)
    assert await tier.get(key("o")) == pattern(300, 2)


async def test_delete_and_contains(tier: Tier) -> None:
    assert not await tier.contains(key("d"))
    assert not await tier.delete(key("d"))
    await tier.put(key("d"), b"x")
    assert await tier.contains(key("d"))
    assert await tier.delete(key("d"))
    assert not await tier.contains(key("d"))
    assert await tier.get(key("d")) is None
    assert await tier.get_into(key("d"), memoryview(bytearray(8))) is None
    assert await tier.size_of(key("d")) is None
    assert not await tier.delete(key("d"))


async def test_keys_lists_live_keys(tier: Tier) -> None:
    wanted = {key(i) for i in range(25)}
    for k in wanted:
        await tier.put(k, k.encode())
    await tier.delete(key(3))
    await tier.put(key("gone"), b"x", expires_at=time.time() - 1)
    listed = [k async for k in tier.iter_keys()]
    assert sorted(listed) == sorted(wanted - {key(3)})


async def test_expiry_makes_a_miss(tier: Tier) -> None:
    expires = time.time() + 0.6  # room for a loaded machine between put and the first get
    await tier.put(key("e"), pattern(2000), expires_at=expires)
    await tier.put(key("stay"), b"s", expires_at=time.time() + 60)
    info = await tier.info(key("e"))
    assert info is not None
    assert info.expires_at == pytest.approx(expires, abs=0.002)
    assert await tier.get(key("e")) == pattern(2000)
    await asyncio.sleep(0.75)
    assert await tier.get(key("e")) is None
    assert await tier.get_into(key("e"), memoryview(bytearray(4000))) is None
    assert not await tier.contains(key("e"))
    assert await tier.info(key("e")) is None
    assert [k async for k in tier.iter_keys()] == [key("stay")]
    assert await tier.get(key("stay")) == b"s"


async def test_put_already_expired_stores_nothing_and_drops_old_value(tier: Tier) -> None:
    await tier.put(key("p"), b"old")
    await tier.put(key("p"), b"new", expires_at=time.time() - 5)
    assert await tier.get(key("p")) is None
    assert not await tier.contains(key("p"))


async def test_sweep_removes_expired_entries(tier: Tier) -> None:
    await tier.put(key("s1"), b"1", expires_at=time.time() + 0.2)
    await tier.put(key("s2"), b"2", expires_at=time.time() + 60)
    await asyncio.sleep(0.3)
    swept = await tier.sweep(time.time())
    # Redis expires on its own and reports nothing; the others report what they removed
    assert set(swept) <= {key("s1")}
    assert not await tier.contains(key("s1"))
    assert await tier.contains(key("s2"))
    assert await tier.sweep(time.time()) == []


async def test_stats_count_entries_bytes_hits_and_misses(tier: Tier) -> None:
    await tier.put(key("a"), pattern(1000))
    await tier.put(key("b"), pattern(24))
    await tier.put(key("b"), pattern(500))  # an overwrite is one entry
    assert await tier.get(key("a")) is not None
    assert await tier.get_into(key("b"), memoryview(bytearray(600))) == 500
    assert await tier.get(key("nope")) is None
    stats = await tier.stats()
    assert stats.name == tier.name
    assert stats.entries == 2
    assert stats.bytes == 1500
    assert stats.hits == 2
    assert stats.misses == 1
    assert stats.evictions == 0


async def test_get_into_a_too_small_destination_says_how_much_is_needed(tier: Tier) -> None:
    await tier.put(key("big"), pattern(10_000))
    dst = memoryview(bytearray(9_999))
    with pytest.raises(DestinationTooSmallError) as info:
        await tier.get_into(key("big"), dst)
    assert info.value.needed == 10_000
    assert "9999" in info.value.diagnostics()
    assert await tier.get(key("big")) == pattern(10_000)  # nothing was harmed


async def test_concurrent_puts_and_gets(tier: Tier) -> None:
    size = 300_000
    values = {key(i): pattern(size, seed=i) for i in range(24)}

    async def writer(k: str) -> None:
        await tier.put(k, values[k])

    async def reader(k: str) -> None:
        dst = bytearray(size)
        for _ in range(50):
            n = await tier.get_into(k, memoryview(dst))
            if n is not None:
                assert n == size
                assert dst == values[k]  # never torn: the old value or the new one
                return
            await asyncio.sleep(0.001)

    await asyncio.gather(*(writer(k) for k in values), *(reader(k) for k in values))
    # the same key rewritten concurrently ends as one of the written values, whole
    contenders = [pattern(size + i, seed=100 + i) for i in range(8)]
    await asyncio.gather(*(tier.put(key("hot"), v) for v in contenders))
    final = await tier.get(key("hot"))
    assert final in contenders
    assert await tier.size_of(key("hot")) == len(final or b"")
    for k, v in values.items():
        assert await tier.get(k) == v


async def test_keys_are_opaque_strings(tier: Tier) -> None:
    odd = ["tenant/a:b*c?[x]", "ünïcode-ключ", "x" * 500, "with space"]
    for i, k in enumerate(odd):
        await tier.put(k, bytes([i]) * 10)
    for i, k in enumerate(odd):
        assert await tier.get(k) == bytes([i]) * 10
    assert sorted([k async for k in tier.iter_keys()]) == sorted(odd)


async def test_value_is_stored_exactly_even_when_it_contains_header_like_bytes(
    tier: Tier,
) -> None:
    value = b"KVGT\x01\x00" + os.urandom(64) + b"\r\n$-1\r\n"
    await tier.put(key("h"), value)
    assert await tier.get(key("h")) == value

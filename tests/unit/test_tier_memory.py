"""Memory tier specifics: the bytes bound, LRU order, the eviction hook, buffer recycling."""

from __future__ import annotations

import os

import pytest

from kvgov.connectors.tiers.base import NOGIL_COPY_BYTES, copy_into
from kvgov.connectors.tiers.memory import POOL_MIN_BYTES, MemoryTier
from kvgov.connectors.tiers.pages import new_buffer
from kvgov.errors import TierError

CHUNK = 256 * 1024


def _chunk(i: int, size: int = CHUNK) -> bytes:
    return bytes([i % 256]) * size


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_bytes_bound_evicts_least_recently_used_and_reports_it() -> None:
    evicted: list[tuple[str, str, int]] = []
    tier = MemoryTier(4 * CHUNK, on_evict=lambda t, k, n: evicted.append((t, k, n)))
    for i in range(4):
        await tier.put(f"k{i}", _chunk(i))
    assert await tier.get("k0") == _chunk(0)  # k0 is now the most recently used
    await tier.put("k4", _chunk(4))
    assert evicted == [("memory", "k1", CHUNK)]
    assert not await tier.contains("k1")
    assert await tier.get("k0") == _chunk(0)
    stats = await tier.stats()
    assert stats.entries == 4
    assert stats.bytes == 4 * CHUNK
    assert stats.evictions == 1
    assert stats.bytes + tier.pooled_bytes <= stats.capacity_bytes  # type: ignore[operator]


async def test_never_exceeds_bound_with_mixed_sizes() -> None:
    limit = 10 * CHUNK
    tier = MemoryTier(limit)
    sizes = [CHUNK, 3 * CHUNK, 100, POOL_MIN_BYTES, 2 * CHUNK + 7, 5 * CHUNK]
    for i in range(60):
        size = sizes[i % len(sizes)]
        await tier.put(f"k{i}", _chunk(i, size))
        if i % 7 == 0:
            await tier.delete(f"k{i - 3}")
        stats = await tier.stats()
        assert stats.bytes + tier.pooled_bytes <= limit
        assert await tier.get(f"k{i}") == _chunk(i, size)


async def test_steady_state_puts_reuse_evicted_buffers() -> None:
    tier = MemoryTier(4 * CHUNK)
    for i in range(4):
        await tier.put(f"k{i}", _chunk(i))
    held = {id(tier._entries[f"k{i}"].buf) for i in range(4)}  # white-box: the pooled buffers
    for i in range(4, 40):
        await tier.put(f"k{i}", _chunk(i))
    now = {id(e.buf) for e in tier._entries.values()}
    assert now == held  # the same four buffers, recycled through evictions
    for i in range(36, 40):
        assert await tier.get(f"k{i}") == _chunk(i)


async def test_deleted_buffer_is_recycled_for_the_next_put_of_that_size() -> None:
    tier = MemoryTier(8 * CHUNK)
    await tier.put("a", _chunk(1))
    buf_id = id(tier._entries["a"].buf)
    assert await tier.delete("a")
    assert tier.pooled_bytes == CHUNK
    await tier.put("b", _chunk(2))
    assert id(tier._entries["b"].buf) == buf_id
    assert tier.pooled_bytes == 0
    assert await tier.get("b") == _chunk(2)


async def test_value_larger_than_the_tier_is_refused() -> None:
    tier = MemoryTier(2 * CHUNK)
    with pytest.raises(TierError, match="exceeds"):
        await tier.put("big", _chunk(0, 2 * CHUNK + 1))
    assert not await tier.contains("big")


async def test_expiry_with_injected_clock_and_sweep() -> None:
    clock = _Clock()
    tier = MemoryTier(8 * CHUNK, clock=clock)
    await tier.put("short", b"s", expires_at=clock.now + 10)
    await tier.put("long", b"l", expires_at=clock.now + 100)
    await tier.put("never", b"n")
    clock.now += 10
    assert await tier.get("short") is None  # expiry is inclusive: at expires_at it is gone
    assert await tier.sweep(clock.now + 100) == ["long"]
    assert [k async for k in tier.iter_keys()] == ["never"]
    stats = await tier.stats()
    assert stats.expirations == 2
    assert stats.misses == 1


async def test_a_failing_evict_listener_does_not_break_puts() -> None:
    def boom(tier: str, key: str, nbytes: int) -> None:
        raise RuntimeError("listener bug")

    tier = MemoryTier(CHUNK, on_evict=boom)
    await tier.put("a", _chunk(1))
    await tier.put("b", _chunk(2))
    assert await tier.get("b") == _chunk(2)


async def test_closed_tier_refuses_work() -> None:
    tier = MemoryTier(CHUNK)
    await tier.close()
    with pytest.raises(TierError, match="closed"):
        await tier.put("a", b"x")


async def test_steady_state_puts_allocate_no_chunk_sized_memory() -> None:
    import tracemalloc

    size = 2 * 1024 * 1024
    tier = MemoryTier(4 * size)
    data = memoryview(bytearray(_chunk(7, size)))
    for i in range(4):
        await tier.put(f"warm{i}", data)
    dst = memoryview(bytearray(size))
    tracemalloc.start()
    try:
        for i in range(16):
            await tier.put(f"k{i}", data)
            assert await tier.get_into(f"k{i}", dst) == size
        _current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < size // 4  # no chunk-sized allocation (nor a temporary copy) per put or get


async def test_a_borrowed_value_survives_delete_overwrite_and_eviction() -> None:
    """A borrow is a read-only view of the stored bytes; while it is held, no delete,
    overwrite or eviction recycles its buffer for another put."""
    tier = MemoryTier(2 * CHUNK)
    assert tier.borrow("nope") is None
    for op in ("delete", "overwrite", "evict"):
        await tier.put("k", _chunk(1))
        lent = tier.borrow("k")
        assert lent is not None
        assert lent.view.readonly
        assert bytes(lent.view) == _chunk(1)
        if op == "delete":
            await tier.delete("k")
        elif op == "overwrite":
            await tier.put("k", _chunk(2))
        else:
            await tier.put("a", _chunk(3))
            await tier.put("b", _chunk(4))  # evicts k (least recently used)
            assert not await tier.contains("k")
        await tier.put("c", _chunk(5))  # a put of the same size reuses no borrowed buffer
        assert bytes(lent.view) == _chunk(1)
        lent.release()
        lent.release()  # idempotent
        for key in ("k", "a", "b", "c"):
            await tier.delete(key)


async def test_a_released_borrow_lets_the_buffer_be_recycled() -> None:
    tier = MemoryTier(4 * CHUNK)
    await tier.put("k", _chunk(1))
    with tier.borrow("k") as lent:  # type: ignore[union-attr]
        assert bytes(lent.view[:4]) == _chunk(1)[:4]
    await tier.delete("k")
    assert tier.pooled_bytes == CHUNK


@pytest.mark.parametrize("size", [0, 1, NOGIL_COPY_BYTES - 1, NOGIL_COPY_BYTES, 3 * 2**20 + 7])
@pytest.mark.parametrize("readonly_source", [False, True])
def test_copy_into_copies_exactly_the_source(size: int, readonly_source: bool) -> None:
    """Both paths (a slice assignment, and the GIL-free memmove for large writable views)
    copy the source byte for byte and leave the rest of the destination alone."""
    data = os.urandom(size)
    src = memoryview(data if readonly_source else bytearray(data))
    dst = bytearray(b"\xaa" * (size + 9))
    copy_into(memoryview(dst), src)
    assert bytes(dst[:size]) == data
    assert bytes(dst[size:]) == b"\xaa" * 9


@pytest.mark.parametrize("size", [0, 1, 64 * 1024, 3 * 2**20 + 1])
def test_new_buffer_is_zeroed_writable_and_exactly_sized(size: int) -> None:
    buf = new_buffer(size)
    assert len(buf) == size
    assert bytes(buf) == bytes(size)
    view = memoryview(buf)
    assert not view.readonly
    data = os.urandom(size)
    view[:] = data
    assert bytes(buf) == data


async def test_a_reserved_buffer_is_stored_without_a_copy_and_counted_meanwhile() -> None:
    tier = MemoryTier(4 * CHUNK)
    res = tier.reserve(CHUNK)
    assert res is not None
    assert tier.reserved_bytes == CHUNK
    res.view[:] = _chunk(7)
    await tier.put("k", memoryview(_chunk(1)))  # room for the reservation is kept
    await tier.put_reserved("k", res)  # an overwrite, like put
    assert tier.reserved_bytes == 0
    assert await tier.get("k") == _chunk(7)
    with tier.borrow("k") as lent:  # the very buffer the caller wrote, not a copy of it
        assert lent is not None
        res.view[:1] = b"\x00"  # (the caller must not do this: here it proves no copy)
        assert bytes(lent.view[:1]) == b"\x00"
    stats = await tier.stats()
    assert (stats.entries, stats.bytes) == (1, CHUNK)


async def test_reserving_evicts_and_refuses_when_the_room_is_all_reserved() -> None:
    evicted: list[str] = []
    tier = MemoryTier(2 * CHUNK, on_evict=lambda t, k, n: evicted.append(k))
    await tier.put("old", _chunk(1))
    first = tier.reserve(CHUNK)
    second = tier.reserve(CHUNK)  # evicts "old" to make room
    assert first is not None and second is not None
    assert evicted == ["old"]
    assert tier.reserve(CHUNK) is None  # both halves are reserved: never over the bound
    assert tier.reserve(POOL_MIN_BYTES - 1) is None  # small values are simply put
    assert tier.reserve(3 * CHUNK) is None  # larger than the tier
    first.cancel()
    first.cancel()  # idempotent
    assert tier.reserved_bytes == CHUNK
    assert tier.pooled_bytes == CHUNK  # the cancelled buffer waits for the next reservation
    third = tier.reserve(CHUNK)
    assert third is not None and tier.pooled_bytes == 0
    for res in (second, third):
        res.cancel()
    assert tier.reserved_bytes == 0


async def test_a_reservation_is_stored_once_and_only_by_its_tier() -> None:
    tier, other = MemoryTier(4 * CHUNK), MemoryTier(4 * CHUNK, name="other")
    res = tier.reserve(CHUNK)
    assert res is not None
    with pytest.raises(TierError, match=r"not .*its own"):
        await other.put_reserved("k", res)
    await tier.put_reserved("k", res)
    with pytest.raises(TierError, match="no longer"):
        await tier.put_reserved("k2", res)
    res.cancel()  # a no-op once stored
    assert await tier.contains("k") and tier.reserved_bytes == 0


async def test_a_reserved_put_already_expired_stores_nothing() -> None:
    clock = _Clock()
    tier = MemoryTier(4 * CHUNK, clock=clock)
    await tier.put("k", _chunk(1))
    res = tier.reserve(CHUNK)
    assert res is not None
    await tier.put_reserved("k", res, expires_at=clock.now - 1)
    assert not await tier.contains("k")
    assert tier.reserved_bytes == 0
    assert (await tier.stats()).bytes == 0


async def test_a_put_while_the_room_is_all_reserved_is_stored_and_the_bound_comes_back() -> None:
    evicted: list[str] = []
    tier = MemoryTier(2 * CHUNK, on_evict=lambda t, k, n: evicted.append(k))
    first, second = tier.reserve(CHUNK), tier.reserve(CHUNK)
    assert first is not None and second is not None
    assert tier.reserve(CHUNK) is None

    def used() -> int:
        return tier.reserved_bytes + tier.pooled_bytes + tier._live_bytes

    await tier.put("x", _chunk(1))  # no room left: stored anyway, one value over the bound
    await tier.put("y", _chunk(2))  # ... evicting the previous such value first
    assert evicted == ["x"]
    assert await tier.get("y") == _chunk(2)
    assert used() == 3 * CHUNK

    first.view[:] = _chunk(3)
    await tier.put_reserved("a", first)  # back within the bound, the new value kept
    assert used() <= 2 * CHUNK
    assert evicted == ["x", "y"]
    assert await tier.get("a") == _chunk(3)
    second.cancel()
    assert used() <= 2 * CHUNK
    assert (await tier.stats()).evictions == 2

"""Tier throughput beside the naive way of doing the same thing, in one run; prints ratios.

    python bench/tiers.py [--sizes 1,4,32] [--seconds 0.5] [--redis redis://127.0.0.1:6379/0]

- memory put: the tier (LRU full, buffers recycled) vs ``dict[key] = bytes(data)`` (a fresh
  allocation per put, what a naive cache does); memory get_into vs a copy into a buffer.
- filesystem put (no fsync, then fsync) and get_into (``readinto`` the caller's buffer) vs
  ``Path.write_bytes`` / ``Path.read_bytes`` done in a thread.
- redis put/get_into vs bare ``redis.asyncio`` SET/GET of the same bytes (the tier's overhead).
Absolute GB/s swing between runs on a shared machine; compare the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

from kvgov.connectors.tiers.filesystem import FilesystemTier
from kvgov.connectors.tiers.memory import MemoryTier

MIB = 1024 * 1024


async def rate(op: Callable[[int], Awaitable[object]], nbytes: int, seconds: float) -> float:
    """GB/s of ``op(i)`` repeated for about ``seconds`` (after one warm-up call)."""
    await op(0)
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds or n < 3:
        n += 1
        await op(n)
    return nbytes * n / (time.perf_counter() - start) / 1e9


def row(label: str, size_mib: int, ours: float, base: float, base_label: str) -> None:
    print(
        f"{label:<22} {size_mib:>3} MiB  tier {ours:6.2f} GB/s   {base_label:<22} "
        f"{base:6.2f} GB/s   tier/baseline {ours / base:5.2f}x"
    )


async def bench_memory(size: int, seconds: float) -> None:
    data = os.urandom(size)
    slots = 8
    tier = MemoryTier(slots * size)
    naive: dict[str, bytes] = {}

    async def tier_put(i: int) -> None:
        await tier.put(f"k{i}", data)

    async def naive_put(i: int) -> None:
        naive[f"k{i}"] = bytes(memoryview(data))
        if len(naive) > slots:
            naive.pop(next(iter(naive)))

    dst = bytearray(size)

    async def tier_get(_i: int) -> None:
        assert await tier.get_into("hot", memoryview(dst)) == size

    async def copy(_i: int) -> None:
        memoryview(dst)[:] = data

    row(
        "memory put",
        size // MIB,
        await rate(tier_put, size, seconds),
        await rate(naive_put, size, seconds),
        "dict[k]=bytes(data)",
    )
    await tier.put("hot", data)
    row(
        "memory get_into",
        size // MIB,
        await rate(tier_get, size, seconds),
        await rate(copy, size, seconds),
        "memcpy into buffer",
    )


async def bench_filesystem(size: int, seconds: float, root: Path) -> None:
    data = os.urandom(size)
    dst = memoryview(bytearray(size))
    for fsync in (False, True):
        tier = await FilesystemTier.open(root / f"fs-{fsync}", fsync=fsync)
        plain = root / f"plain-{fsync}"
        plain.mkdir()

        async def tier_put(i: int, tier: FilesystemTier = tier) -> None:
            await tier.put(f"{i % 4:064x}", data)

        def write_plain(i: int, plain: Path = plain, fsync: bool = fsync) -> None:
            with (plain / str(i % 4)).open("wb") as f:
                f.write(data)
                if fsync:
                    os.fsync(f.fileno())

        async def plain_put(i: int) -> None:
            await asyncio.to_thread(write_plain, i)

        label = "filesystem put" + (" fsync" if fsync else "")
        row(
            label,
            size // MIB,
            await rate(tier_put, size, seconds),
            await rate(plain_put, size, seconds),
            "open/write" + (" + fsync" if fsync else ""),
        )
        if not fsync:

            async def tier_get(i: int, tier: FilesystemTier = tier) -> None:
                assert await tier.get_into(f"{i % 4:064x}", dst) == size

            async def plain_get(i: int, plain: Path = plain) -> None:
                await asyncio.to_thread((plain / str(i % 4)).read_bytes)

            row(
                "filesystem get_into",
                size // MIB,
                await rate(tier_get, size, seconds),
                await rate(plain_get, size, seconds),
                "Path.read_bytes",
            )
        await tier.close()


async def bench_redis(size: int, seconds: float, url: str) -> None:
    import redis.asyncio as aioredis

    from kvgov.connectors.tiers.redis import RedisTier

    prefix = f"kvgov-bench:{uuid.uuid4().hex[:8]}:"
    tier = await RedisTier.connect(url, prefix=prefix)
    client = aioredis.Redis.from_url(url)
    data = os.urandom(size)
    dst = bytearray(size)
    try:

        async def tier_put(i: int) -> None:
            await tier.put(f"{i % 4:x}", data)

        async def raw_put(i: int) -> None:
            await client.set(f"{prefix}raw{i % 4}", data)

        async def tier_get(i: int) -> None:
            await tier.get_into(f"{i % 4:x}", memoryview(dst))

        async def raw_get(i: int) -> None:
            await client.get(f"{prefix}raw{i % 4}")

        row(
            "redis put",
            size // MIB,
            await rate(tier_put, size, seconds),
            await rate(raw_put, size, seconds),
            "bare redis SET",
        )
        row(
            "redis get_into",
            size // MIB,
            await rate(tier_get, size, seconds),
            await rate(raw_get, size, seconds),
            "bare redis GET",
        )
    finally:
        keys = [k async for k in client.scan_iter(match=prefix + "*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()
        await tier.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1,4,32", help="chunk sizes in MiB")
    parser.add_argument("--seconds", type=float, default=0.4, help="time per measurement")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0", help="'' skips Redis")
    args = parser.parse_args()
    sizes = [int(s) * MIB for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory(prefix="kvgov-bench-") as tmp:
        for size in sizes:
            await bench_memory(size, args.seconds)
            await bench_filesystem(size, args.seconds, Path(tmp) / str(size))
            if args.redis:
                await bench_redis(size, args.seconds, args.redis)


if __name__ == "__main__":
    asyncio.run(main())

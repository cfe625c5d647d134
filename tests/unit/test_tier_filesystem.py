"""Filesystem tier specifics: restart recovery, atomicity across a real crash, what is on disk."""

from __future__ import annotations

import asyncio
import hashlib
import os
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kvgov.connectors.tiers.filesystem import FilesystemTier
from kvgov.connectors.tiers.fsformat import HEADER, encode_header, file_name

SRC = Path(__file__).resolve().parents[2] / "src"


def digest(n: int) -> str:
    return hashlib.blake2b(str(n).encode(), digest_size=32).hexdigest()


def files_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


async def test_a_new_instance_over_the_same_dir_sees_the_data(tmp_path: Path) -> None:
    root = tmp_path / "fs"
    tier = await FilesystemTier.open(root)
    values = {digest(i): os.urandom(1000 + i) for i in range(40)}
    for k, v in values.items():
        await tier.put(k, v)
    expiry = time.time() + 3600
    await tier.put(digest(99), b"ttl", expires_at=expiry)
    await tier.delete(digest(0))
    await tier.close()

    again = await FilesystemTier.open(root)
    try:
        for i, (k, v) in enumerate(values.items()):
            assert await again.get(k) == (None if i == 0 else v)
        info = await again.info(digest(99))
        assert info is not None
        assert info.expires_at == expiry
        stats = await again.stats()
        assert stats.entries == 40
        assert stats.bytes == sum(len(v) for v in values.values()) - 1000 + 3
    finally:
        await again.close()


async def test_open_removes_tmp_leftovers_and_unreadable_files(tmp_path: Path) -> None:
    root = tmp_path / "fs"
    tier = await FilesystemTier.open(root)
    await tier.put(digest(1), b"keep me")
    await tier.put(digest(2), b"will be truncated")
    await tier.close()
    sub = tier.path_of(digest(1)).parent
    stray = sub / f".{digest(3)}.abcdef.tmp"
    stray.write_bytes(b"half a write")
    truncated = tier.path_of(digest(2))
    truncated.write_bytes(truncated.read_bytes()[:-3])
    foreign = sub / "not-ours"
    foreign.write_bytes(b"garbage")

    again = await FilesystemTier.open(root)
    try:
        assert not stray.exists()
        assert not truncated.exists()
        assert not foreign.exists()
        assert await again.get(digest(1)) == b"keep me"
        assert [k async for k in again.iter_keys()] == [digest(1)]
    finally:
        await again.close()


async def test_a_crash_before_rename_leaves_no_entry(tmp_path: Path) -> None:
    root = tmp_path / "fs"
    tier = await FilesystemTier.open(root)
    await tier.put(digest(1), b"old value")
    await tier.close()
    # a real process dies (os._exit: no cleanup, no finally) right before the rename
    script = textwrap.dedent(
        f"""
        import asyncio, os, pathlib, sys
        from kvgov.connectors.tiers.filesystem import FilesystemTier

        def crash(*args, **kwargs):  # the tier renames with os.replace (relative to its root)
            os._exit(17)

        async def main():
            tier = await FilesystemTier.open(pathlib.Path({str(root)!r}))
            os.replace = crash
            await tier.put({digest(1)!r}, b"new value" * 1000)
            await tier.put({digest(2)!r}, b"never stored")

        asyncio.run(main())
        """
    )
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", script, env=env)
    assert await asyncio.wait_for(proc.wait(), timeout=60) == 17
    assert any(p.name.endswith(".tmp") for p in files_under(root))  # the torn write is there

    again = await FilesystemTier.open(root)
    try:
        assert await again.get(digest(1)) == b"old value"
        assert not await again.contains(digest(2))
        assert not any(p.name.endswith(".tmp") for p in files_under(root))
    finally:
        await again.close()


async def test_names_are_digests_and_files_hold_only_header_and_given_bytes(
    tmp_path: Path,
) -> None:
    root = tmp_path / "fs"
    tier = await FilesystemTier.open(root)
    sealed = {digest(i): os.urandom(5000 + i) for i in range(10)}
    raw_key = "tenant=acme/user=alice/model=llama/chunk=7"
    try:
        for k, v in sealed.items():
            await tier.put(k, v, expires_at=None if len(v) % 2 else time.time() + 60)
        await tier.put(raw_key, b"v")
    finally:
        await tier.close()
    on_disk = files_under(root)
    assert len(on_disk) == 11
    for path in on_disk:
        assert path.name == file_name(path.name) or path.name.startswith("~")
        assert len(path.parent.name) == 2
    # a key that is not a plain token is not used as a file name
    assert all("alice" not in str(p) for p in on_disk)
    assert file_name(raw_key).startswith("~")
    # each file is exactly our header, the key, then the given bytes
    again = await FilesystemTier.open(root)
    try:
        for k, v in sealed.items():
            content = again.path_of(k).read_bytes()
            info = await again.info(k)
            assert info is not None
            header = encode_header(k, len(v), info.expires_at)
            assert content == header + v
            assert len(header) == HEADER.size + len(k)
    finally:
        await again.close()


async def test_files_are_private_to_the_sidecar(tmp_path: Path) -> None:
    tier = await FilesystemTier.open(tmp_path / "fs")
    try:
        await tier.put(digest(1), b"x")
        path = tier.path_of(digest(1))
        assert path.stat().st_mode & 0o077 == 0
        assert path.parent.stat().st_mode & 0o077 == 0
    finally:
        await tier.close()


async def test_a_cancelled_get_into_returns_only_after_the_read_finished(tmp_path: Path) -> None:
    tier = await FilesystemTier.open(tmp_path / "fs", fsync=False)
    value = os.urandom(16 * 1024 * 1024)
    await tier.put(digest(1), value)
    dst = bytearray(len(value))
    task = asyncio.create_task(tier.get_into(digest(1), memoryview(dst)))
    await asyncio.sleep(0)  # the read is running in the pool
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # the worker is done with dst: it stays unchanged from here on
    snapshot = bytes(dst)
    await asyncio.sleep(0.05)
    assert bytes(dst) == snapshot
    assert await tier.get(digest(1)) == value
    await tier.close()


async def test_expired_file_is_removed_from_disk_on_access(tmp_path: Path) -> None:
    now = [1000.0]
    tier = await FilesystemTier.open(tmp_path / "fs", clock=lambda: now[0])
    try:
        await tier.put(digest(1), b"short", expires_at=1010.0)
        path = tier.path_of(digest(1))
        assert path.exists()
        now[0] = 1010.0
        assert await tier.get(digest(1)) is None
        assert not path.exists()
        assert (await tier.stats()).expirations == 1
    finally:
        await tier.close()


# -- the disk bound (review r16, finding 1; the attack: tests/security/test_tier_disk_bound.py) --


def _footprints(root: Path) -> int:
    """The block-rounded sizes of the tier's files, as the tier counts them."""
    block = os.statvfs(root).f_frsize or 4096
    return sum(-(-path.stat().st_size // block) * block for path in files_under(root))


async def test_concurrent_puts_keep_the_bound_and_an_exact_count(tmp_path: Path) -> None:
    """Puts in flight reserve their room before they write, so many at once (four worker
    threads) stay within the bound; once they are done the count is the files' again."""
    root = tmp_path / "fs"
    evicted: list[str] = []
    bound = 2 << 20
    tier = await FilesystemTier.open(
        root, fsync=False, max_bytes=bound, on_evict=lambda _t, k, _n: evicted.append(k)
    )
    try:
        values = {digest(i): os.urandom(200_000 + i) for i in range(48)}
        for start in range(0, 48, 8):
            batch = list(values.items())[start : start + 8]
            await asyncio.gather(*(tier.put(k, v) for k, v in batch))
            assert sum(p.stat().st_size for p in files_under(root)) <= bound
        assert tier.used_bytes == _footprints(root) <= bound
        held = [k async for k in tier.iter_keys()]
        assert sorted(held + evicted) == sorted(values)
        for k in held:
            assert await tier.get(k) == values[k]
        # overwrites and deletes keep the count exact too
        await tier.put(held[0], b"smaller")
        await tier.delete(held[1])
        assert tier.used_bytes == _footprints(root)
    finally:
        await tier.close()


async def test_an_evicted_key_put_again_at_once_keeps_its_new_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An entry evicted for one put and put again by another before the first put's worker
    removed the evicted file: the new file stays (the removal sees the key indexed again)."""
    root = tmp_path / "fs"
    evicted: list[str] = []
    bound = 1_500_000
    tier = await FilesystemTier.open(
        root, fsync=False, max_bytes=bound, on_evict=lambda _t, k, _n: evicted.append(k)
    )
    first, filler, second = digest(1), digest(2), digest(3)
    gate = threading.Event()
    drops: list[list[str]] = []
    drop = tier._drop

    def held_drop(victims: list[Any]) -> None:
        drops.append([k for k, _, _ in victims])
        if len(drops) == 1:  # the first put's removal waits until `first` is put again
            gate.wait(10)
        drop(victims)

    monkeypatch.setattr(tier, "_drop", held_drop)
    try:
        await tier.put(first, os.urandom(600_000))
        await tier.put(filler, os.urandom(600_000))
        evicting = asyncio.create_task(tier.put(second, os.urandom(600_000)))
        await asyncio.sleep(0)  # its room made: `first` evicted, its removal held
        assert evicted == [first]
        fresh = os.urandom(200_000)
        await tier.put(first, fresh)  # room enough: what `second` holds counts `first` once
        gate.set()
        await evicting
        assert evicted == [first] and drops == [[first]]
        assert tier.path_of(first).exists()
        assert await tier.get(first) == fresh
        assert tier.used_bytes == _footprints(root) <= bound
        assert sorted([k async for k in tier.iter_keys()]) == sorted([first, filler, second])
    finally:
        gate.set()
        await tier.close()

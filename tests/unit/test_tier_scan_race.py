"""The filesystem tier's start-up scan (fsroot.scan, _scan_dir) must survive a
file disappearing between the directory listing and its lstat.

That is exactly the situation of ``kvgov purge`` opening the tier beside a running sidecar
(commit 39315e7's scenario): the sidecar renames its put's ``.tmp`` into place, or unlinks an
expired/evicted/purged value, after the purge process listed the fan-out directory and before
it lstat'ed the name. ``os.stat(name, dir_fd=..., follow_symlinks=False)`` then raises
FileNotFoundError, which nothing catches: FilesystemTier.open fails (with a bare OSError, not a
TierError), and the purge stops. The code before 6c261c0 used ``unlink(missing_ok=True)`` and
caught OSError around ``parse_file``, so a vanished file was not fatal.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvgov.connectors.tiers import fsroot
from kvgov.connectors.tiers.filesystem import STRAY_MIN_AGE_S, FilesystemTier
from kvgov.connectors.tiers.fsformat import fanout, file_name


async def _seed(root: Path) -> tuple[str, str]:
    owner = await FilesystemTier.open(root, fsync=False)
    key = "a" * 64
    await owner.put(key, b"stored")
    await owner.close()
    return fanout(key), file_name(key)


async def test_a_put_finishing_during_the_scan_does_not_fail_the_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sidecar (owner) has a put in progress when kvgov purge opens the tier; the put's
    rename lands between the purge's listing of the fan-out directory and its lstat of the
    temporary name. Expected: the purge's open succeeds (the file simply is not there any
    more). Actual: FileNotFoundError out of FilesystemTier.open."""
    root = tmp_path / "fs"
    await _seed(root)
    other_key = "b" * 64
    # a put in progress of the running sidecar, in the same fan-out directory
    other_sub = fanout(other_key)
    (root / other_sub).mkdir(mode=0o700, exist_ok=True)
    tmp_name = f".{file_name(other_key)}.0123456789ab.tmp"
    (root / other_sub / tmp_name).write_bytes(b"half a put")

    real_stat = os.stat
    done = []

    def stat(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        # the sidecar's put completes (rename) just before the purge lstat's the tmp name
        if path == tmp_name and not done:
            done.append(True)
            (root / other_sub / tmp_name).replace(root / other_sub / file_name(other_key))
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(fsroot.os, "stat", stat)
    tier = await FilesystemTier.open(root, fsync=False, stray_min_age_s=STRAY_MIN_AGE_S)
    try:
        assert done, "the race was not exercised"
        assert await tier.get("a" * 64) == b"stored"
    finally:
        await tier.close()


async def test_a_value_deleted_during_the_scan_does_not_fail_the_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same with a value the running sidecar deletes (expiry sweep, eviction, a purge step)
    between the listing and the lstat."""
    root = tmp_path / "fs"
    await _seed(root)
    victim = "c" * 64
    owner = await FilesystemTier.open(root, fsync=False)
    await owner.put(victim, b"to be deleted")
    await owner.close()
    vsub, vname = fanout(victim), file_name(victim)

    real_stat = os.stat
    done = []

    def stat(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        if path == vname and not done:
            done.append(True)
            (root / vsub / vname).unlink()  # the sidecar's delete lands here
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(fsroot.os, "stat", stat)
    tier = await FilesystemTier.open(root, fsync=False, stray_min_age_s=STRAY_MIN_AGE_S)
    try:
        assert done, "the race was not exercised"
        assert await tier.get("a" * 64) == b"stored"
    finally:
        await tier.close()

"""Attack: a filesystem tier root (or fan-out directory) that another local user can write.

Review 2, finding 2. ``FilesystemTier`` created its root 0700 but never checked an existing
one's owner or mode (the ledger journal's ``test_journal_doors.py`` class of bug: an emptyDir
is 0777, a hostPath or an NVMe mount is shared, ``tiers.filesystem_path`` may sit under /tmp),
and its recovery walked every ``<root>/<2 hex>`` entry through symlinks, deleting each file
there that was not a tier file. A local user who could write the root planted ``00 -> /a/dir``
and the sidecar's next start deleted everything of its uid in that directory: its KEK, signing
key and pseudonym key, its ledger journal's lock, owner file and segments. A put wrote through
whatever ``<root>/<xx>`` was, a symlink or a directory the attacker owns (where the ciphertext
can be swapped or kept back).

Now (``docs/tiers.md``, "filesystem"): the root must be a real directory of the sidecar's own
uid that group and others cannot write, or the tier (and so the sidecar) does not start; it is
opened once (``O_NOFOLLOW``) and every later operation is relative to that descriptor. At
start, a fan-out entry that is a symlink, not a directory, another uid's or writable by group
or others is skipped (logged, counted), never entered or emptied; a put never writes through
one; only regular files of the sidecar's own uid in a checked fan-out directory are removed.
Skipping rather than refusing: inside a root only the sidecar (and the superuser) can write,
such an entry is a leftover (the root was shared once, then an operator fixed its mode) or the
superuser's; nothing outside the tier is at stake any more, and the puts it would take fail
closed (the chain stores such a value nowhere), so the sidecar stays up and says which entry
to remove.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import stat
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvgov.config import Settings
from kvgov.connectors.tiers.filesystem import FilesystemTier
from kvgov.connectors.tiers.fsformat import fanout
from kvgov.errors import KvgovError, TierError
from kvgov.proxy.app import Sidecar, build_sidecar
from kvgov.wire import RequestContext
from tests.security import doors
from tests.security.doors import key, run

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
NOBODY = 65534
CTX = RequestContext(request_id="r-root", tenant="acme", user="alice")


def digest(n: int) -> str:
    return hashlib.blake2b(str(n).encode(), digest_size=32).hexdigest()


def digest_in(sub: str, start: int = 0) -> str:
    """A key digest whose fan-out directory is ``sub``."""
    n = start
    while fanout(digest(n)) != sub:
        n += 1
    return digest(n)


def victim_dir(path: Path) -> dict[str, bytes]:
    """A directory of the sidecar's own files, and what they hold."""
    path.mkdir(mode=0o700)
    files = {name: os.urandom(32) for name in ("kek.key", "ledger-signing.key", "notes")}
    for name, data in files.items():
        (path / name).write_bytes(data)
        (path / name).chmod(0o600)
    return files


def contents(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in path.iterdir() if p.is_file()}


async def refused(root: Path) -> str:
    """The error that opening a tier on ``root`` raises (the test fails if it opens)."""
    with pytest.raises(TierError) as info:
        await FilesystemTier.open(root, fsync=False)
    return info.value.diagnostics()


# -- the sidecar -------------------------------------------------------------------------------


def _settings(tmp_path: Path, db: doors.ProdDatabase, root: Path | None = None) -> Settings:
    """A production sidecar whose KEK, signing key and pseudonym key live in ``keys/`` (a
    directory of its own, as `kvgov init` or a copied Secret leaves them)."""
    tiers: dict[str, object] = {"chain": ["memory", "filesystem"]}
    if root is not None:
        tiers["filesystem_path"] = root
    base = doors.tiered_settings(tmp_path, db, tiers)
    keys = tmp_path / "keys"
    keys.mkdir(mode=0o700, exist_ok=True)
    kek = doors.provisioned_kek(keys / "kek.key")
    doors.provisioned_keys(keys)  # production never makes them (the copied Secret's files)
    return base.model_copy(
        update={
            "keys": base.keys.model_copy(update={"kek_path": kek}),
            "ledger": base.ledger.model_copy(
                update={
                    "signing_key_path": keys / "ledger-signing.key",
                    "pseudonym_key_path": keys / "pseudonym.key",
                }
            ),
        }
    )


@contextlib.asynccontextmanager
async def _running(settings: Settings) -> AsyncIterator[Sidecar]:
    sc = await build_sidecar(settings)
    try:
        await sc.start()
        yield sc
    finally:
        with contextlib.suppress(Exception):
            await sc.stop()


@pytest.mark.postgres
async def test_a_planted_fanout_symlink_in_a_shared_root_deletes_nothing_and_is_refused(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    shared = tmp_path / "shared-disk"  # the sidecar's own at first, later one others can write
    shared.mkdir(mode=0o700)
    settings = _settings(tmp_path, prod_db, shared)
    async with _running(settings):  # the first start: keys and journal made, root its own
        pass
    shared.chmod(0o1777)  # ... then shared (or the same disk seen by another container)
    keys, journal = tmp_path / "keys", settings.journal_path
    before = {"keys": contents(keys), "journal": contents(journal)}
    assert {"kek.key", "ledger-signing.key", "pseudonym.key"} <= set(before["keys"])
    assert {"lock", "chain"} <= set(before["journal"])
    # the attacker: one symlink per target, any two hex digits
    (shared / "00").symlink_to(keys)
    (shared / "01").symlink_to(journal)
    with pytest.raises(KvgovError) as info:
        async with _running(settings):
            pass
    after = {"keys": contents(keys), "journal": contents(journal)}
    assert after == before, "the sidecar deleted its own files through a planted symlink"
    said = info.value.diagnostics()
    assert "tier filesystem failed to start" in said and str(shared) in said
    assert "drwxrwxrwt" in said and "hint:" in said and "tiers.filesystem_path" in said


@pytest.mark.postgres
async def test_a_fanout_symlink_in_the_sidecars_own_root_is_skipped_and_deletes_nothing(
    tmp_path: Path, prod_db: doors.ProdDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    """A symlink left in a root that is private now (planted while it was shared, before an
    operator fixed its mode): the sidecar starts and serves, and never enters it."""
    settings = _settings(tmp_path, prod_db)
    async with _running(settings):  # keys, journal, an empty tier root of its own
        pass
    root = settings.filesystem_tier_path
    assert stat.S_IMODE(root.lstat().st_mode) == 0o700
    keys, journal = tmp_path / "keys", settings.journal_path
    keys_before = contents(keys)
    (root / "00").symlink_to(keys)
    (root / "01").symlink_to(journal)
    caplog.set_level(logging.INFO, logger="kvgov.connectors.tiers.filesystem")
    async with _running(settings) as sc:
        assert {"lock", "chain"} <= set(contents(journal))  # the journal it holds is intact
        assert contents(keys) == keys_before
        named = sc.pipeline.pseudonymizer.key_digest
        into_00 = next(n for n in range(100_000) if fanout(named(key(n, "acme"))) == "00")
        elsewhere = next(n for n in range(100_000) if fanout(named(key(n, "acme"))) == "ab")
        client = doors.engine(sc, "tok-acme")
        try:
            payload = os.urandom(4096)
            assert (await run(client.put, key(elsewhere, "acme"), payload, CTX)).ok
            got = await run(client.get, key(elsewhere, "acme"), CTX)
            assert doors.value_of(got) == payload
            # a value whose file would go through the symlink: stored nowhere, written nowhere
            assert not (await run(client.put, key(into_00, "acme"), payload, CTX)).ok
            assert doors.value_of(await run(client.get, key(into_00, "acme"), CTX)) is None
        finally:
            client.close()
        assert contents(keys) == keys_before
    assert contents(keys) == keys_before
    assert {"lock", "chain"} <= set(contents(journal))
    assert (root / "00").is_symlink() and (root / "01").is_symlink()
    skipped = [r for r in caplog.records if r.getMessage() == "tier.untrusted_skipped"]
    assert skipped and all(r.fanout_dirs == ["00", "01"] for r in skipped)


@pytest.mark.postgres
async def test_a_sidecar_does_not_start_on_a_tier_root_others_can_write(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    root = tmp_path / "shared-disk"
    root.mkdir()
    root.chmod(0o777)
    settings = _settings(tmp_path, prod_db, root)
    with pytest.raises(KvgovError) as info:
        async with _running(settings):
            pass
    said = info.value.diagnostics()
    assert "tier filesystem failed to start" in said and "not this process's own" in said
    assert "hint:" in said


# -- the root ----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770, 0o730, 0o702], ids=oct)
async def test_a_tier_root_others_can_write_is_refused(tmp_path: Path, mode: int) -> None:
    root = tmp_path / "fs"
    root.mkdir()
    root.chmod(mode)
    said = await refused(root)
    assert str(root) in said and stat.filemode(stat.S_IFDIR | mode) in said
    assert "hint:" in said and "chmod 700" in said


async def test_a_tier_root_readable_by_others_is_accepted(tmp_path: Path) -> None:
    """Group and others may read and enter it (the journal's rule): its fan-out directories
    are 0700 and its files 0600, so they list only the 256 fan-out names."""
    root = tmp_path / "fs"
    root.mkdir()
    root.chmod(0o755)
    tier = await FilesystemTier.open(root, fsync=False)
    try:
        await tier.put(digest(1), b"v")
        sub = tier.path_of(digest(1)).parent
        assert stat.S_IMODE(sub.stat().st_mode) == 0o700
        assert stat.S_IMODE(tier.path_of(digest(1)).stat().st_mode) == 0o600
    finally:
        await tier.close()


@ROOT_ONLY
async def test_a_foreign_owned_tier_root_is_refused(tmp_path: Path) -> None:
    """Another uid's root, 0700 or not: also what an attacker who can write the root's parent
    gets by creating the root before kvgov does (kvgov's mkdir finds it there)."""
    root = tmp_path / "fs"
    root.mkdir(mode=0o700)
    os.chown(root, NOBODY, NOBODY)
    said = await refused(root)
    assert f"owner uid {NOBODY}" in said and f"runs as uid {os.geteuid()}" in said
    # created first by the attacker inside a parent they can write, with a planted symlink
    parent = tmp_path / "shared"
    parent.mkdir(mode=0o1777)
    victim = victim_dir(tmp_path / "keys")
    early = parent / "tier"
    early.mkdir(mode=0o755)
    (early / "00").symlink_to(tmp_path / "keys")
    os.chown(early, NOBODY, NOBODY)
    await refused(early)
    assert contents(tmp_path / "keys") == victim


async def test_a_symlinked_tier_root_is_refused(tmp_path: Path) -> None:
    """Even to a private directory of the sidecar's own: the root is what was configured."""
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    victim = victim_dir(tmp_path / "keys")
    (real / "00").symlink_to(tmp_path / "keys")
    root = tmp_path / "fs"
    root.symlink_to(real)
    said = await refused(root)
    assert "symlink" in said and str(root) in said
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "not-yet")
    assert "symlink" in await refused(dangling)
    assert not (tmp_path / "not-yet").exists(), "created a directory through a symlink"
    assert contents(tmp_path / "keys") == victim


async def test_a_tier_root_that_is_not_a_directory_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "fs"
    root.write_bytes(b"")
    assert "not a directory" in await refused(root)


# -- fan-out directories -----------------------------------------------------------------------


async def test_a_planted_fanout_symlink_deletes_nothing_it_points_to(tmp_path: Path) -> None:
    root = tmp_path / "fs"
    root.mkdir(mode=0o700)
    victim = victim_dir(tmp_path / "keys")
    (root / "00").symlink_to(tmp_path / "keys")
    tier = await FilesystemTier.open(root, fsync=False)
    try:
        assert contents(tmp_path / "keys") == victim
        await tier.put(digest(1), b"a value")  # the tier works for every other fan-out
        assert await tier.get(digest(1)) == b"a value"
    finally:
        await tier.close()


@pytest.mark.parametrize("when", ["before open", "after open"])
async def test_a_fanout_symlink_planted_before_the_first_put_is_not_written_through(
    tmp_path: Path, when: str
) -> None:
    root = tmp_path / "fs"
    root.mkdir(mode=0o700)
    elsewhere = tmp_path / "attacker"
    elsewhere.mkdir(mode=0o777)
    k = digest_in("7f")
    if when == "before open":
        (root / "7f").symlink_to(elsewhere)
    tier = await FilesystemTier.open(root, fsync=False)
    try:
        if when == "after open":
            (root / "7f").symlink_to(elsewhere)
        with pytest.raises(TierError, match="7f"):
            await tier.put(k, b"ciphertext")
        assert list(elsewhere.iterdir()) == [], "the put wrote through the planted symlink"
        assert await tier.get(k) is None
        assert not await tier.delete(k)
        assert (root / "7f").is_symlink()
        await tier.put(digest_in("80"), b"elsewhere")  # other fan-outs are unaffected
    finally:
        await tier.close()


@pytest.mark.parametrize("owner", ["nobody", "loose"])
async def test_a_fanout_dir_others_own_or_write_is_skipped_and_not_emptied(
    tmp_path: Path, owner: str
) -> None:
    if owner == "nobody" and os.geteuid() != 0:
        pytest.skip("chown to another uid needs root")
    root = tmp_path / "fs"
    tier = await FilesystemTier.open(root, fsync=False)
    k = digest_in("3c")
    await tier.put(k, b"mine")
    await tier.close()
    sub = root / "3c"
    (sub / "not-a-tier-file").write_bytes(b"theirs")
    (sub / ".x.tmp").write_bytes(b"theirs too")
    if owner == "nobody":
        os.chown(sub, NOBODY, NOBODY)
    else:
        sub.chmod(0o777)
    before = contents(sub)
    again = await FilesystemTier.open(root, fsync=False)
    try:
        assert contents(sub) == before, "recovery emptied a directory it does not trust"
        assert await again.get(k) is None  # its entries are not in the index
        with pytest.raises(TierError, match="3c"):
            await again.put(digest_in("3c", 1000), b"new")
        assert contents(sub) == before
    finally:
        await again.close()


async def test_recovery_removes_only_the_sidecars_own_regular_files(tmp_path: Path) -> None:
    """In a fan-out directory of its own: a symlink (named like a leftover or a value), a FIFO
    (opening it would hang the start) and another uid's file are left; its own litter goes."""
    root = tmp_path / "fs"
    tier = await FilesystemTier.open(root, fsync=False)
    k = digest_in("5a")
    await tier.put(k, b"kept")
    await tier.close()
    sub = root / "5a"
    victim = victim_dir(tmp_path / "keys")
    (sub / ".stale.abc.tmp").symlink_to(tmp_path / "keys" / "kek.key")
    (sub / digest_in("5a", 10_000)).symlink_to(tmp_path / "keys" / "ledger-signing.key")
    os.mkfifo(sub / "a-fifo")
    (sub / "junk").write_bytes(b"not a tier file")  # ours: removed as before
    (sub / ".left.def.tmp").write_bytes(b"")  # ours: removed as before
    if os.geteuid() == 0:
        (sub / "theirs").write_bytes(b"x")
        os.chown(sub / "theirs", NOBODY, NOBODY)
    opened = threading.Event()
    stuck: list[bool] = []

    def rescue() -> None:  # a start blocked opening the FIFO is freed (and found out) after 5 s
        if not opened.wait(5):
            stuck.append(True)
            os.close(os.open(sub / "a-fifo", os.O_WRONLY | os.O_NONBLOCK))

    rescuer = threading.Thread(target=rescue)
    rescuer.start()
    try:
        again = await FilesystemTier.open(root, fsync=False)
    finally:
        opened.set()
        rescuer.join()
    try:
        assert not stuck, "the start hung opening a FIFO planted in a fan-out directory"
        names = {p.name for p in sub.iterdir()}
        assert {".stale.abc.tmp", digest_in("5a", 10_000), "a-fifo"} <= names
        assert "junk" not in names and ".left.def.tmp" not in names
        if os.geteuid() == 0:
            assert "theirs" in names
        assert contents(tmp_path / "keys") == victim
        assert await again.get(k) == b"kept"
    finally:
        await again.close()


async def test_a_root_swapped_while_running_is_not_followed(tmp_path: Path) -> None:
    """Whoever can write the root's parent (an emptyDir data_dir) renames the root away and
    puts a symlink in its place: the running tier keeps using the directory it checked."""
    parent = tmp_path / "data"
    parent.mkdir(mode=0o777)
    root = parent / "fs"
    tier = await FilesystemTier.open(root, fsync=False)
    try:
        await tier.put(digest_in("11"), b"before")
        victim_dir(tmp_path / "keys")
        (tmp_path / "keys" / "11").mkdir(mode=0o700)
        root.rename(parent / "moved")
        root.symlink_to(tmp_path / "keys")
        await tier.put(digest_in("11", 500), b"after")
        await tier.delete(digest_in("11"))
        assert list((tmp_path / "keys" / "11").iterdir()) == []
        assert (parent / "moved" / "11" / digest_in("11", 500)).is_file()
    finally:
        await tier.close()

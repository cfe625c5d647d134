"""Right to be forgotten end to end: real LMCache engines on CPU, a real sidecar on Postgres,
``kvgov purge --user U --tenant T --yes`` as an operator runs it (a subprocess).

After the purge: none of U's chunks is served from any tier (lookup 0 from both engines, their
local CPU tiers included), other users' and tenants' chunks still hit, a ciphertext file copied
aside before the purge can no longer be opened, and ``kvgov audit verify`` passes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("lmcache")

from sqlalchemy import select

from kvgov.connectors.tiers.filesystem import FilesystemTier
from kvgov.db.keystore import SqlKeyStore
from kvgov.db.models import CacheEntry
from kvgov.errors import KeyDestroyedError
from kvgov.keys import sealformat
from kvgov.keys.kek import FileKekProvider
from kvgov.keys.keyring import Keyring
from kvgov.types import EntryState
from tests import lmcache_harness as h
from tests.e2e import served

pytestmark = [pytest.mark.lmcache, pytest.mark.postgres, pytest.mark.slow]

G = h.Geometry()
TENANTS = ["acme", "globex"]
PURGE_ENV = {"KVGOV_PURGE__POLL_INTERVAL_S": "0.1", "KVGOV_PURGE__JOB_TIMEOUT_S": "60"}


@pytest.fixture
def data_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvp-"))  # short: the Unix socket lives here
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def sidecar(data_dir: Path, pg_url: str) -> Iterator[h.SidecarThread]:
    env = {**h.sidecar_env(data_dir, tenants=TENANTS, database_url=pg_url), **PURGE_ENV}
    sc = h.SidecarThread(env).start()
    try:
        yield sc
    finally:
        sc.stop()


def kvgov(sc: h.SidecarThread, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGOV_")}
    return served.kvgov(env | sc.env, *args)


def _store(engine: h.Engine, toks: list[int], ids: dict[str, str], seed: int) -> None:
    engine.fill(len(toks), seed=seed)
    engine.store(toks, ids)
    engine.wait_remote_puts()


def test_purge_user_with_real_engines_and_sidecar(sidecar: h.SidecarThread, tmp_path: Path) -> None:
    alice_toks = h.tokens(3 * G.chunk, seed=31)
    alice_tenant_toks = h.tokens(2 * G.chunk, seed=32)  # alice's tenant-scoped chunks
    bob_toks = h.tokens(2 * G.chunk, seed=33)
    globex_toks = h.tokens(2 * G.chunk, seed=34)
    alice = h.identity("acme", user_scope="alice", user="alice", request_id="r-a")
    alice_shared = h.identity("acme", user="alice", request_id="r-a2")
    bob = h.identity("acme", user_scope="bob", user="bob", request_id="r-b")
    globex = h.identity("globex", user_scope="alice", user="alice", request_id="r-g")
    cfg_a = h.kvgov_config(sidecar.endpoint, local_cpu=True, engine_id="engine-a")
    cfg_b = h.kvgov_config(sidecar.endpoint, local_cpu=True, engine_id="engine-b")
    with h.engines(cfg_a, cfg_b) as (a, b):
        for e in (a, b):
            assert e.remote_connector().control.connected.wait(10)
        _store(a, alice_toks, alice, seed=1)
        _store(a, alice_tenant_toks, alice_shared, seed=2)
        _store(a, bob_toks, bob, seed=3)
        _store(a, globex_toks, globex, seed=4)
        # engine B reads alice's chunks: now both engines' CPU tiers hold them
        assert b.retrieve(alice_toks, alice) == len(alice_toks)
        assert b.local_cpu_hits(alice_toks, alice) == len(alice_toks)
        assert a.local_cpu_hits(alice_toks, alice) == len(alice_toks)

        # a ciphertext file of alice's, copied aside before the purge
        digest = sidecar.key_digest(a.key_strings(alice_toks, alice)[0])
        fs_tier = sidecar.sidecar.tiers.tier("filesystem")
        src = fs_tier.path_of(digest)
        aside = tmp_path / "aside" / src.relative_to(fs_tier.root)
        aside.parent.mkdir(parents=True)
        shutil.copy2(src, aside)

        done = kvgov(sidecar, "purge", "--user", "alice", "--tenant", "acme", "--yes", "--json")
        assert done.returncode == 0, done.stdout + done.stderr
        job = json.loads(done.stdout)
        receipt = job["receipt"]["receipt"]
        assert receipt["state"] == "completed", receipt["incomplete"]
        assert receipt["entries_purged"] == 5
        assert receipt["engines"]["acknowledged"] == ["engine-a", "engine-b"]
        assert receipt["engines"]["unreachable"] == []
        assert sidecar.sidecar.sidecar_id in receipt["sidecars"]
        by_label = {
            s["name"] + ("@" + s["sidecar_id"] if s["sidecar_id"] else ""): s for s in job["steps"]
        }
        engines_step = by_label[f"engines@{sidecar.sidecar.sidecar_id}"]
        assert engines_step["detail"]["removed"] == {"engine-a": 5, "engine-b": 3}

        # none of alice's chunks is served from any tier, from either engine
        for e in (a, b):
            assert e.local_cpu_hits(alice_toks, alice) == 0
            assert e.local_cpu_hits(alice_tenant_toks, alice_shared) == 0
            assert e.lookup(alice_toks, alice) == 0
            assert e.lookup(alice_tenant_toks, alice_shared) == 0
        # everyone else still hits
        assert b.lookup(bob_toks, bob) == len(bob_toks)
        assert b.retrieve(bob_toks, bob) == len(bob_toks)
        assert b.lookup(globex_toks, globex) == len(globex_toks)

    # the copied file is intact but unreadable: its data key was destroyed
    async def read_aside() -> bytes | None:
        tier = await FilesystemTier.open(tmp_path / "aside", fsync=False)
        try:
            return await tier.get(digest)
        finally:
            await tier.close()

    value = sidecar.call(read_aside())
    assert value is not None
    envelope = sealformat.parse(memoryview(value))
    keyring = Keyring(
        SqlKeyStore(sidecar.sidecar.engine), FileKekProvider(sidecar.settings.kek_path)
    )
    with pytest.raises(KeyDestroyedError):
        envelope.reader(keyring, tenant="acme", cache_key=digest.encode())

    with sidecar.session() as s:
        states = dict(s.execute(select(CacheEntry.key_digest, CacheEntry.state)).all())
    assert states[digest] is EntryState.PURGED
    assert sum(1 for v in states.values() if v is EntryState.LIVE) == 4

    audit = kvgov(sidecar, "audit", "verify")
    assert audit.returncode == 0, audit.stdout + audit.stderr


def _wait_control(sc: h.SidecarThread, engines: int, timeout_s: float = 20.0) -> None:
    """Wait until ``engines`` control connections are registered with this sidecar."""
    deadline = time.monotonic() + timeout_s
    while len(sc.sidecar.server.controls) < engines:
        assert time.monotonic() < deadline, "the engines' control channels did not reconnect"
        time.sleep(0.05)


def _wait_disk(engine: h.Engine, chunks: int, timeout_s: float = 20.0) -> None:
    """Wait until the engine's disk tier has written ``chunks`` chunks (it writes behind)."""
    backend = engine.local_backend("LocalDiskBackend")
    assert backend is not None, "the engine has no disk tier"
    deadline = time.monotonic() + timeout_s
    while len(backend.dict) < chunks:
        assert time.monotonic() < deadline, "the engine's disk tier did not fill"
        time.sleep(0.05)


def test_purge_after_a_sidecar_restart_evicts_from_the_engine_local_tiers(
    data_dir: Path, pg_url: str
) -> None:
    """The sidecar that saw the keys is gone; the one that purges knows only the ledger's
    digests. The engine still drops the user's chunks from its CPU and disk tiers (it matches
    the digests with the key-digest key its control connection was given), and keeps
    everyone else's."""
    env = {**h.sidecar_env(data_dir, tenants=TENANTS, database_url=pg_url), **PURGE_ENV}
    alice_toks = h.tokens(3 * G.chunk, seed=41)
    bob_toks = h.tokens(2 * G.chunk, seed=42)
    alice = h.identity("acme", user_scope="alice", user="alice", request_id="r-a")
    bob = h.identity("acme", user_scope="bob", user="bob", request_id="r-b")
    first = h.SidecarThread(env).start()
    disk = data_dir / "engine-disk"
    disk.mkdir()
    cfg = h.kvgov_config(first.endpoint, local_cpu=True, local_disk=disk, engine_id="engine-a")
    second: h.SidecarThread | None = None
    try:
        with h.engines(cfg) as (e,):
            _wait_control(first, 1)
            _store(e, alice_toks, alice, seed=1)
            _store(e, bob_toks, bob, seed=2)
            _wait_disk(e, (len(alice_toks) + len(bob_toks)) // G.chunk)
            assert e.local_cpu_hits(alice_toks, alice) == len(alice_toks)
            assert e.local_hits(alice_toks, alice, "LocalDiskBackend") == len(alice_toks)
            alice_digests = {first.key_digest(k) for k in e.key_strings(alice_toks, alice)}

            first.stop()  # a new process on the same data dir and ledger: it never saw a key
            second = h.SidecarThread(env).start()
            _wait_control(second, 1)

            done = kvgov(second, "purge", "--user", "alice", "--tenant", "acme", "--yes", "--json")
            assert done.returncode == 0, done.stdout + done.stderr
            job = json.loads(done.stdout)
            receipt = job["receipt"]["receipt"]
            assert receipt["state"] == "completed", receipt["incomplete"]
            assert receipt["entries_purged"] == len(alice_digests)
            assert receipt["engines"]["acknowledged"] == ["engine-a"]
            [engines_step] = [s for s in job["steps"] if s["name"] == "engines"]
            assert engines_step["detail"]["removed"] == {"engine-a": len(alice_digests)}

            # alice's chunks are gone from the engine's own tiers; bob's are all still there
            for tier in ("LocalCPUBackend", "LocalDiskBackend"):
                assert e.local_hits(alice_toks, alice, tier) == 0
                assert e.local_hits(bob_toks, bob, tier) == len(bob_toks)
            assert e.lookup(alice_toks, alice) == 0
            assert e.retrieve(bob_toks, bob) == len(bob_toks)
    finally:
        if second is not None:
            second.stop()
        first.stop()

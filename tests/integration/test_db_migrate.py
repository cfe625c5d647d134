"""Fleet-safe migrations: ``kvgov db upgrade`` from many processes at once, its timeouts, and a
production sidecar that refuses an old schema instead of migrating it.

Real ``kvgov`` subprocesses on the local Postgres (and SQLite); no timed assertions: the test
waits until Postgres itself shows every other upgrade queued on the migration lock.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest
from pydantic import ValidationError

from kvgov.config import Settings
from kvgov.db import engine as engine_module
from kvgov.db.engine import (
    MIGRATION_LOCK_KEY,
    MigrationLimits,
    current_revision,
    head_revision,
    known_revisions,
    upgrade,
)
from kvgov.errors import LedgerError, StartupError
from kvgov.proxy.app import build_sidecar

pytestmark = pytest.mark.postgres

PASSWORD = "n0t-in-any-message"


def _dsn(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def _env(url: str, data_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGOV_")}
    env.update({"KVGOV_DATABASE_URL": url, "KVGOV_DATA_DIR": str(data_dir), **extra})
    return env


def _kvgov(env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "kvgov", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _waiting_on_migration_lock(dsn: str) -> int:
    """Sessions of this database queued on the migration lock (a 64-bit advisory key shows as
    classid = its high 32 bits, objid = its low 32 bits, objsubid = 1)."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
            " AND classid = %s AND objid = %s AND objsubid = 1"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
            (MIGRATION_LOCK_KEY >> 32, MIGRATION_LOCK_KEY & 0xFFFFFFFF),
        ).fetchone()
    return int(row[0]) if row else 0


def _assert_each_revision_applied_once(outputs: list[tuple[int, str, str]]) -> None:
    for code, out, err in outputs:
        assert code == 0, out + err
    applied = Counter(
        line for _, out, _ in outputs for line in out.splitlines() if line.startswith("applied ")
    )
    assert applied == Counter(f"applied revision {r}" for r in known_revisions())
    appliers = [out for _, out, _ in outputs if "applied revision" in out]
    assert len(appliers) == 1  # from an empty database: one process applied them all
    assert sum("(nothing to do)" in out for _, out, _ in outputs) == len(outputs) - 1
    head = head_revision()
    assert all(f"database at revision {head}" in out for _, out, _ in outputs)


@pytest.mark.slow
@pytest.mark.parametrize(
    "queued", [True, False], ids=["queued-behind-a-holder", "started-together"]
)
def test_many_upgrades_at_once_apply_each_revision_exactly_once(
    pg_url: str, tmp_path: Path, queued: bool
) -> None:
    """Six ``kvgov db upgrade`` processes on an empty database. ``queued``: the test holds the
    migration lock until Postgres shows all six waiting for it, so they are provably
    concurrent; otherwise they simply start together."""
    env = _env(pg_url, tmp_path)
    holder = psycopg.connect(_dsn(pg_url), autocommit=True) if queued else None
    try:
        if holder is not None:
            holder.execute("SELECT pg_advisory_lock(%s)", (MIGRATION_LOCK_KEY,))
        procs = [_kvgov(env, "db", "upgrade") for _ in range(6)]
        if holder is not None:
            deadline = time.monotonic() + 120
            while _waiting_on_migration_lock(_dsn(pg_url)) < len(procs):
                assert time.monotonic() < deadline, "the upgrades never queued on the lock"
                assert all(p.poll() is None for p in procs), "an upgrade ended before the lock"
                time.sleep(0.1)
            assert current_revision(pg_url) is None  # nobody migrated without the lock
            holder.execute("SELECT pg_advisory_unlock(%s)", (MIGRATION_LOCK_KEY,))
        outputs = []
        for proc in procs:
            out, err = proc.communicate(timeout=240)
            outputs.append((proc.returncode, out, err))
    finally:
        if holder is not None:
            holder.close()
    _assert_each_revision_applied_once(outputs)
    assert current_revision(pg_url) == head_revision()


@pytest.mark.slow
def test_many_sqlite_upgrades_at_once(sqlite_url: str, tmp_path: Path) -> None:
    """SQLite: BEGIN IMMEDIATE takes the database's write lock before the revision is read."""
    env = _env(sqlite_url, tmp_path)
    procs = [_kvgov(env, "db", "upgrade") for _ in range(4)]
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=240)
        outputs.append((proc.returncode, out, err))
    _assert_each_revision_applied_once(outputs)


def test_upgrade_gives_up_on_a_table_lock_and_changes_nothing(pg_url: str) -> None:
    """A sidecar's open transaction on ``chains`` (ROW EXCLUSIVE) blocks 0003's foreign key:
    the upgrade fails after ``lock_timeout`` instead of queueing every writer behind it."""
    upgrade(pg_url, "0002")
    with psycopg.connect(_dsn(pg_url)) as sidecar:
        sidecar.execute(
            "INSERT INTO chains (chain_id, public_key, created_at) VALUES ('c', %s, now())",
            (b"\x01" * 32,),
        )
        with pytest.raises(LedgerError) as err:
            upgrade(pg_url, limits=MigrationLimits(lock_timeout_s=0.2))
        assert "lock timeout" in err.value.message
        assert "migration_lock_timeout_s" in err.value.diagnostics()
        assert current_revision(pg_url) == "0002"
        sidecar.rollback()
    assert upgrade(pg_url) == sorted(r for r in known_revisions() if r > "0002")
    assert current_revision(pg_url) == head_revision()


def test_upgrade_waits_for_the_lock_only_so_long(pg_url: str) -> None:
    with psycopg.connect(_dsn(pg_url), autocommit=True) as other:
        other.execute("SELECT pg_advisory_lock(%s)", (MIGRATION_LOCK_KEY,))
        with pytest.raises(LedgerError, match="held the migration lock"):
            upgrade(pg_url, limits=MigrationLimits(wait_s=0.2))
    assert current_revision(pg_url) is None
    assert upgrade(pg_url) == sorted(known_revisions())


def _hold_sqlite_write_lock(url: str) -> sqlite3.Connection:
    holder = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    return holder


def test_a_sqlite_upgrade_waits_for_another_past_the_runtime_busy_timeout(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite: an upgrade queued behind another's write lock waits up to
    ``database.migration_wait_s``, not the runtime busy timeout (10 s, shortened here): four
    ``kvgov db upgrade`` on a slow machine failed "database is locked" while one applied."""
    upgrade(sqlite_url, "0001")
    monkeypatch.setattr(engine_module, "SQLITE_BUSY_TIMEOUT_MS", 100)
    holder = _hold_sqlite_write_lock(sqlite_url)
    result: list[object] = []
    waiter = threading.Thread(target=lambda: result.append(_outcome(upgrade, sqlite_url)))
    waiter.start()
    try:
        waiter.join(1.0)  # ten of the shortened busy timeouts
        assert waiter.is_alive(), f"the upgrade did not wait for the write lock: {result}"
    finally:
        holder.rollback()
        holder.close()
    waiter.join(60)
    assert result == [sorted(set(known_revisions()) - {"0001"})]


def test_a_sqlite_upgrade_waits_for_the_write_lock_only_so_long(sqlite_url: str) -> None:
    upgrade(sqlite_url, "0001")
    holder = _hold_sqlite_write_lock(sqlite_url)
    try:
        with pytest.raises(LedgerError, match="held the database's write lock") as err:
            upgrade(sqlite_url, limits=MigrationLimits(wait_s=0.2))
        assert "migration_wait_s" in str(err.value.hint)
    finally:
        holder.rollback()
        holder.close()
    assert current_revision(sqlite_url) == "0001"


@pytest.mark.parametrize(
    "field", ["migration_wait_s", "migration_lock_timeout_s", "migration_statement_timeout_s"]
)
def test_migration_limits_are_finite(field: str, tmp_path: Path) -> None:
    """An infinite limit failed only inside the upgrade, as an opaque error (round(inf) on
    SQLite, lock_timeout='inf' on Postgres); 0 is how to say "no limit"."""
    with pytest.raises(ValidationError, match=field):
        Settings(data_dir=tmp_path, database={field: float("inf")})


def _outcome(fn: Callable[..., object], *args: object) -> object:
    try:
        return fn(*args)
    except Exception as exc:  # the test reports it
        return exc


def _production(url: str, tmp_path: Path) -> Settings:
    return Settings(
        environment="production",
        data_dir=tmp_path / "data",
        database={"url": url, "runtime_role": "kvgov_runtime"},
        keys={"kek_path": str(tmp_path / "kek.key")},
        dataplane={"engine_tokens": {"t0ken": "engine-a"}, "host": "", "lm_port": -1},
        purge={"no_gpu_prefix_cache": True},
        tiers={"filesystem_max_bytes": 2 << 30},
    )


async def test_a_production_sidecar_on_an_old_schema_refuses_to_start(
    pg_url: str, tmp_path: Path
) -> None:
    upgrade(pg_url, "0002")
    url = pg_url.replace("postgres@", f"postgres:{PASSWORD}@", 1)
    with pytest.raises(StartupError) as err:
        await build_sidecar(_production(url, tmp_path))
    text = err.value.diagnostics()
    assert "the ledger database is at revision 0002" in text
    assert f"this kvgov needs revision {head_revision()}" in text
    assert "run `kvgov db upgrade`" in text and "migration role" in text
    assert PASSWORD not in text
    assert current_revision(pg_url) == "0002"  # it did not migrate

    # the same from `kvgov serve`: a configuration error (exit 2) with the message
    env = _env(
        url,
        tmp_path / "data",
        KVGOV_ENVIRONMENT="production",
        KVGOV_PURGE__NO_GPU_PREFIX_CACHE="true",  # no vLLM here
        KVGOV_DATABASE__RUNTIME_ROLE="kvgov_runtime",
        KVGOV_KEYS__KEK_PATH=str(tmp_path / "kek.key"),
        KVGOV_DATAPLANE__ENGINE_TOKENS='{"t0ken": "engine-a"}',
        KVGOV_DATAPLANE__LM_PORT="-1",
        KVGOV_DATAPLANE__PORT="0",
        KVGOV_TIERS__FILESYSTEM_MAX_BYTES=str(2 << 30),
    )
    proc = _kvgov(env, "serve")
    out, err_text = proc.communicate(timeout=120)
    assert proc.returncode == 2, out + err_text
    assert "revision 0002" in err_text and f"revision {head_revision()}" in err_text
    assert "kvgov db upgrade" in err_text
    assert PASSWORD not in out + err_text
    assert current_revision(pg_url) == "0002"


async def test_a_production_sidecar_on_an_empty_database_names_the_command(
    pg_url: str, tmp_path: Path
) -> None:
    with pytest.raises(StartupError, match=r"revision none \(no schema\)") as err:
        await build_sidecar(_production(pg_url, tmp_path))
    assert "kvgov db upgrade" in err.value.diagnostics()
    assert current_revision(pg_url) is None

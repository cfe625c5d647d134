"""Puts acknowledged from the local ledger journal survive ``kill -9`` of ``kvgov serve``.

The real ``kvgov serve`` runs in a subprocess on Postgres, with memory + filesystem tiers. While
a test connection holds the chain's lock (the sidecar's writer cannot commit), puts over the
real wire protocol are acknowledged: their events are only in the journal. The sidecar is then
killed; the restarted one commits the journal before it serves, so its entry index (rebuilt from
the ledger) knows the chunks, and they are served byte for byte from the filesystem tier.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import create_engine, text

from kvgov.wire.client import WireClient
from kvgov.wire.messages import RequestContext
from tests.e2e.served import serve, serve_env

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

CTX = RequestContext(request_id="req-journal", user="alice", tenant="acme")


@pytest.fixture
def env(pg_url: str) -> Iterator[dict[str, str]]:
    data_dir = Path(tempfile.mkdtemp(prefix="kvj-"))  # short: the Unix socket lives here
    yield serve_env(pg_url, data_dir, KVGOV_TIERS__CHAIN='["memory", "filesystem"]')
    shutil.rmtree(data_dir, ignore_errors=True)


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
    proc.wait(60)


def key(i: int) -> str:
    return f"m@1@0@{i:x}@bfloat16@tenant%acme@user%alice"


def test_acknowledged_puts_survive_kill_9_of_kvgov_serve(env: dict[str, str], pg_url: str) -> None:
    db = create_engine(pg_url, pool_pre_ping=True)  # the test ends backends below
    endpoint = f"unix://{env['KVGOV_DATAPLANE__UNIX_PATH']}"
    data = {i: os.urandom(3000 + i) for i in range(1, 6)}

    def puts_recorded() -> int:
        with db.connect() as conn:
            return int(
                conn.execute(
                    text("SELECT count(*) FROM ledger_events WHERE kind = 'kv:put'")
                ).scalar_one()
            )

    proc = serve(env)
    try:
        with WireClient(endpoint, engine_id="engine-1") as client:
            assert client.put(key(0), b"warm", CTX).ok
        deadline = time.monotonic() + 30
        while puts_recorded() < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert puts_recorded() == 1
        with db.connect() as conn:
            (chain_id,) = conn.execute(text("SELECT chain_id FROM chains")).scalars()
        dsn = pg_url.replace("postgresql+psycopg://", "postgresql://", 1)
        with psycopg.connect(dsn) as holder:
            holder.execute("SELECT 1 FROM chains WHERE chain_id = %s FOR UPDATE", (chain_id,))
            with WireClient(endpoint, engine_id="engine-1", timeout=20) as client:
                acks = client.put_many([(key(i), d) for i, d in data.items()], CTX)
            assert [a.ok for a in acks] == [True] * len(data)  # acknowledged ...
            assert puts_recorded() == 1  # ... while Postgres has none of them
            stop(proc, signal.SIGKILL)
            # the dead sidecar's backends may still wait on the lock: end them, then let go
            holder.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
            holder.rollback()
        assert puts_recorded() == 1

        proc = serve(env)  # replays the journal, and commits it, before it serves
        assert puts_recorded() == 1 + len(data)
        with WireClient(endpoint, engine_id="engine-1") as client:
            for i, d in data.items():
                hit = client.get(key(i), CTX)
                assert hit is not None, f"chunk {i} lost"
                assert hit[0] == d  # from the filesystem tier, byte for byte
        stop(proc)
        journal = Path(env["KVGOV_DATA_DIR"]) / "ledger-journal"
        assert list(journal.glob("journal-*.log")) == []  # a clean stop: all committed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        db.dispose()


def test_sigterm_while_starting_stops_gracefully(env: dict[str, str], pg_url: str) -> None:
    """SIGTERM the moment the data plane listens (the control plane is still starting): the
    sidecar finishes starting, then stops as it would later: exit 0, ``sidecar:stopped``
    recorded, journal empty. (Before the handlers were installed first, this killed it.)"""
    proc = serve(env)
    stop(proc)
    assert proc.returncode == 0
    db = create_engine(pg_url)
    try:
        with db.connect() as conn:
            kinds = list(
                conn.execute(text("SELECT kind FROM ledger_events ORDER BY seq")).scalars()
            )
    finally:
        db.dispose()
    assert kinds[-1] == "sidecar:stopped"
    journal = Path(env["KVGOV_DATA_DIR"]) / "ledger-journal"
    assert list(journal.glob("journal-*.log")) == []

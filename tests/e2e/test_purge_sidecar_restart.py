"""A sidecar killed with SIGKILL in the middle of a purge resumes it after a restart.

The real ``kvgov serve`` runs in a subprocess on Postgres; data goes in over the real wire
protocol. The purge is created with ``kvgov purge --no-wait``, so the sidecar's executor runs
every step. A loopback stand-in for vLLM's ``POST /reset_prefix_cache`` (vLLM cannot run here)
holds its first request open, which parks the sidecar after the key and tier steps; the test
then SIGKILLs it, restarts it, and checks that the purge completes and that running it again
finds nothing left.
"""

from __future__ import annotations

import http.server
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine, text

from kvgov.wire.client import WireClient
from kvgov.wire.control import ControlChannel
from kvgov.wire.messages import EvictRequest, RequestContext
from tests.e2e.served import kvgov as _kvgov
from tests.e2e.served import serve, serve_env, stop

pytestmark = [pytest.mark.postgres, pytest.mark.slow]


class _VllmStandIn(http.server.BaseHTTPRequestHandler):
    """Loopback stand-in for vLLM's reset endpoint; the first call waits for ``release``."""

    calls: list[float] = []
    release = threading.Event()

    def do_POST(self) -> None:
        type(self).calls.append(time.monotonic())
        if len(type(self).calls) == 1:
            type(self).release.wait(60)
        try:
            self.send_response(200)
            self.end_headers()
        except OSError:
            pass  # the sidecar that asked was killed

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def vllm() -> Iterator[str]:
    _VllmStandIn.calls = []
    _VllmStandIn.release = threading.Event()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _VllmStandIn)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        _VllmStandIn.release.set()
        server.shutdown()
        server.server_close()


@pytest.fixture
def env(pg_url: str, vllm: str) -> Iterator[dict[str, str]]:
    data_dir = Path(tempfile.mkdtemp(prefix="kvr-"))  # short: the Unix socket lives here
    yield serve_env(
        pg_url,
        data_dir,
        KVGOV_PURGE__POLL_INTERVAL_S="0.1",
        KVGOV_PURGE__STEP_LEASE_S="2",
        KVGOV_PURGE__JOB_TIMEOUT_S="90",
        KVGOV_PURGE__HTTP_TIMEOUT_S="60",
        KVGOV_PURGE__VLLM_ENGINES=json.dumps([vllm]),
    )
    shutil.rmtree(data_dir, ignore_errors=True)


def _wait(predicate: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.1)
    raise TimeoutError(what)


def _keys(user: str) -> list[str]:
    return [f"m@1@0@{i:x}@bfloat16@tenant%acme@user%{user}" for i in range(4)]


def test_sigkill_mid_purge_then_restart_completes(env: dict[str, str], pg_url: str) -> None:
    db = create_engine(pg_url)
    endpoint = f"unix://{env['KVGOV_DATAPLANE__UNIX_PATH']}"
    proc = serve(env)
    # the engine keeps its control channel up (reconnecting across the restart): a holder
    # with none when engines@S runs is named unreachable and the purge is incomplete
    engine = WireClient(endpoint, engine_id="engine-1")
    channel = engine.control(lambda request: sorted(request.digests), reconnect_delay=0.2)
    try:
        _sigkill_mid_purge_then_restart(env, db, endpoint, proc, channel)
    finally:
        channel.close()
        engine.close()
        db.dispose()


def _sigkill_mid_purge_then_restart(
    env: dict[str, str],
    db: Engine,
    endpoint: str,
    proc: subprocess.Popen[bytes],
    channel: ControlChannel,
) -> None:
    try:
        assert channel.connected.wait(10)
        with WireClient(endpoint, engine_id="engine-1") as client:
            for user in ("alice", "bob"):
                ctx = RequestContext(request_id=f"req-{user}", user=user, tenant="acme")
                for key in _keys(user):
                    assert client.put(key, os.urandom(2048), ctx).ok
            assert all(client.exists(k) for k in _keys("alice"))

        created = _kvgov(
            env, "purge", "--user", "alice", "--tenant", "acme", "--yes", "--no-wait", "--json"
        )
        assert created.returncode == 0, created.stdout + created.stderr
        job_id = json.loads(created.stdout)["id"]

        # the sidecar reached the GPU reset (after the key and tier steps) and is parked there
        _wait(lambda: _VllmStandIn.calls, 60, "the sidecar never reached the GPU step")
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    with db.connect() as conn:
        states = dict(
            conn.execute(
                text(
                    "SELECT name || coalesce('@' || sidecar_id, ''), state FROM purge_steps"
                    " WHERE job_id = :j"
                ),
                {"j": job_id},
            ).all()
        )
        job_state = conn.execute(
            text("SELECT state FROM purge_jobs WHERE id = :j"), {"j": job_id}
        ).scalar()
    assert job_state == "running"
    assert states["keys"] == "completed" and states["tiers"] == "completed"
    # the GPU reset is the live sidecar's own step (gpu@S), as its engines steps are
    assert [s for label, s in states.items() if label.startswith("gpu@")] == ["running"]
    assert states["ledger"] == "pending"
    # its own steps run in order (tiers@S, engines@S, gpu@S): the EVICT went before the reset
    assert [s for label, s in states.items() if label.startswith("engines@")] == ["completed"]

    _VllmStandIn.release.set()  # the stand-in answers at once from now on
    proc = serve(env)
    try:

        def finished() -> bool:
            status = _kvgov(env, "purge", "status", job_id, "--json")
            return json.loads(status.stdout)["state"] in ("completed", "incomplete", "failed")

        _wait(finished, 90, "the purge did not finish after the restart")
        status = _kvgov(env, "purge", "status", job_id, "--json")
        assert status.returncode == 0, status.stdout + status.stderr
        job = json.loads(status.stdout)
        assert job["state"] == "completed", job["receipt"]["receipt"]["incomplete"]
        gpu = next(s for s in job["steps"] if s["name"] == "gpu")
        assert gpu["attempts"] == 2  # taken again after the dead process's lease expired
        assert len(_VllmStandIn.calls) == 2

        with WireClient(endpoint, engine_id="engine-1") as client:
            assert not any(client.exists(k) for k in _keys("alice"))
            assert all(client.exists(k) for k in _keys("bob"))

        # the same purge again: harmless, nothing left to delete
        _wait(channel.connected.is_set, 30, "the engine's control channel did not reconnect")
        again = _kvgov(env, "purge", "--user", "alice", "--tenant", "acme", "--yes", "--json")
        assert again.returncode == 0, again.stdout + again.stderr
        receipt = json.loads(again.stdout)["receipt"]["receipt"]
        assert receipt["entries_purged"] == 0
        assert set(receipt["tiers"].values()) == {0}
        assert receipt["keys_destroyed"] == []

        audit = _kvgov(env, "audit", "verify")
        assert audit.returncode == 0, audit.stdout + audit.stderr
    finally:
        stop(proc)


def test_engine_that_does_not_acknowledge_makes_the_purge_incomplete(
    env: dict[str, str],
) -> None:
    """An engine connector that never answers EVICT: the receipt says ``incomplete`` and names
    it, and ``kvgov purge`` exits non-zero; the engine that answers is listed as acknowledged."""
    env = {
        **env,
        "KVGOV_PURGE__VLLM_ENGINES": "[]",
        "KVGOV_PURGE__ENGINE_ACK_TIMEOUT_S": "1",
        "KVGOV_PURGE__JOB_TIMEOUT_S": "30",
    }
    endpoint = f"unix://{env['KVGOV_DATAPLANE__UNIX_PATH']}"
    stuck = threading.Event()

    def hang(request: EvictRequest) -> list[str]:  # never answers within the sidecar's timeout
        stuck.wait(30)
        return []

    proc = serve(env)
    good = WireClient(endpoint, engine_id="engine-good")
    silent = WireClient(endpoint, engine_id="engine-silent")
    try:
        good_ctl = good.control(lambda request: request.digests)
        silent_ctl = silent.control(hang)
        assert good_ctl.connected.wait(10) and silent_ctl.connected.wait(10)
        ctx = RequestContext(request_id="req-a", user="alice", tenant="acme")
        for key in _keys("alice"):
            assert good.put(key, os.urandom(1024), ctx).ok

        done = _kvgov(env, "purge", "--user", "alice", "--tenant", "acme", "--yes", "--json")
        assert done.returncode == 1, done.stdout + done.stderr
        receipt = json.loads(done.stdout)["receipt"]["receipt"]
        assert receipt["state"] == "incomplete"
        assert receipt["engines"]["acknowledged"] == ["engine-good"]
        assert [u["engine"] for u in receipt["engines"]["unreachable"]] == ["engine-silent"]
        assert any("engine-silent" in line for line in receipt["incomplete"])
        # everything the sidecar could do was still done
        assert not any(good.exists(k) for k in _keys("alice"))
    finally:
        stuck.set()
        silent_ctl.close()
        good_ctl.close()
        good.close()
        silent.close()
        stop(proc)

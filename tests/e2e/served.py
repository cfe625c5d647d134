"""``kvgov serve`` in a subprocess, for end-to-end tests: the environment of a sidecar on a
given Postgres database with tenant ``acme`` enabled for every engine, data plane on a Unix
socket in its own short-named data directory, a start that waits for that socket and a
graceful stop; and any other ``kvgov`` command run to completion (:func:`kvgov`)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_env(pg_url: str, data_dir: Path, **extra: str) -> dict[str, str]:
    """The process environment (no other ``KVGOV_`` variable leaks in) plus ``extra``."""
    policy = json.loads((ROOT / "src/kvgov/policy/rego/data.json").read_text())
    policy["tenants"] = {"acme": {"enabled": True, "engines": ["*"]}}
    (data_dir / "policy-data.json").write_text(json.dumps(policy))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGOV_")}
    env.update(
        {
            "KVGOV_DATA_DIR": str(data_dir),
            "KVGOV_DATABASE__URL": pg_url,
            "KVGOV_LOG_LEVEL": "warning",
            "KVGOV_DATAPLANE__HOST": "",
            "KVGOV_DATAPLANE__UNIX_PATH": str(data_dir / "data.sock"),
            "KVGOV_DATAPLANE__LM_PORT": "-1",
            "KVGOV_POLICY__DATA_FILE": str(data_dir / "policy-data.json"),
            "KVGOV_TIERS__FILESYSTEM_FSYNC": "false",
            "KVGOV_TIERS__FILESYSTEM_MAX_BYTES": str(2 << 30),  # production asks for one
            "KVGOV_API__PORT": str(free_port()),
            **extra,
        }
    )
    return env


def serve(env: dict[str, str]) -> subprocess.Popen[bytes]:
    """Start ``kvgov serve``; return once its data-plane socket exists. Its stderr goes to
    ``serve.log`` in the data directory (quoted when it does not start)."""
    sock = Path(env["KVGOV_DATAPLANE__UNIX_PATH"])
    sock.unlink(missing_ok=True)
    log = Path(env["KVGOV_DATA_DIR"]) / "serve.log"
    with log.open("ab") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvgov", "serve"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    deadline = time.monotonic() + 60
    while not sock.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"kvgov serve did not start: {log.read_text()[-2000:]}")
        time.sleep(0.05)
    return proc


def stop(proc: subprocess.Popen[bytes], grace_s: float = 30) -> int:
    """SIGTERM (a graceful stop: drain, flush the ledger, final checkpoint), SIGKILL after
    ``grace_s``; the exit status."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def kvgov(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``kvgov ARGS`` to completion with ``env``; its output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "kvgov", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )

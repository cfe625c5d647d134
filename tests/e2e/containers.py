"""Podman for the container tests (``tests/e2e/test_image.py``, ``test_kube_play.py``): the
sidecar image built once per session by ``make image``'s script, containers started read-only
as a non-root user on the host network (the local Postgres is on 127.0.0.1), and waits.

Without podman the tests are skipped, saying so; a runtime that is there but cannot build or
run the image fails them.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
IMAGE = os.environ.get("KVGOV_TEST_IMAGE", "localhost/kvgov:dev")
UID = 10001
#: build.sh's exit status when a tool it needs is missing
_MISSING_TOOL = 2


def podman_or_skip() -> str:
    podman = shutil.which("podman")
    if podman is None:
        pytest.skip(
            "no container runtime: podman is not installed "
            "(apt-get install podman runc debootstrap; .ci/run installs them)"
        )
    if os.geteuid() != 0:
        pytest.skip("the container tests run podman as root (they hand volumes to uid 10001)")
    return podman


def build_image() -> str:
    """Build (or reuse, from podman's layer cache) the image ``make image`` builds."""
    podman_or_skip()
    proc = subprocess.run(
        [str(ROOT / "deploy/image/build.sh")],
        env={**os.environ, "IMAGE": IMAGE},
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    if proc.returncode == _MISSING_TOOL:
        pytest.skip(f"container runtime incomplete: {proc.stderr.strip()}")
    assert proc.returncode == 0, f"make image failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    print(proc.stdout.strip())  # size and start-up time to ready, in -s output
    return IMAGE


def podman(
    *args: str, check: bool = True, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        ["podman", *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"podman {' '.join(args[:3])}... failed: {proc.stderr[-3000:]}")
    return proc


def owned_dir(path: Path, mode: int = 0o700) -> Path:
    """A folder the image's user owns (a volume or a Secret's mount)."""
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, UID, UID)
    path.chmod(mode)
    return path


def secret_file(path: Path, data: str | bytes, mode: int = 0o400) -> Path:
    """A file as a Secret mounts it for the image's user."""
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    os.chown(path, UID, UID)
    path.chmod(mode)
    return path


def http_status(url: str, context: ssl.SSLContext | None = None) -> int | None:
    """``url``'s status (``context``: how an https server is verified), None when nothing
    answers."""
    handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
    if context is not None:
        handlers.append(urllib.request.HTTPSHandler(context=context))
    opener = urllib.request.build_opener(*handlers)
    try:
        with opener.open(url, timeout=1) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (urllib.error.URLError, OSError, http.client.HTTPException):
        return None  # nothing listens, or no HTTP answer (plain HTTP to a TLS port)


def wait_ready(
    url: str, container: str, timeout_s: float = 90, context: ssl.SSLContext | None = None
) -> None:
    """Until ``url`` answers 200; the container's log when it stops or never does."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if http_status(url, context) == 200:
            return
        state = podman("inspect", "--format", "{{.State.Status}}", container, check=False)
        if state.stdout.strip() in {"exited", "stopped"}:
            break
        time.sleep(0.2)
    logs = podman("logs", container, check=False)
    raise AssertionError(f"{container} never became ready:\n{(logs.stdout + logs.stderr)[-4000:]}")


def inspect(container: str) -> dict[str, Any]:
    data: list[dict[str, Any]] = json.loads(podman("inspect", container).stdout)
    return data[0]


def remove(*containers: str) -> None:
    for name in containers:
        podman("rm", "-f", "-v", "-t", "30", name, check=False)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: run by the image's python3 (it has no getcap): every regular file on the root's filesystem
#: (``find / -xdev``) whose ``security.capability`` xattr grants file capabilities, one a line;
#: folders it cannot read on stderr
FILE_CAPS_SCAN = """
import os, sys
dev = os.lstat("/").st_dev
todo = ["/"]
while todo:
    path = todo.pop()
    try:
        entries = list(os.scandir(path))
    except OSError as exc:
        print(f"{path}: {exc.strerror}", file=sys.stderr)
        continue
    for e in entries:
        st = e.stat(follow_symlinks=False)
        if st.st_dev != dev:
            continue
        if e.is_dir(follow_symlinks=False):
            todo.append(e.path)
        elif e.is_file(follow_symlinks=False):
            if "security.capability" in os.listxattr(e.path, follow_symlinks=False):
                print(e.path)
"""


def files_with_capabilities(image: str) -> list[str]:
    """The image's files with file capabilities, read as root (every folder readable) in a
    container of its own without network."""
    proc = podman(
        "run", "--rm", "--user", "0", "--network=none", "--no-healthcheck",
        "--entrypoint", "python3", image, "-c", FILE_CAPS_SCAN,
    )  # fmt: skip
    assert proc.stderr == "", f"folders the capability scan could not read: {proc.stderr}"
    return proc.stdout.split()

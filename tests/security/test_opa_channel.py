"""kvgov asks OPA over a channel only OPA can serve (review r8, F4).

Attack: production set ``policy.opa_url=http://127.0.0.1:8181`` and OPA listened on
``--addr=127.0.0.1:8181``. Every container of the pod shares that loopback, vLLM's (uid 10002)
too, and binding a port above 1024 needs no capability. Whenever OPA's process is gone (OOM,
liveness, crash, then the kubelet's back-off) code in vLLM that binds 127.0.0.1:8181 first
received kvgov's bearer token with every decision and answered each ``allowed``; answering 401
to tokenless requests passed kvgov's start-up check (``answers_without_token``).

Now OPA listens on ``unix:///run/opa/opa.sock`` in a memory emptyDir only ``opa`` and ``kvgov``
mount; kvgov speaks HTTP over it (``kvgov.policy.opa_channel``) and, before it sends anything
on a new connection, checks that the socket is OPA's: its directory (owner, not replaceable by
another uid), its owner, and the uid of the process serving it (``SO_PEERCRED``). Production
refuses ``http://`` on loopback. The squatters below are real processes of another uid
(``nobody``, tests run as root here) or a real TCP listener; the OPA behind the socket is the
stand-in with OPA's engine and the shipped ``opa-authz.rego`` in front.

The tokens here are test values, never printed: assertions report counts, not output.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from pydantic import ValidationError

from kvgov.config import LOOPBACK_HOSTS, Settings
from kvgov.policy.bundle import load_bundle
from kvgov.policy.opa import OpaRestPolicyEngine, answers_without_token
from tests.integration.test_deploy_manifests import containers, one, render, settings_env
from tests.security import doors
from tests.security.doors import ProdDatabase
from tests.security.squatter import FORBIDDEN, squatter
from tests.security.test_opa_api_authz import ALLOWED
from tests.security.test_production_guards import OPA_TOKEN, _with

#: a test value shaped like `openssl rand -hex 32`; not a secret, never printed
TOKEN = "5ab1" * 16
NOBODY = 65534
SOCKET_DIR_MODE_OF_A_TMPFS_EMPTYDIR = stat.S_IFDIR | 0o3777  # drwxrwsrwt (fsGroup: setgid)


# -- the manifests -------------------------------------------------------------------------


def test_kvgov_reaches_opa_over_a_channel_only_opa_can_serve() -> None:
    """Production: kvgov asks OPA on a Unix socket that the vllm container does not mount (or
    over https, a certificate kvgov verifies), never on a plain TCP port of the loopback every
    container of the pod shares."""
    docs = render("production")
    pod = one(docs, "Deployment", "kvgov-inference")["spec"]["template"]["spec"]
    env = settings_env(docs, pod)
    url = urlsplit(env["KVGOV_POLICY__OPA_URL"])
    by_name = containers(pod)
    vllm, opa = by_name["vllm"], by_name["opa"]
    assert "hostNetwork" not in pod  # one network namespace for all containers, vLLM's too
    opa_addr = next(a.split("=", 1)[1] for a in opa["args"] if a.startswith("--addr="))
    shared_tcp = url.scheme in ("http", "https") and url.hostname in LOOPBACK_HOSTS
    authenticated = url.scheme == "https"
    assert not (shared_tcp and not authenticated), (
        f"kvgov asks OPA at {url.geturl()} (OPA listens on {opa_addr}): a plain TCP port on the"
        f" loopback the vllm container (uid {vllm['securityContext'].get('runAsUser')}) shares;"
        " whoever binds it first after OPA exits gets the token and decides"
    )
    if url.scheme == "unix":
        assert opa_addr == env["KVGOV_POLICY__OPA_URL"]  # OPA listens where kvgov asks
        socket_dir = Path(url.path).parent.as_posix()
        reach = {
            name
            for name, c in by_name.items()
            for m in c.get("volumeMounts", [])
            if m["mountPath"] == socket_dir
        }
        assert reach == {"opa", "kvgov"}, f"{socket_dir} is mounted by {sorted(reach)}"


# -- the production guard ------------------------------------------------------------------


@pytest.mark.postgres
@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8181",
        "http://localhost:8181",
        "http://[::1]:8181",
        "http://127.0.0.2:8181",  # all of 127.0.0.0/8 is loopback
        "http://0.0.0.0:8181",  # connecting to the unspecified address reaches this host
        "http://[::ffff:127.0.0.1]:8181",
    ],
)
def test_production_refuses_asking_opa_on_a_loopback_port(
    tmp_path: Path, prod_db: ProdDatabase, url: str
) -> None:
    """A loopback TCP port can be bound by any process of the host (of the pod) while OPA's is
    gone; a mesh does not cover loopback, so ``dataplane.cleartext_network_ok`` does not lift
    the refusal. A Unix socket, or https, is accepted."""
    base = doors.settings(tmp_path, prod_db)
    opa = {"engine": "opa", "opa_token": OPA_TOKEN}
    for dataplane in ({}, {"cleartext_network_ok": True}):
        with pytest.raises(ValidationError) as caught:
            _with(base, policy={**opa, "opa_url": url}, dataplane=dataplane)
        text = str(caught.value)
        assert "loopback TCP port" in text and "unix:///run/opa/opa.sock" in text
    for ok in ("unix:///run/opa/opa.sock", "https://127.0.0.1:8181"):
        assert _with(base, policy={**opa, "opa_url": ok}).policy.opa_url == ok
    # development keeps its loopback OPA
    dev = Settings(data_dir=tmp_path / "dev", policy={"engine": "opa", "opa_url": url})
    assert dev.policy.opa_url == url


def test_opa_uids_must_name_uids(tmp_path: Path) -> None:
    for bad in ([], [-1]):
        with pytest.raises(ValidationError, match="must name OPA's uids"):
            Settings(data_dir=tmp_path / "d", policy={"opa_uids": bad})
    ok = Settings(data_dir=tmp_path / "d", policy={"opa_uids": [10003]})
    assert ok.policy.opa_uids == [10003]


@pytest.mark.parametrize(
    "url",
    [
        "unix://opa.sock",  # relative: a host, not a path
        "unix://host/run/opa.sock",
        "unix:///run/opa/../kvgov/data.sock",
        "unix:///run/opa/opa.sock?x=1",
        "unix:///" + "a" * 120,
    ],
)
def test_only_an_absolute_normalised_socket_path_is_a_unix_url(url: str) -> None:
    from kvgov.errors import PolicyError
    from kvgov.policy.opa_channel import OpaEndpoint

    with pytest.raises(PolicyError):
        OpaEndpoint.parse(url)
    assert OpaEndpoint.parse("unix:///run/opa/opa.sock").socket_path == "/run/opa/opa.sock"


# -- the socket's checks, with explicit uids -----------------------------------------------

KVGOV, OPA, OTHER = 10001, 10003, 10002
SOCK = stat.S_IFSOCK | 0o660


@pytest.mark.parametrize(
    ("dir_uid", "dir_mode", "sock_uid", "sock_mode", "allowed", "problem"),
    [
        # the production pod: a tmpfs emptyDir (root, sticky), OPA as kvgov's uid
        (0, SOCKET_DIR_MODE_OF_A_TMPFS_EMPTYDIR, KVGOV, SOCK, {KVGOV, 0}, None),
        # OPA on its own uid (policy.opa_uids)
        (0, SOCKET_DIR_MODE_OF_A_TMPFS_EMPTYDIR, OPA, SOCK, {OPA}, None),
        (OPA, stat.S_IFDIR | 0o750, OPA, SOCK, {OPA}, None),
        (KVGOV, stat.S_IFDIR | 0o700, OPA, SOCK, {OPA}, None),
        # a socket another uid created (it bound the path first, or replaced OPA's)
        (0, SOCKET_DIR_MODE_OF_A_TMPFS_EMPTYDIR, OTHER, SOCK, {KVGOV, 0}, "owned by uid 10002"),
        (0, stat.S_IFDIR | 0o755, KVGOV, SOCK, {OPA}, "owned by uid 10001, not by OPA"),
        # a directory another uid owns, or may rename entries in
        (OTHER, stat.S_IFDIR | 0o755, KVGOV, SOCK, {KVGOV, 0}, "is owned by uid 10002"),
        # a directory others may write, sticky or not (a disk emptyDir's root, fsGroup's
        # setgid): no refusal by itself; a socket someone else put there is (above, and by
        # the listener's uid once connected)
        (0, stat.S_IFDIR | 0o777, KVGOV, SOCK, {KVGOV, 0}, None),
        (0, stat.S_IFDIR | 0o2775, KVGOV, SOCK, {KVGOV, 0}, None),
        # not a socket: a file, a symlink (lstat), or a directory for a parent that is not one
        (0, stat.S_IFDIR | 0o755, KVGOV, stat.S_IFREG | 0o600, {KVGOV, 0}, "is not a socket"),
        (0, stat.S_IFDIR | 0o755, KVGOV, stat.S_IFLNK | 0o777, {KVGOV, 0}, "is not a socket"),
        (0, stat.S_IFLNK | 0o777, KVGOV, SOCK, {KVGOV, 0}, "is not a directory"),
    ],
)
def test_the_socket_must_be_opas(
    dir_uid: int, dir_mode: int, sock_uid: int, sock_mode: int, allowed: set[int], problem: str
) -> None:
    from kvgov.policy.opa_channel import ownership_problem

    found = ownership_problem(
        "/run/opa/opa.sock",
        dir_uid=dir_uid,
        dir_mode=dir_mode,
        sock_uid=sock_uid,
        sock_mode=sock_mode,
        allowed=allowed,
        own_uid=KVGOV,
    )
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found, found


def test_the_process_serving_the_socket_must_be_opa() -> None:
    from kvgov.policy.opa_channel import peer_problem

    assert peer_problem("/run/opa/opa.sock", KVGOV, {KVGOV, 0}) is None
    assert "runs as uid 10002" in (peer_problem("/run/opa/opa.sock", OTHER, {KVGOV, 0}) or "")
    assert "cannot be identified" in (peer_problem("/run/opa/opa.sock", None, {0}) or "")


# -- a squatter on OPA's old port ----------------------------------------------------------


@pytest.fixture
def port_squatter() -> Iterator[tuple[str, list[str]]]:
    """What vLLM's code would run on a loopback port once OPA's listener is gone
    (:func:`tests.security.squatter.squatter`): its URL and the Authorization headers seen."""
    with squatter() as (port, seen):
        yield f"http://127.0.0.1:{port}", seen


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    """A short directory for a socket (``sun_path`` holds 107 bytes; pytest's are long)."""
    path = Path(tempfile.mkdtemp(prefix="opa-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


async def test_a_process_that_takes_opas_port_gets_no_token_and_decides_nothing(
    port_squatter: tuple[str, list[str]], socket_dir: Path
) -> None:
    """kvgov asks OPA where production points it: its socket. OPA is gone (nothing listens
    there) and a squatter holds a loopback port: kvgov never speaks TCP to it, so it gets no
    token, and the decision denies (``opa_unavailable``) instead of obeying it."""
    _, seen = port_squatter
    url = f"unix://{socket_dir / 'opa.sock'}"
    assert await answers_without_token(url, 2.0) is None  # not "it checks tokens"
    engine = OpaRestPolicyEngine(load_bundle(), url=url, timeout_s=2.0, token=TOKEN)
    try:
        decision = await engine.decide(FORBIDDEN)
    finally:
        await engine.aclose()
    got_token = sum(1 for h in seen if h == f"Bearer {TOKEN}")
    assert got_token == 0 and not decision.allowed, (
        f"a listener that is not OPA got the bearer token {got_token} time(s) and its answer"
        f" was obeyed (allowed={decision.allowed})"
    )
    assert decision.reasons == ("opa_unavailable",)
    assert seen == []


# -- a squatter of another uid on OPA's socket path ----------------------------------------

#: a Unix-socket squatter (stdlib only; run as ``nobody``): it answers like the port squatter
#: and prints "token" or "none" for each request it gets (never the header's value)
_SQUATTER = r"""
import json, socketserver, sys
from http.server import BaseHTTPRequestHandler

class Handler(BaseHTTPRequestHandler):
    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        auth = bool(self.headers.get("Authorization"))
        print("token" if auth else "none", flush=True)
        body = {"result": {"allowed": True, "reasons": [], "tiers": []}} if auth else {}
        data = json.dumps(body).encode()
        self.send_response(200 if auth else 401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass

class Server(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True

server = Server(sys.argv[1], Handler)
print("ready", flush=True)
server.serve_forever()
"""


def _squat(path: Path) -> subprocess.Popen[str]:
    """A process of uid ``nobody`` serving HTTP on ``path`` (it binds it: it must be able to
    write the directory). Any Python will do (stdlib only): the first one ``nobody`` may run."""
    pythons = [os.path.realpath(sys.executable), shutil.which("python3", path="/usr/bin:/bin")]
    for python in filter(None, pythons):
        try:
            proc = subprocess.Popen(
                [python, "-I", "-S", "-c", _SQUATTER, str(path)],
                cwd="/",
                user=NOBODY,
                group=NOBODY,
                extra_groups=[],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
        except PermissionError:
            continue
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            proc.kill()
            pytest.fail("the squatter did not start")
        return proc
    pytest.skip("no Python that uid nobody may run")


def _own(path: Path, uid: int, mode: int) -> None:
    os.chown(path, uid, uid)
    path.chmod(mode)


def _requests_seen(proc: subprocess.Popen[str]) -> list[str]:
    proc.terminate()
    out, _ = proc.communicate(timeout=10)
    return out.split()


needs_root = pytest.mark.skipif(
    not hasattr(os, "getuid") or os.getuid() != 0, reason="needs root to run a process as nobody"
)


async def _ask(url: str) -> tuple[bool | None, Any]:
    probe = await answers_without_token(url, 2.0)
    engine = OpaRestPolicyEngine(load_bundle(), url=url, timeout_s=2.0, token=TOKEN)
    try:
        decision = await engine.decide(FORBIDDEN)
    finally:
        await engine.aclose()
    return probe, decision


@needs_root
async def test_a_socket_another_uid_created_first_gets_nothing(
    socket_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The socket's directory is what a tmpfs emptyDir's root is (root, sticky, world
    writable). A process of another uid binds OPA's path before OPA does: kvgov sends it
    nothing (not even the tokenless probe), and denies ``opa_untrusted``."""
    _own(socket_dir, 0, 0o1777)
    path = socket_dir / "opa.sock"
    proc = _squat(path)
    try:
        assert path.stat().st_uid == NOBODY
        with caplog.at_level(logging.ERROR, logger="kvgov.policy.opa_channel"):
            probe, decision = await _ask(f"unix://{path}")
    finally:
        seen = _requests_seen(proc)
    assert seen == [], (
        f"the squatter got {len(seen)} request(s) ({seen.count('token')} with the token)"
    )
    assert probe is None  # the start-up guard is not told "it checks tokens"
    assert not decision.allowed and decision.reasons == ("opa_untrusted",)
    refused = [r for r in caplog.records if r.getMessage() == "policy.opa_channel_refused"]
    assert refused and "owned by uid 65534" in refused[0].__dict__["problem"]


@needs_root
async def test_a_socket_served_by_another_uid_is_refused_by_the_kernels_word(
    socket_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every file check passes (directory and socket owned by root, 0755), but the process
    that listens runs as ``nobody``: ``SO_PEERCRED`` says so and kvgov closes the connection
    before sending a byte."""
    _own(socket_dir, NOBODY, 0o700)
    path = socket_dir / "opa.sock"
    proc = _squat(path)
    try:
        _own(socket_dir, 0, 0o755)
        os.chown(path, 0, 0)
        with caplog.at_level(logging.ERROR, logger="kvgov.policy.opa_channel"):
            probe, decision = await _ask(f"unix://{path}")
    finally:
        seen = _requests_seen(proc)
    assert seen == [], (
        f"the squatter got {len(seen)} request(s) ({seen.count('token')} with the token)"
    )
    assert probe is None
    assert not decision.allowed and decision.reasons == ("opa_untrusted",)
    refused = [r for r in caplog.records if r.getMessage() == "policy.opa_channel_refused"]
    assert refused and "runs as uid 65534" in refused[0].__dict__["problem"]


@needs_root
async def test_without_the_checks_the_same_squatter_would_get_the_token(
    socket_dir: Path,
) -> None:
    """The control: the same squatter, its uid named in ``opa_uids`` (as if it were OPA's),
    is asked, gets the token and decides. The refusals above are the checks' doing."""
    _own(socket_dir, 0, 0o1777)
    path = socket_dir / "opa.sock"
    proc = _squat(path)
    try:
        engine = OpaRestPolicyEngine(
            load_bundle(), url=f"unix://{path}", timeout_s=2.0, token=TOKEN, opa_uids=[NOBODY]
        )
        try:
            decision = await engine.decide(FORBIDDEN)
        finally:
            await engine.aclose()
    finally:
        seen = _requests_seen(proc)
    assert seen == ["token"] and decision.allowed


# -- kvgov and OPA (the stand-in, with the shipped authz) over the socket --------------------


def _needs_opa_engine() -> None:
    """The stand-in evaluates with OPA's engine (opa-golib-python-bindings)."""
    pytest.importorskip("opa_bindings", reason="opa-golib-python-bindings not installed")


@pytest.fixture
def authz_engine() -> Any:
    _needs_opa_engine()
    from tests.security.test_opa_api_authz import authz_engine as build

    return build()


@pytest.mark.parametrize("token", ["right", "wrong", None])
async def test_kvgov_asks_opa_on_its_socket_with_its_token(
    authz_engine: Any, tmp_path: Path, token: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    """kvgov built from its settings, as production runs it (``unix://``, the token of its
    file) gets OPA's decisions through the shipped authz; another token, or none, is 401 and
    denies; the start-up probe over the socket sees a locked OPA."""
    from kvgov.policy.factory import build_inner_engine
    from tests.integration.test_policy_opa_standin import OpaStandIn
    from tests.security.test_opa_api_authz import (
        DECISION_PATH,
        RUNTIME,
        authorizer,
    )
    from tests.security.test_opa_api_authz import TOKEN as OPA_SIDE_TOKEN

    assert RUNTIME["env"]["KVGOV_OPA_TOKEN"] == OPA_SIDE_TOKEN
    policy: dict[str, Any] = {"engine": "opa", "opa_timeout_s": 5.0}
    if token is not None:
        token_file = tmp_path / "token"
        token_file.write_text(OPA_SIDE_TOKEN if token == "right" else "wrong-" + OPA_SIDE_TOKEN)
        token_file.chmod(0o600)  # a secret others may not read (kvgov refuses it otherwise)
        policy["opa_token_file"] = token_file
    opa = OpaStandIn(unix=True)
    opa.load(load_bundle())
    opa.middlewares.append(authorizer(authz_engine))
    await opa.start()
    try:
        assert opa.url.startswith("unix:///")
        policy["opa_url"] = opa.url
        kvgov = build_inner_engine(Settings(data_dir=tmp_path / "d", policy=policy))
        try:
            decision = await kvgov.decide(ALLOWED)
        finally:
            await kvgov.aclose()
        assert await answers_without_token(opa.url, 5.0) is False
    finally:
        await opa.stop()
    if token == "right":
        assert decision.allowed, decision.reasons
        assert opa.requests == [("POST", DECISION_PATH)]
    else:
        assert not decision.allowed
        assert decision.reasons == ("opa_bad_status:401",)
        assert opa.requests == []
    assert not [r for r in caplog.records if r.getMessage() == "policy.opa_channel_refused"]


async def test_opa_on_a_uid_kvgov_was_not_told_is_refused_and_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``policy.opa_uids`` names OPA's uids; a socket served by any other (here: this test's
    own process, root) is never asked: every decision denies ``opa_untrusted``, logged
    once per engine, and is not cached (OPA's state, not the policy's answer)."""
    _needs_opa_engine()
    from kvgov.policy.factory import build_policy_engine
    from tests.integration.test_policy_opa_standin import running_standin

    async with running_standin(unix=True) as opa:
        opa.load(load_bundle())
        settings = Settings(
            data_dir=tmp_path / "d",
            policy={"engine": "opa", "opa_url": opa.url, "opa_uids": [os.getuid() + 1]},
        )
        engine = build_policy_engine(settings)
        try:
            with caplog.at_level(logging.ERROR, logger="kvgov.policy.opa_channel"):
                first = await engine.decide(ALLOWED)
                second = await engine.decide(ALLOWED)
        finally:
            await engine.aclose()
    assert first.reasons == second.reasons == ("opa_untrusted",)
    assert opa.requests == []
    refused = [r for r in caplog.records if r.getMessage() == "policy.opa_channel_refused"]
    assert len(refused) == 1


async def test_push_and_rego_tests_over_the_socket(tmp_path: Path) -> None:
    """``kvgov policy push`` and ``kvgov policy test`` (engine opa) speak to OPA's socket."""
    _needs_opa_engine()
    from kvgov.policy.opa import push_bundle
    from kvgov.policy.testing import run_opa
    from tests.integration.test_policy_opa_standin import running_standin

    bundle = load_bundle()
    async with running_standin(unix=True) as opa:
        written = await push_bundle(bundle, url=opa.url)
        report = await run_opa(bundle, url=opa.url)
    assert "kvgov/authz" in written and "data/kvgov/config" in written
    assert report.ok and report.results

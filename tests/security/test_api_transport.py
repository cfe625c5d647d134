"""The REST API's transport: TLS, and production's refusal to serve it in the clear.

Attack (review h1): the shipped manifests bind the control plane to ``0.0.0.0:7080`` in plain
HTTP, and kvgov had no TLS option. Whoever can see the pod network (a compromised neighbour
pod, a node, a mirrored port) reads the admin and auditor bearer tokens, the dashboard's
session cookie and every compliance answer (provenance, purge receipts), and can replay the
tokens. Production now refuses ``api.host`` beyond loopback without ``api.tls_cert_file`` /
``api.tls_key_file`` unless ``dataplane.cleartext_network_ok`` declares a mesh that encrypts
pod traffic; with them, ``kvgov serve`` answers in TLS 1.2+ only, and a misconfigured
certificate or key stops start-up (never the first request) with an error naming the setting
and never quoting the files. Controls: loopback without TLS (behind a TLS-terminating proxy)
and a declared mesh still start.

Every server here is ``kvgov serve`` itself, started as a container starts it.
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

import kvgov
from kvgov.config import ApiSettings
from kvgov.db.tokens import TokenRepository
from kvgov.types import Role
from tests.security import doors
from tests.security.doors import ProdDatabase, tls_identity

pytestmark = pytest.mark.postgres

SRC = Path(kvgov.__file__).resolve().parents[1]
#: a database nothing listens on: the settings and TLS checks come before any connection
NO_DATABASE = "postgresql+psycopg://kvgov@127.0.0.1:1/kvgov"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(tmp_path: Path, db: ProdDatabase | None, port: int, **api: str) -> dict[str, str]:
    """A production ``kvgov serve``'s environment (provisioned keys and policy data, this
    checkout's code, no inherited ``KVGOV_`` setting), its ``api.*`` settings ``api``."""
    if db is None:
        db = ProdDatabase(url=NO_DATABASE, runtime_role="kvgov_runtime")
    settings = doors.settings(tmp_path, db)  # writes the KEK, the fleet keys, the policy data
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "PYTHONPATH": str(SRC),
        "KVGOV_ENVIRONMENT": "production",
        "KVGOV_PURGE__NO_GPU_PREFIX_CACHE": "true",  # no vLLM here
        "KVGOV_LOG_JSON": "false",
        "KVGOV_DATA_DIR": str(settings.data_dir),
        "KVGOV_DATABASE__URL": db.url,
        "KVGOV_DATABASE__RUNTIME_ROLE": db.runtime_role,
        "KVGOV_KEYS__KEK_PATH": str(settings.kek_path),
        "KVGOV_POLICY__DATA_FILE": str(settings.policy.data_file),
        "KVGOV_DATAPLANE__HOST": "127.0.0.1",
        "KVGOV_DATAPLANE__PORT": "0",
        "KVGOV_DATAPLANE__ENGINE_TOKENS": json.dumps(doors.TOKENS),
        "KVGOV_DATAPLANE__BUFFER_POOL_BYTES": str(64 << 20),
        "KVGOV_TIERS__CHAIN": '["memory"]',
        "KVGOV_API__PORT": str(port),
    }
    env.update({f"KVGOV_API__{k.upper()}": v for k, v in api.items()})
    return env


def _refused(env: dict[str, str]) -> str:
    """``kvgov serve`` under ``env`` must stop at start-up: its error output."""
    run = subprocess.run(
        [sys.executable, "-m", "kvgov", "serve"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode != 0, run.stdout + run.stderr
    return run.stdout + run.stderr


@contextmanager
def _serving(env: dict[str, str], url: str, verify: ssl.SSLContext | bool) -> Iterator[None]:
    """``kvgov serve`` under ``env``, until ``url`` answers 200; SIGTERM after."""
    log = Path(env["HOME"]) / f"serve-{env['KVGOV_API__PORT']}.log"
    with (
        log.open("wb") as out,
        subprocess.Popen(
            [sys.executable, "-m", "kvgov", "serve"], env=env, stdout=out, stderr=out
        ) as proc,
    ):
        try:
            deadline = time.monotonic() + 90
            while True:
                try:
                    if httpx.get(url, verify=verify, timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    proc.kill()
                    proc.wait()
                    text = log.read_text(errors="replace")
                    raise AssertionError(f"kvgov serve never answered {url}:\n{text[-4000:]}")
                time.sleep(0.2)
            yield
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def _client_context(ca: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(ca))


def _auditor(db: ProdDatabase) -> str:
    engine = create_engine(db.url)
    try:
        with Session(engine) as s:
            _, raw = TokenRepository(s).create(Role.AUDITOR)
            s.commit()
    finally:
        engine.dispose()
    return raw


def _pem_pieces(*paths: Path) -> list[str]:
    """What a leak of these PEM files would show: their armour and every base64 line."""
    lines = [ln for p in paths for ln in p.read_text().splitlines() if ln]
    return ["-----BEGIN", *[ln for ln in lines if not ln.startswith("-----") and len(ln) > 16]]


def _quotes_no_pem(text: str, *paths: Path) -> None:
    for piece in _pem_pieces(*paths):
        assert piece not in text, f"the error quotes PEM material: {piece[:20]}..."


# -- (a) production refuses the API in the clear beyond loopback -------------------------------


def test_production_refuses_the_api_in_the_clear_beyond_loopback(tmp_path: Path) -> None:
    env = _env(tmp_path, None, _free_port(), host="0.0.0.0")
    err = _refused(env)
    assert "unsafe for production" in err, err
    assert "api.host=0.0.0.0" in err, err
    assert "api.tls_cert_file" in err and "cleartext_network_ok" in err, err


# -- (b) with TLS, the API answers in TLS only ---------------------------------------------------


def test_the_api_answers_over_tls_and_nothing_in_the_clear(
    tmp_path: Path, prod_db: ProdDatabase
) -> None:
    tls = tls_identity(tmp_path / "tls")
    port = _free_port()
    env = _env(
        tmp_path,
        prod_db,
        port,
        host="0.0.0.0",
        tls_cert_file=str(tls.cert),
        tls_key_file=str(tls.key),
    )
    token = _auditor(prod_db)
    verify = _client_context(tls.ca)
    with _serving(env, f"https://127.0.0.1:{port}/healthz", verify):
        # the client checks the server against the CA, and a token request is answered
        with httpx.Client(
            base_url=f"https://127.0.0.1:{port}", verify=verify, timeout=10
        ) as client:
            assert client.get("/healthz").status_code == 200
            ok = client.get("/v1/tenants", headers={"Authorization": f"Bearer {token}"})
            assert ok.status_code == 200, ok.text
            # the dashboard's sign-in: the scheme this server sees is https, so the browser's
            # https origin is its own, and the session cookie is Secure
            signed_in = client.post(
                "/dashboard/login",
                content=f"token={token}",
                headers={
                    "Content-Type": "application/x-www-form-urlencoded",
                    "Origin": f"https://127.0.0.1:{port}",
                },
                follow_redirects=False,
            )
            assert signed_in.status_code == 303, signed_in.text
            assert "secure" in signed_in.headers["set-cookie"].lower().split("; ")
        # TLS 1.2 at least
        with (
            socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
            verify.wrap_socket(raw, server_hostname="127.0.0.1") as tls_sock,
        ):
            assert tls_sock.version() in {"TLSv1.2", "TLSv1.3"}
        # plain HTTP with a bearer token: no HTTP answer, the request is never read
        request = (
            f"GET /v1/tenants HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Authorization: Bearer {token}\r\nConnection: close\r\n\r\n"
        ).encode()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as plain:
            plain.sendall(request)
            answer = b""
            try:
                while chunk := plain.recv(65536):
                    answer += chunk
            except (ConnectionResetError, TimeoutError):
                pass
        assert not answer.startswith(b"HTTP/"), answer[:200]
        assert b"tenants" not in answer and b"{" not in answer
        # the server is still up for TLS clients
        assert httpx.get(f"https://127.0.0.1:{port}/healthz", verify=verify).status_code == 200


def test_the_server_context_refuses_tls_below_1_2(tmp_path: Path) -> None:
    from kvgov.proxy.api.tls import api_tls_context

    tls = tls_identity(tmp_path / "tls")
    ctx = api_tls_context(ApiSettings(tls_cert_file=tls.cert, tls_key_file=tls.key))
    assert ctx is not None
    assert ctx.minimum_version >= ssl.TLSVersion.TLSv1_2
    assert api_tls_context(ApiSettings()) is None
    # TLS 1.2: forward-secret AEAD suites only (no CBC, no static RSA key exchange), no
    # session tickets, no renegotiation (review 6, F8)
    for cipher in ctx.get_ciphers():
        if cipher["protocol"] == "TLSv1.2":
            assert cipher["aead"] and cipher["kea"] == "kx-ecdhe", cipher["name"]
    assert ctx.options & ssl.OP_NO_TICKET
    assert ctx.options & ssl.OP_NO_RENEGOTIATION
    # a TLS 1.2 client offering only CBC suites gets no session
    server = socket.create_server(("127.0.0.1", 0))
    client_ctx = ssl.create_default_context(cafile=str(tls.ca))
    client_ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    client_ctx.set_ciphers("ECDHE-ECDSA-AES128-SHA256:ECDHE-ECDSA-AES128-SHA")

    def accept() -> None:
        conn, _ = server.accept()
        with contextlib.suppress(ssl.SSLError, OSError):
            ctx.wrap_socket(conn, server_side=True).close()
        conn.close()

    thread = threading.Thread(target=accept)
    thread.start()
    try:
        with (
            socket.create_connection(server.getsockname(), timeout=5) as raw,
            pytest.raises(ssl.SSLError),
        ):
            client_ctx.wrap_socket(raw, server_hostname="127.0.0.1")
    finally:
        thread.join(5)
        server.close()


# -- (c) a misconfigured certificate or key stops start-up, quoting nothing ---------------------


def _tls_env(tmp_path: Path, cert: Path | None, key: Path | None) -> dict[str, str]:
    api = {"host": "0.0.0.0"}
    if cert is not None:
        api["tls_cert_file"] = str(cert)
    if key is not None:
        api["tls_key_file"] = str(key)
    return _env(tmp_path, None, _free_port(), **api)


def test_one_tls_file_alone_stops_start_up(tmp_path: Path) -> None:
    tls = tls_identity(tmp_path / "tls")
    for cert, key in ((tls.cert, None), (None, tls.key)):
        err = _refused(_tls_env(tmp_path, cert, key))
        assert "api.tls_cert_file and api.tls_key_file" in err, err
        _quotes_no_pem(err, tls.cert, tls.key)


def test_a_missing_tls_file_stops_start_up(tmp_path: Path) -> None:
    tls = tls_identity(tmp_path / "tls")
    missing = tmp_path / "tls" / "nowhere.pem"
    err = _refused(_tls_env(tmp_path, missing, tls.key))
    assert "api.tls_cert_file" in err and str(missing) in err, err
    err = _refused(_tls_env(tmp_path, tls.cert, missing))
    assert "api.tls_key_file" in err and str(missing) in err, err
    assert "kvgov init" not in err, err  # a TLS key is provisioned, never generated


def test_a_key_not_matching_the_certificate_stops_start_up(tmp_path: Path) -> None:
    tls = tls_identity(tmp_path / "tls")
    other = tls_identity(tmp_path / "other")
    err = _refused(_tls_env(tmp_path, tls.cert, other.key))
    assert "api.tls_cert_file" in err and "api.tls_key_file" in err, err
    assert "do not make a TLS identity" in err, err
    _quotes_no_pem(err, tls.cert, other.key)


def test_swapped_or_loose_tls_files_stop_start_up_quoting_nothing(tmp_path: Path) -> None:
    tls = tls_identity(tmp_path / "tls")
    # the key given as the certificate (and the certificate as the key)
    err = _refused(_tls_env(tmp_path, tls.key, tls.cert))
    assert "api.tls_cert_file" in err, err
    _quotes_no_pem(err, tls.cert, tls.key)
    # a key others can read is refused like the sidecar's other keys
    tls.key.chmod(0o644)
    err = _refused(_tls_env(tmp_path, tls.cert, tls.key))
    assert "api.tls_key_file" in err and "readable by others" in err, err
    _quotes_no_pem(err, tls.cert, tls.key)


# -- (d) controls: loopback behind a proxy, and a declared mesh --------------------------------


def test_production_without_tls_still_starts_on_loopback(
    tmp_path: Path, prod_db: ProdDatabase
) -> None:
    port = _free_port()
    env = _env(tmp_path, prod_db, port, host="127.0.0.1")
    with _serving(env, f"http://127.0.0.1:{port}/healthz", verify=False):
        pass


def test_a_declared_mesh_still_allows_the_api_beyond_loopback_without_tls(
    tmp_path: Path, prod_db: ProdDatabase
) -> None:
    port = _free_port()
    env = _env(tmp_path, prod_db, port, host="0.0.0.0")
    env["KVGOV_DATAPLANE__CLEARTEXT_NETWORK_OK"] = "true"
    with _serving(env, f"http://127.0.0.1:{port}/healthz", verify=False):
        pass

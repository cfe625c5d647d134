"""``kvgov health`` (the image's HEALTHCHECK): exit 0 only on a 200 from /readyz (or /healthz
with ``--live``), 1 on 503 or when nothing listens; the probe asks loopback for a server bound
to every address."""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvgov.cli.health import probe_url
from kvgov.cli.main import build_app
from tests.security.doors import TlsIdentity, tls_identity
from tests.security.squatter import serving


class _Probe(BaseHTTPRequestHandler):
    ready = True

    def do_GET(self) -> None:
        ok = self.path == "/healthz" or (self.path == "/readyz" and _Probe.ready)
        self.send_response(200 if ok else 503)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[int]:
    try:
        with serving(ThreadingHTTPServer(("127.0.0.1", 0), _Probe)) as port:
            yield port
    finally:
        _Probe.ready = True


def _health(port: int, *args: str) -> int:
    env = {"KVGOV_API__HOST": "0.0.0.0", "KVGOV_API__PORT": str(port)}
    return CliRunner().invoke(build_app(), ["health", *args], env=env).exit_code


def test_ready_is_0_not_ready_is_1(server: int) -> None:
    assert _health(server) == 0
    _Probe.ready = False
    assert _health(server) == 1
    assert _health(server, "--live") == 0  # alive while not ready


def test_nothing_listening_is_1(server: int) -> None:
    assert _health(1) == 1
    assert _health(server, "--url", "http://127.0.0.1:1/readyz") == 1


@pytest.mark.parametrize(
    ("host", "url"),
    [
        ("0.0.0.0", "http://127.0.0.1:7080/readyz"),
        ("", "http://127.0.0.1:7080/readyz"),
        ("::", "http://127.0.0.1:7080/readyz"),
        ("10.0.0.5", "http://10.0.0.5:7080/readyz"),
        ("::1", "http://[::1]:7080/readyz"),
    ],
)
def test_probe_url(host: str, url: str) -> None:
    assert probe_url(host, 7080) == url


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[tuple[int, TlsIdentity]]:
    """The probe over TLS, as ``api.tls_cert_file``/``tls_key_file`` serve the API."""
    tls = tls_identity(tmp_path / "tls")
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Probe)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(tls.cert, tls.key)
    httpd.socket = ctx.wrap_socket(httpd.socket, server_side=True)
    with serving(httpd) as port:
        yield port, tls


def test_over_tls_the_probe_trusts_the_servers_own_certificate(
    tls_server: tuple[int, TlsIdentity],
) -> None:
    port, tls = tls_server
    env = {
        "KVGOV_API__HOST": "0.0.0.0",
        "KVGOV_API__PORT": str(port),
        "KVGOV_API__TLS_CERT_FILE": str(tls.cert),
        "KVGOV_API__TLS_KEY_FILE": str(tls.key),
    }
    run = CliRunner().invoke(build_app(), ["health"], env=env)
    assert run.exit_code == 0, run.output
    assert f"https://127.0.0.1:{port}/readyz: 200" in run.output
    # another server's certificate pinned: refused
    other = tls_identity(tls.cert.parent.parent / "other")
    env["KVGOV_API__TLS_CERT_FILE"] = str(other.cert)
    env["KVGOV_API__TLS_KEY_FILE"] = str(other.key)
    assert CliRunner().invoke(build_app(), ["health"], env=env).exit_code == 1


def test_cacert_verifies_an_https_url(tls_server: tuple[int, TlsIdentity]) -> None:
    port, tls = tls_server
    url = f"https://127.0.0.1:{port}/readyz"
    app = build_app()
    assert CliRunner().invoke(app, ["health", "--url", url, "--cacert", str(tls.ca)]).exit_code == 0
    assert CliRunner().invoke(app, ["health", "--url", url]).exit_code == 1  # not a system CA
    missing = str(tls.ca.parent / "missing.pem")
    assert CliRunner().invoke(app, ["health", "--url", url, "--cacert", missing]).exit_code == 1

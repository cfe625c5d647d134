"""``kvgov health`` pins the API's own certificate, not every certificate its file holds.

Attack (review F9): with ``api.tls_cert_file`` set, the image's HEALTHCHECK asks this host's API
over https, and trusted every certificate in that file as an anchor, with no host name check.
The file is often a full chain (cert-manager's ``tls.crt``: the leaf, then its issuers), or a
bundle an operator appended to. Whoever then answers at the probe's address (a process that got
the port first, another container of the pod) with any certificate that file's CA issued, for
any name, or with a certificate placed in the file, was taken for the API: the probe reported
it ready. Now the probe accepts exactly the file's first certificate (the leaf ``kvgov serve``
presents, ``load_cert_chain``'s order) and refuses anything else, saying so. Controls: the
API's own leaf, alone or followed by its chain, is accepted; ``--cacert`` verifies against a CA
with the host name checked.
"""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from typer.testing import CliRunner

from kvgov.cli.main import build_app
from tests.security.squatter import serving

PIN_REFUSED = "is not the API's certificate"


@dataclass(frozen=True)
class _Pki:
    ca: Path  # the CA's certificate (PEM)
    api: Path  # the API's leaf, signed by the CA, for localhost and 127.0.0.1
    api_key: Path
    rogue: Path  # another leaf the same CA signed, for another name (any service of the issuer)
    rogue_key: Path
    self_signed: Path  # the attacker's own self-signed certificate, for 127.0.0.1
    self_signed_key: Path


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path = path.with_suffix(".key")
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return key_path


def _cert(
    subject: str,
    names: list[x509.GeneralName],
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    issuer_name, issuer_key = issuer if issuer is not None else (_name(subject), key)
    return (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(issuer_key, hashes.SHA256())
    )


@pytest.fixture
def pki(tmp_path: Path) -> _Pki:
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("kvgov test issuer")
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    (tmp_path / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    loopback: list[x509.GeneralName] = [
        x509.DNSName("localhost"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
    ]
    api_key = ec.generate_private_key(ec.SECP256R1())
    rogue_key = ec.generate_private_key(ec.SECP256R1())
    own_key = ec.generate_private_key(ec.SECP256R1())
    api = _cert("kvgov-control", loopback, api_key, (ca_name, ca_key))
    rogue = _cert(
        "billing.example", [x509.DNSName("billing.example")], rogue_key, (ca_name, ca_key)
    )
    own = _cert("127.0.0.1", loopback, own_key, None)
    return _Pki(
        ca=tmp_path / "ca.crt",
        api=tmp_path / "api.crt",
        api_key=_write(tmp_path / "api.crt", api, api_key),
        rogue=tmp_path / "rogue.crt",
        rogue_key=_write(tmp_path / "rogue.crt", rogue, rogue_key),
        self_signed=tmp_path / "own.crt",
        self_signed_key=_write(tmp_path / "own.crt", own, own_key),
    )


class _Ready(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def _https(cert: Path, key: Path) -> Iterator[int]:
    """An https server answering 200 to everything, presenting ``cert``: its port."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Ready)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    httpd.socket = ctx.wrap_socket(httpd.socket, server_side=True)
    with serving(httpd) as port:
        yield port


def _health(port: int, cert_file: Path, *args: str) -> tuple[int, str]:
    """``kvgov health`` of a sidecar whose API is bound to every address with ``cert_file``."""
    env = {
        "KVGOV_API__HOST": "0.0.0.0",
        "KVGOV_API__PORT": str(port),
        "KVGOV_API__TLS_CERT_FILE": str(cert_file),
        "KVGOV_API__TLS_KEY_FILE": str(cert_file.with_suffix(".key")),
    }
    run = CliRunner().invoke(build_app(), ["health", *args], env=env)
    return run.exit_code, run.output


def _concat(target: Path, *parts: Path) -> Path:
    target.write_bytes(b"".join(p.read_bytes() for p in parts))
    return target


@pytest.mark.parametrize("bundle", ["full_chain", "appended_self_signed"])
def test_the_probe_accepts_no_other_certificate_of_the_file(
    pki: _Pki, tmp_path: Path, bundle: str
) -> None:
    if bundle == "full_chain":
        # cert-manager's tls.crt: the leaf, then its CA; the attacker has another leaf of that CA
        cert_file = _concat(tmp_path / "tls.crt", pki.api, pki.ca)
        presented, presented_key = pki.rogue, pki.rogue_key
    else:
        # a certificate placed in the file after the API's own
        cert_file = _concat(tmp_path / "tls.crt", pki.api, pki.self_signed)
        presented, presented_key = pki.self_signed, pki.self_signed_key
    cert_file.with_suffix(".key").write_bytes(pki.api_key.read_bytes())
    with _https(presented, presented_key) as port:
        code, out = _health(port, cert_file)
    assert code == 1, out
    assert PIN_REFUSED in out, out
    assert f"https://127.0.0.1:{port}/readyz" in out, out
    assert "BEGIN CERTIFICATE" not in out


def test_the_probe_accepts_the_apis_own_leaf_alone_or_with_its_chain(
    pki: _Pki, tmp_path: Path
) -> None:
    full = _concat(tmp_path / "full.crt", pki.api, pki.ca)
    full.with_suffix(".key").write_bytes(pki.api_key.read_bytes())
    with _https(pki.api, pki.api_key) as port:
        for cert_file in (pki.api, full):
            code, out = _health(port, cert_file)
            assert code == 0, out
            assert f"https://127.0.0.1:{port}/readyz: 200" in out, out
    # the server sends its chain as well: the leaf is still what is compared
    with _https(full, pki.api_key) as port:
        assert _health(port, pki.api)[0] == 0


def test_a_cert_file_holding_no_certificate_is_refused_quoting_nothing(
    pki: _Pki, tmp_path: Path
) -> None:
    not_a_cert = tmp_path / "swapped.crt"
    not_a_cert.write_bytes(pki.api_key.read_bytes())  # the key given as the certificate
    not_a_cert.with_suffix(".key").write_bytes(pki.api_key.read_bytes())
    with _https(pki.api, pki.api_key) as port:
        code, out = _health(port, not_a_cert)
    assert code == 1, out
    assert f"cannot use {not_a_cert} to verify the API" in out, out
    assert "PRIVATE KEY" not in out and "BEGIN" not in out


def test_cacert_checks_the_host_name(pki: _Pki) -> None:
    """``--cacert``: a normal verifying client: the CA's certificate for the URL's host only."""
    app = build_app()
    with _https(pki.api, pki.api_key) as port:
        for host in ("127.0.0.1", "localhost"):
            url = f"https://{host}:{port}/readyz"
            run = CliRunner().invoke(app, ["health", "--url", url, "--cacert", str(pki.ca)])
            assert run.exit_code == 0, run.output
    # a certificate the same CA issued for another name: refused at the probe's address
    with _https(pki.rogue, pki.rogue_key) as port:
        url = f"https://127.0.0.1:{port}/readyz"
        run = CliRunner().invoke(app, ["health", "--url", url, "--cacert", str(pki.ca)])
        assert run.exit_code == 1, run.output
        assert "127.0.0.1" in run.output and "certificate" in run.output.lower(), run.output


def test_only_the_leaf_itself_not_a_certificate_its_key_signed(tmp_path: Path) -> None:
    """A self-signed API certificate is a CA too (``openssl req -x509``, ``docs/api.md``): a
    certificate signed with the API's key chains to it, yet is not the API's certificate."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    api = (
        x509.CertificateBuilder()
        .subject_name(_name("kvgov-control"))
        .issuer_name(_name("kvgov-control"))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    api_file = tmp_path / "api.crt"
    _write(api_file, api, key)
    child_key = ec.generate_private_key(ec.SECP256R1())
    child = _cert(
        "elsewhere", [x509.DNSName("elsewhere")], child_key, (_name("kvgov-control"), key)
    )
    child_file = tmp_path / "child.crt"
    child_key_file = _write(child_file, child, child_key)
    with _https(api_file, api_file.with_suffix(".key")) as port:
        assert _health(port, api_file)[0] == 0
    with _https(child_file, child_key_file) as port:
        code, out = _health(port, api_file)
    assert code == 1, out
    assert PIN_REFUSED in out, out

"""What the attack tests share: a production-like governed sidecar (Postgres ledger, real Rego
policy, keyring, memory + filesystem tiers) with a policy data document of three tenants, a
raw ``lm://`` client, and the kvgov wire client of an authenticated engine.

Tenants in :func:`policy_data`: ``demo`` admits every engine (``"*"``), ``acme`` names its
engines (``vllm-acme`` and the ``lm://`` engine ``lm-acme``), ``globex`` names ``vllm-globex``,
``initech`` names ``vllm-initech`` and ``lm-acme``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import struct
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import select
from sqlalchemy.orm import Session

from kvgov.config import Settings
from kvgov.db.models import CacheEntry, LedgerEvent
from kvgov.db.purge_views import JobView, PurgeRequest
from kvgov.proxy.app import Sidecar, build_sidecar
from kvgov.types import EntryState, EventKind
from kvgov.wire import WireClient
from tests.integration.live import recv_exact

T = TypeVar("T")

LM_REQUEST = struct.Struct("=iiiiiiiii150s")
LM_REPLY = struct.Struct("=iiiiiiiii")
LM_PUT, LM_GET, LM_EXIST = 1, 2, 3
MODEL = "meta-llama/Llama-3.1-8B"
TOKENS = {"tok-acme": "vllm-acme", "tok-globex": "vllm-globex", "tok-demo": "vllm-demo"}


def policy_data() -> dict[str, Any]:
    base = Path(__file__).resolve().parents[2] / "src/kvgov/policy/rego/data.json"
    data: dict[str, Any] = json.loads(base.read_text())
    data["tenants"] = {
        "demo": {"enabled": True, "engines": ["*"]},
        "acme": {"enabled": True, "engines": ["vllm-acme", "lm-acme"]},
        "globex": {"enabled": True, "engines": ["vllm-globex"]},
        # an operator's policy that also names the lm:// engine here
        "initech": {"enabled": True, "engines": ["vllm-initech", "lm-acme"]},
    }
    data["revision"] = "security-doors"
    return data


def key(chunk: int, tenant: str, user: str | None = None) -> str:
    tags = f"@tenant%{tenant}" + (f"@user%{user}" if user else "")
    return f"{MODEL}@1@0@{chunk:x}@bfloat16{tags}"


@dataclass(frozen=True)
class ProdDatabase:
    """A migrated ledger database and the runtime role a production sidecar connects as (the
    ``prod_db`` fixture, ``tests/security/conftest.py``)."""

    url: str
    runtime_role: str

    @property
    def superuser_dsn(self) -> str:
        """A libpq DSN to this database as the server's superuser (what a DBA holds)."""
        from tests.conftest import PG_ADMIN_DSN

        return PG_ADMIN_DSN.rsplit("/", 1)[0] + "/" + self.url.rsplit("/", 1)[1]


def settings(tmp_path: Path, db: ProdDatabase, **dataplane: Any) -> Settings:
    tmp_path.mkdir(parents=True, exist_ok=True)
    data_file = tmp_path / "policy-data.json"
    data_file.write_text(json.dumps(policy_data()))
    kek = provisioned_kek(tmp_path / "kek.key")
    provisioned_keys(tmp_path / "data")
    # one fleet, one pseudonym key: the ledger pins the first one a sidecar of `db` used, and
    # refuses another (kvgov.ledger.keypin), so every sidecar of `db` here mounts that one;
    # and one signing key, as the shipped manifests mount it (a receipt rests on the purge
    # events of chains its signer trusts: kvgov.ledger.purge_trail)
    for name in ("pseudonym.key", "ledger-signing.key"):
        mounted = tmp_path / "data" / name
        fleet = _FLEET_KEYS.setdefault((db.url, name), mounted.read_bytes())
        if mounted.read_bytes() != fleet:
            mounted.write_bytes(fleet)  # the file stays 0600
    return Settings(
        environment="production",
        data_dir=tmp_path / "data",
        database={"url": db.url, "runtime_role": db.runtime_role},
        keys={"kek_path": kek},
        policy={"data_file": data_file},
        dataplane={
            "host": "127.0.0.1",
            "port": 0,
            "engine_tokens": TOKENS,
            "buffer_pool_bytes": 64 << 20,
            **dataplane,
        },
        tiers={
            "chain": ["memory", "filesystem"],
            "filesystem_fsync": False,
            # production refuses the filesystem tier unbounded (review r16, finding 1)
            **known_tiers(filesystem_max_bytes=1 << 30),
        },
        # no vLLM here: the engines are the tests' clients (a test of the GPU step sets its own)
        purge={"no_gpu_prefix_cache": True},
    )


#: the pseudonym and signing key files of each database's fleet (by runtime URL and file name),
#: what :func:`settings` mounts
_FLEET_KEYS: dict[tuple[str, str], bytes] = {}


def provisioned_kek(path: Path) -> Path:
    """A KEK file as an operator provisions it (production refuses an auto-generated one)."""
    if not path.exists():
        from kvgov.keys.kek import generate_kek_file

        generate_kek_file(path)
        path.write_text(path.read_text().replace(" auto-generated", " provisioned", 1))
    return path


def provisioned_keys(data_dir: Path) -> None:
    """The fleet's pseudonym and signing keys, where these settings look for them (the data
    directory's default paths): production never generates them (review 4a, finding 2)."""
    from kvgov.ledger.chain import generate_signing_key_file
    from kvgov.ledger.pseudonym import generate_pseudonym_key_file

    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    generate_pseudonym_key_file(data_dir / "pseudonym.key")
    generate_signing_key_file(data_dir / "ledger-signing.key")


@asynccontextmanager
async def sidecar(tmp_path: Path, db: ProdDatabase, **dataplane: Any) -> AsyncIterator[Sidecar]:
    """A started sidecar whose policy is built from its settings (the data document above)."""
    sc = await build_sidecar(settings(tmp_path, db, **dataplane))
    await sc.start()
    try:
        yield sc
    finally:
        await sc.stop()


async def run(fn: Callable[..., T], *args: Any) -> T:
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


def engine(sc: Sidecar, token: str) -> WireClient:
    return WireClient(
        f"tcp://127.0.0.1:{sc.server.tcp_port}", engine_id="ignored", token=token, timeout=10
    )


def events(sc: Sidecar, kind: EventKind) -> list[LedgerEvent]:
    with Session(sc.engine) as s:
        return list(s.scalars(select(LedgerEvent).where(LedgerEvent.kind == kind)).all())


def entry_state(sc: Sidecar, digest: str) -> EntryState | None:
    """The state of ``digest``'s ``cache_entries`` row (None: no row)."""
    with Session(sc.engine) as s:
        return s.scalar(select(CacheEntry.state).where(CacheEntry.key_digest == digest))


async def purge(sc: Sidecar, tenant: str, user: str | None) -> JobView:
    """A purge of ``user`` (None: the whole tenant) run by ``sc``'s own service, to its end."""
    assert sc.purge is not None
    service = sc.purge.service
    job = await service.create(PurgeRequest(tenant=tenant, user=user, requested_by="test"))
    return await asyncio.wait_for(service.wait(job.id), 60)


def receipt(job: JobView) -> dict[str, Any]:
    """The signed receipt's body of a finished job."""
    assert job.receipt is not None, job.state
    signed: dict[str, Any] = job.receipt["receipt"]
    return signed


@asynccontextmanager
async def control_up(sc: Sidecar, token: str) -> AsyncIterator[None]:
    """The engine of ``token`` keeps its control channel to ``sc`` up meanwhile (evicting
    nothing), as a connector does: a purge names a holder without one unreachable."""
    client = engine(sc, token)
    channel = client.control(lambda request: [], reconnect_delay=0.1)
    try:
        assert await run(channel.connected.wait, 10), "the control channel did not connect"
        yield
    finally:
        channel.close()
        client.close()


class LmClient:
    """A raw ``lm://`` client: what any local process can send (no handshake, no token)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)

    def close(self) -> None:
        self.sock.close()

    def _head(self, command: int, raw_key: str, length: int = 0) -> bytes:
        return LM_REQUEST.pack(command, length, 1, 3, 0, 1, 1, 1, length, raw_key.encode())

    def put(self, raw_key: str, value: bytes) -> None:
        self.sock.sendall(self._head(LM_PUT, raw_key, len(value)) + value)

    def exists(self, raw_key: str) -> bool:
        self.sock.sendall(self._head(LM_EXIST, raw_key))
        return LM_REPLY.unpack(recv_exact(self.sock, LM_REPLY.size))[0] == 200

    def get(self, raw_key: str) -> bytes | None:
        self.sock.sendall(self._head(LM_GET, raw_key))
        head = LM_REPLY.unpack(recv_exact(self.sock, LM_REPLY.size))
        if head[0] != 200:
            return None
        return recv_exact(self.sock, head[1])


def known_dataplane(**wanted: Any) -> dict[str, Any]:
    """The data-plane settings of ``wanted`` that this build has (an attack test runs the
    attack on a build without the limit, and fails there because the attack works)."""
    from kvgov.config import DataPlaneSettings

    return {k: v for k, v in wanted.items() if k in DataPlaneSettings.model_fields}


def known_tiers(**wanted: Any) -> dict[str, Any]:
    """The tier settings of ``wanted`` that this build has (as :func:`known_dataplane`)."""
    from kvgov.config import TierSettings

    return {k: v for k, v in wanted.items() if k in TierSettings.model_fields}


class WireProbe:
    """A raw kvgov wire client for the resource attacks: frames as an attacker writes them
    (stream id 1, payload length declared, bytes sent separately), replies read whole."""

    def __init__(self, port: int, timeout: float = 10.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)

    def close(self) -> None:
        self.sock.close()

    def send(self, ftype: Any, meta: dict[str, Any] | None, payload_len: int = 0) -> None:
        from kvgov.wire.codec import encode_frame

        self.sock.sendall(encode_frame(ftype, 1, meta, payload_len))

    def reply(self) -> tuple[Any, dict[str, Any]]:
        from kvgov.wire.codec import HEADER_SIZE, decode_header, decode_meta

        header = decode_header(recv_exact(self.sock, HEADER_SIZE))
        meta = decode_meta(recv_exact(self.sock, header.meta_len))
        recv_exact(self.sock, header.payload_len)
        return header.type, meta

    def hello(self, token: str) -> dict[str, Any]:
        from kvgov.wire.codec import PROTOCOL_VERSION, FrameType

        first, answer = token_hello(token, {"engine": "x", "version": PROTOCOL_VERSION})
        self.send(FrameType.HELLO, first)
        ftype, meta = self.reply()
        assert ftype is FrameType.HELLO, meta
        self.send(FrameType.HELLO, answer(meta))
        ftype, meta = self.reply()
        assert ftype is FrameType.HELLO, meta
        return meta

    def closed_within(self, seconds: float) -> bool:
        return closed_within(self.sock, seconds)


def token_hello(
    token: str, meta: dict[str, Any]
) -> tuple[dict[str, Any], Callable[[dict[str, Any]], dict[str, Any]]]:
    """An engine's token handshake by hand (:func:`kvgov.wire.handshake.start`): the first
    HELLO's metadata, and what answers the sidecar's challenge (asserting its proof)."""
    from kvgov.wire import handshake

    first, answer = handshake.start(token, meta)

    def answered(challenge: dict[str, Any]) -> dict[str, Any]:
        mine = answer(challenge)
        assert mine is not None, "the sidecar proved nothing"
        return mine

    return first, answered


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes ``sock`` within ``seconds`` (what it still sends before
    closing is read and dropped). Blocking: call it through :func:`run` in a test."""
    import time

    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            if not sock.recv(65536):
                return True
        except TimeoutError:
            return False
        except OSError:  # reset
            return True
    return False


# -- raw kvgov-wire frames, other tier chains (the "doors that held" tests) --------------------


def tiered_settings(
    tmp_path: Path, db: ProdDatabase, tiers: dict[str, Any], **dataplane: Any
) -> Settings:
    """:func:`settings` with another tier chain (e.g. ``{"chain": ["filesystem"]}``, or Redis
    under a test's own prefix), so a test reaches the tier it tampers with."""
    from kvgov.config import TierSettings

    base = settings(tmp_path, db, **dataplane)
    merged = {**base.tiers.model_dump(), **tiers}
    return base.model_copy(update={"tiers": TierSettings(**merged)})


@asynccontextmanager
async def tiered_sidecar(
    tmp_path: Path, db: ProdDatabase, tiers: dict[str, Any], **dataplane: Any
) -> AsyncIterator[Sidecar]:
    sc = await build_sidecar(tiered_settings(tmp_path, db, tiers, **dataplane))
    await sc.start()
    try:
        yield sc
    finally:
        await sc.stop()


@dataclass(frozen=True)
class Frame:
    """One frame as a raw client reads it."""

    type: int
    flags: int
    stream_id: int
    meta: dict[str, Any]
    payload: bytes

    @property
    def error(self) -> str | None:
        """The ERROR frame's name (``unauthenticated``...), None for any other frame."""
        from kvgov.wire.codec import FrameType

        return str(self.meta.get("name")) if self.type == FrameType.ERROR else None


class RawWire:
    """A hand-rolled kvgov-wire client: sends whatever bytes an attacker chooses and reads the
    frames that come back (blocking; call it through :func:`run`)."""

    def __init__(self, port: int, timeout: float = 10) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)

    @classmethod
    def unix(cls, path: str, timeout: float = 10) -> RawWire:
        self = cls.__new__(cls)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)
        return self

    def close(self) -> None:
        self.sock.close()

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send(
        self,
        ftype: int,
        sid: int,
        meta: dict[str, Any] | None = None,
        payload: bytes = b"",
        *,
        flags: int = 0,
    ) -> None:
        from kvgov.wire.codec import Flag, FrameType, encode_frame

        self.sock.sendall(encode_frame(FrameType(ftype), sid, meta, len(payload), Flag(flags)))
        if payload:
            self.sock.sendall(payload)

    def hello(self, token: str | None, engine: str = "raw", **extra: Any) -> Frame:
        from kvgov.wire.codec import FrameType

        meta: dict[str, Any] = {"version": 1, "engine": engine, **extra}
        if token is None:
            self.send(FrameType.HELLO, 1, meta)
            return self.read()
        first, answer = token_hello(token, meta)
        self.send(FrameType.HELLO, 1, first)
        challenge = self.read()
        if challenge.type != FrameType.HELLO:  # refused (an unknown token id...)
            return challenge
        self.send(FrameType.HELLO, 1, answer(challenge.meta))
        return self.read()

    def read(self) -> Frame:
        """The next frame; :class:`ConnectionError` if the sidecar closed the connection."""
        return self.read_from(self.sock)

    @staticmethod
    def read_from(sock: socket.socket) -> Frame:
        """The next frame on ``sock``."""
        from kvgov.wire.codec import HEADER, decode_meta

        head = recv_exact(sock, HEADER.size)
        _magic, _version, ftype, flags, sid, meta_len, payload_len = HEADER.unpack(head)
        meta = decode_meta(recv_exact(sock, meta_len)) if meta_len else {}
        payload = recv_exact(sock, payload_len) if payload_len else b""
        return Frame(ftype, flags, sid, meta, payload)

    def closed_by_peer(self) -> bool:
        """True once the sidecar has closed the connection (reads until EOF; anything it sends
        first is ignored); False if it is still open when the timeout runs out."""
        try:
            while self.sock.recv(65536):
                pass
        except TimeoutError:
            return False
        except ConnectionError:
            return True
        return True


def all_events(sc: Sidecar) -> list[LedgerEvent]:
    with Session(sc.engine) as s:
        return list(s.scalars(select(LedgerEvent).order_by(LedgerEvent.seq)).all())


def replace_file(path: Path, text: str) -> None:
    """Replace a file in one step, as the kubelet swaps a ConfigMap's or a Secret's files."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.chmod(0o600)  # a Secret's file others may not read (kvgov.privatefs.read_guarded_file)
    tmp.replace(path)


def value_of(got: tuple[bytes, Any] | None) -> bytes | None:
    """The bytes of a :meth:`~kvgov.wire.WireClient.get` (None: a miss)."""
    return None if got is None else got[0]


def wait_for(cond: Callable[[], bool], limit: float) -> bool:
    """Poll ``cond`` every 10 ms for at most ``limit`` seconds; whether it came true."""
    deadline = time.monotonic() + limit
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


async def until(cond: Callable[[], bool], limit: float) -> bool:
    """:func:`wait_for` on the event loop (the sidecar under test runs there too): poll
    ``cond`` every 20 ms for at most ``limit`` seconds; whether it came true."""
    deadline = time.monotonic() + limit
    while not cond():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


def error_logs(records: list[logging.LogRecord]) -> list[logging.LogRecord]:
    """What a crashed handler leaves: a record at ERROR, one carrying a traceback, or
    ``dataplane.connection.failed``."""
    return [
        r
        for r in records
        if r.levelno >= logging.ERROR
        or r.exc_info
        or r.getMessage() == "dataplane.connection.failed"
    ]


@dataclass(frozen=True)
class TlsIdentity:
    """A CA and a server certificate it signed (for ``127.0.0.1`` and ``localhost``), as an
    operator provisions them (``docs/api.md``, "TLS"): the key 0600, the certificate 0644."""

    ca: Path
    cert: Path
    key: Path


def tls_identity(directory: Path, name: str = "api-tls") -> TlsIdentity:
    """A fresh CA and server certificate under ``directory`` (made with ``cryptography``)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvgov test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvgov-control")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
        )
        .sign(ca_key, hashes.SHA256())
    )
    paths = TlsIdentity(
        ca=directory / f"{name}-ca.crt",
        cert=directory / f"{name}.crt",
        key=directory / f"{name}.key",
    )
    paths.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    paths.key.touch(mode=0o600)
    paths.key.chmod(0o600)
    paths.key.write_bytes(pem)
    return paths

"""Key-encryption keys (KEKs): the :class:`KekProvider` protocol and the local key file.

A KEK wraps data keys (DEKs); it never touches KV bytes. The local provider keeps a 256-bit
AES key in a small text file (mode 0600) and wraps with AES-256-GCM, the caller's AAD (key id,
version, tenant) bound to every wrapped DEK so a wrapped row copied to another key id fails to
unwrap. Vault Transit or a cloud KMS plugs in as another class with the same three members
(see ``docs/keys.md``); :func:`load_kek_provider` is the registry that picks one from settings.
"""

from __future__ import annotations

import base64
import logging
import os
import secrets
import stat
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvgov.config import Settings
from kvgov.errors import KeyManagementError, StartupError
from kvgov.privatefs import read_private_file
from kvgov.types import Environment

log = logging.getLogger(__name__)

_MAGIC = "kvgov-kek"
_FILE_VERSION = "1"
_KEY_BYTES = 32
_NONCE_BYTES = 12
_WRAP_VERSION = b"\x01"
_WRAP_AAD_PREFIX = b"kvgov/kek-wrap/v1\x00"


class KekProvider(Protocol):
    """Wraps and unwraps data keys. ``aad`` binds the wrapped bytes to the key they belong to."""

    @property
    def kek_id(self) -> str:
        """Identity of the KEK (recorded with every wrapped DEK; never secret)."""
        ...

    def wrap(self, dek: bytes, aad: bytes) -> bytes: ...

    def unwrap(self, wrapped: bytes, aad: bytes) -> bytes: ...


@dataclass(frozen=True, slots=True)
class KekFile:
    """What a KEK file holds, parsed."""

    kek_id: str
    key: bytes
    auto_generated: bool
    created_at: str


def generate_kek_file(path: Path, *, exist_ok: bool = False) -> Path:
    """Create a fresh KEK file at ``path`` (mode 0600, parent directories 0700 if created).

    The file records that it was auto-generated, so production mode refuses it: a production
    KEK is provisioned on purpose (and kept out of database backups). With ``exist_ok`` an
    existing file is left untouched; without it an existing file is an error, never overwritten.
    """
    path = Path(path)
    if path.exists():
        if exist_ok:
            return path
        raise KeyManagementError(
            f"KEK file already exists: {path}",
            hint="a KEK is never overwritten: data keys wrapped by it would become unreadable",
        )
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    kek_id = "file:" + secrets.token_hex(8)
    created = datetime.now(UTC).isoformat(timespec="seconds")
    text = (
        f"# {_MAGIC} {_FILE_VERSION} auto-generated {created}\n"
        "# kvgov key-encryption key: keep secret, keep out of database backups\n"
        f"id: {kek_id}\n"
        f"key: {base64.b64encode(secrets.token_bytes(_KEY_BYTES)).decode()}\n"
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)
    log.info("keys.kek.generated", extra={"kek_id": kek_id, "path": str(path)})
    return path


def read_kek_file(path: Path) -> KekFile:
    """Parse a KEK file, refusing loose permissions (any group or other access) and a file
    of another user."""
    path = Path(path)
    try:
        st = path.stat()
    except FileNotFoundError as exc:
        raise StartupError(
            f"KEK file not found: {path}", hint="run `kvgov init` or set keys.kek_path"
        ) from exc
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise StartupError(
            f"KEK file {path} has loose permissions {stat.filemode(st.st_mode)}",
            hint=f"chmod 600 {path}",
        )
    try:  # the same checks on the file opened, and its owner (privatefs)
        text = read_private_file(path, "KEK file").decode("ascii")
    except UnicodeDecodeError:
        raise StartupError(f"{path} is not a kvgov KEK file (not ASCII)") from None
    lines = text.splitlines()
    if not lines or not lines[0].startswith(f"# {_MAGIC} "):
        raise StartupError(f"{path} is not a kvgov KEK file (missing header line)")
    header = lines[0].split()
    if len(header) < 3 or header[2] != _FILE_VERSION:
        raise StartupError(f"KEK file {path} has an unsupported format version")
    auto = "auto-generated" in header[3:]
    created = header[-1] if len(header) > 4 else ""
    fields: dict[str, str] = {}
    for line in lines[1:]:
        if not line.strip() or line.startswith("#"):
            continue
        name, sep, value = line.partition(":")
        if not sep:
            raise StartupError(f"KEK file {path}: malformed line")
        fields[name.strip()] = value.strip()
    try:
        key = base64.b64decode(fields["key"], validate=True)
        kek_id = fields["id"]
    except (KeyError, ValueError) as exc:
        raise StartupError(f"KEK file {path}: missing or invalid id/key") from exc
    if len(key) != _KEY_BYTES or not kek_id:
        raise StartupError(f"KEK file {path}: key must be {_KEY_BYTES} bytes")
    return KekFile(kek_id=kek_id, key=key, auto_generated=auto, created_at=created)


class FileKekProvider:
    """The local key file KEK: AES-256-GCM key wrap with a random nonce per wrap.

    Wrapped form: ``0x01 || nonce(12) || ciphertext+tag``. The caller's AAD is prefixed with
    a domain label and this KEK's id, so bytes wrapped by one KEK never unwrap under another.
    """

    def __init__(self, path: Path, *, environment: Environment = Environment.DEVELOPMENT) -> None:
        kek = read_kek_file(path)
        if kek.auto_generated and environment is Environment.PRODUCTION:
            raise StartupError(
                f"KEK file {path} was auto-generated; production refuses it",
                hint="provision a KEK on purpose (from your KMS or a secrets manager) and point "
                "keys.kek_path at it; see docs/keys.md",
            )
        self._kek_id = kek.kek_id
        self._aead = AESGCM(kek.key)
        self._aad_prefix = _WRAP_AAD_PREFIX + kek.kek_id.encode() + b"\x00"

    @property
    def kek_id(self) -> str:
        return self._kek_id

    def wrap(self, dek: bytes, aad: bytes) -> bytes:
        nonce = secrets.token_bytes(_NONCE_BYTES)
        return _WRAP_VERSION + nonce + self._aead.encrypt(nonce, dek, self._aad_prefix + aad)

    def unwrap(self, wrapped: bytes, aad: bytes) -> bytes:
        if len(wrapped) < 1 + _NONCE_BYTES + 16 or wrapped[:1] != _WRAP_VERSION:
            raise KeyManagementError("wrapped data key is malformed or of an unknown version")
        nonce = wrapped[1 : 1 + _NONCE_BYTES]
        try:
            return self._aead.decrypt(nonce, wrapped[1 + _NONCE_BYTES :], self._aad_prefix + aad)
        except InvalidTag as exc:
            raise KeyManagementError(
                f"wrapped data key does not unwrap under KEK {self._kek_id}",
                hint="the row was altered, belongs to another key id, or another KEK wrapped it",
            ) from exc


def load_kek_provider(settings: Settings) -> KekProvider:
    """The configured KEK provider (registry: ``keys.kek_provider``). Failing to load stops
    startup: a missing KEK must never silently fall back to something weaker."""
    if settings.keys.kek_provider == "file":
        return FileKekProvider(settings.kek_path, environment=settings.environment)
    raise StartupError(f"unknown KEK provider {settings.keys.kek_provider!r}")  # pragma: no cover

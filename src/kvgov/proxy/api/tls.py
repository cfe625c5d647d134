"""TLS for the REST API (``api.tls_cert_file`` / ``api.tls_key_file``): the server context,
built once at start-up so that a missing file, a loose key or a key that does not match its
certificate stops ``kvgov serve`` instead of failing the first request.

The API carries bearer tokens, the dashboard's session cookie and every compliance answer
(provenance, purge receipts); beyond loopback it must not do so in the clear
(:meth:`kvgov.config.Settings.production_problems`). The key is read like the sidecar's other
keys (:func:`kvgov.privatefs.read_private_file`: this process's own, 0600 or stricter) and
handed to OpenSSL through an anonymous in-memory file, so what OpenSSL loads is exactly the
bytes that passed the check. Errors name the setting and the path, never what the files hold.
"""

from __future__ import annotations

import contextlib
import os
import ssl
from collections.abc import Iterator
from typing import TYPE_CHECKING

from kvgov.errors import ConfigError, StartupError
from kvgov.privatefs import read_private_file

if TYPE_CHECKING:
    from kvgov.config import ApiSettings

_CERT = "api.tls_cert_file"
_KEY = "api.tls_key_file"
#: OpenSSL's names of the TLS 1.2 suites served: ECDHE key exchange, AES-GCM or ChaCha20
_TLS12_CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20:!aNULL"
_PROVISION = 'provision the API\'s certificate and key (docs/api.md, "TLS")'


def api_tls_context(api: ApiSettings) -> ssl.SSLContext | None:
    """The API's server-side TLS context (TLS 1.2 at least), or None when TLS is not
    configured. Raises :class:`ConfigError` naming the setting when a file is missing or
    unreadable, the key is not private, or the key does not match the certificate."""
    if api.tls_cert_file is None or api.tls_key_file is None:
        return None  # both or neither: ApiSettings refuses one alone
    cert = api.tls_cert_file
    try:
        with cert.open("rb") as f:
            head = f.read(1 << 20)
    except OSError as exc:
        raise ConfigError(f"cannot read {_CERT} {cert}: {exc.strerror}", hint=_PROVISION) from None
    if b"-----BEGIN CERTIFICATE-----" not in head:
        raise ConfigError(
            f"{_CERT} {cert} holds no PEM certificate",
            hint="it must hold the server's certificate (and its chain), PEM-encoded",
        )
    if not api.tls_key_file.exists():  # a TLS key is provisioned, never generated
        raise ConfigError(f"{_KEY} not found: {api.tls_key_file}", hint=_PROVISION)
    try:
        key = read_private_file(api.tls_key_file, _KEY)
    except StartupError as exc:
        raise ConfigError(exc.message, hint=exc.hint) from None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    # TLS 1.2: forward-secret AEAD suites only (TLS 1.3's are all such); no tickets (a
    # ticket key outlives sessions), no renegotiation
    ctx.set_ciphers(_TLS12_CIPHERS)
    ctx.options |= ssl.OP_NO_COMPRESSION | ssl.OP_NO_TICKET | ssl.OP_NO_RENEGOTIATION
    try:
        with _in_memory(key) as key_path:
            ctx.load_cert_chain(cert, key_path, password=_no_password)
    except _EncryptedKeyError:
        raise ConfigError(
            f"{_KEY} {api.tls_key_file} is encrypted",
            hint="give kvgov the key unencrypted (a 0600 file only its user can read)",
        ) from None
    except (ssl.SSLError, OSError) as exc:
        # OpenSSL's reason (KEY_VALUES_MISMATCH, NO_START_LINE...), never the files' bytes
        reason = getattr(exc, "reason", None) or type(exc).__name__
        raise ConfigError(
            f"{_CERT} {cert} and {_KEY} {api.tls_key_file} do not make a TLS identity ({reason})",
            hint="the key must be the certificate's own private key, both PEM-encoded",
        ) from None
    return ctx


class _EncryptedKeyError(Exception):
    pass


def _no_password() -> bytes:
    """OpenSSL asks for a password only for an encrypted key: refuse, never prompt."""
    raise _EncryptedKeyError


@contextlib.contextmanager
def _in_memory(data: bytes) -> Iterator[str]:
    """A path OpenSSL can open that holds ``data`` and exists nowhere on disk (a memfd, as
    ``/proc/self/fd/N``; Linux, like the sidecar): the ``ssl`` module loads keys from paths
    only, and opening the checked path again would load whatever is there by then."""
    fd = os.memfd_create("kvgov-api-tls-key", os.MFD_CLOEXEC)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)

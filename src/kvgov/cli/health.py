"""``kvgov health``: ask this host's sidecar whether it is ready (the image's HEALTHCHECK).

Standard library only, and no ledger or policy is touched: it reads the control plane's
address from the settings and GETs ``/readyz`` (``--live``: ``/healthz``). Exit 0 when the
answer is 200, 1 otherwise (not ready, draining, nothing listening).

With ``api.tls_cert_file`` set it asks over https and accepts exactly the API's own
certificate, the file's first (pinned: the probe goes to loopback, which the certificate need
not name, so no host name is checked, and no other certificate of the file, a chain's CA or a
bundle's, is trusted); ``--cacert`` verifies an https ``--url`` against a CA instead, host name
included.
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    import ssl

#: addresses a server binds to that mean "every address": the probe asks loopback instead
_ANY = frozenset({"", "0.0.0.0", "::", "[::]"})  # noqa: S104 - compared, never bound


def probe_url(host: str, port: int, *, live: bool = False, tls: bool = False) -> str:
    """The URL of this host's control plane probe for a server bound to ``host:port``."""
    host = "127.0.0.1" if host in _ANY else host
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    scheme = "https" if tls else "http"
    return f"{scheme}://{host}:{port}/{'healthz' if live else 'readyz'}"


#: the first PEM certificate of a file: the leaf ``load_cert_chain`` presents
_PEM_CERT = re.compile(rb"-----BEGIN CERTIFICATE-----\r?\n.+?-----END CERTIFICATE-----", re.S)


def first_certificate(cert: Path) -> bytes:
    """The DER bytes of the first certificate in the PEM file ``cert`` (``ValueError``: none)."""
    import ssl

    found = _PEM_CERT.search(cert.read_bytes())
    if found is None:
        raise ValueError("it holds no PEM certificate")
    try:
        return ssl.PEM_cert_to_DER_cert(found.group().decode("ascii"))
    except ValueError:  # its message could quote a byte of the file
        raise ValueError("its first certificate is not valid PEM") from None


def pinned_context(cert: Path) -> ssl.SSLContext:
    """A client context that accepts the server only if it presents the first certificate of
    ``cert`` (the API's own: ``api.tls_cert_file``), compared byte for byte after OpenSSL has
    verified the handshake against that certificate alone; no host name check: the certificate
    itself is what is pinned. Another certificate the file holds (a chain's CA, a bundle's)
    trusts nothing. A refusal is a :class:`CertificatePinError`."""
    import ssl

    pin = first_certificate(cert)
    ctx = ssl.create_default_context(cadata=pin)  # the leaf alone, not the file's other certs
    ctx.check_hostname = False
    ctx.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN  # a leaf as its own trust anchor
    ctx.sslsocket_class = _pinned_socket(hashlib.sha256(pin).digest(), cert)
    return ctx


def _pinned_socket(digest: bytes, source: Path) -> type[ssl.SSLSocket]:
    import ssl

    #: OpenSSL's answers that are about the pinned certificate itself, not another one
    own_faults = {9, 10}  # X509_V_ERR_CERT_NOT_YET_VALID, X509_V_ERR_CERT_HAS_EXPIRED

    class PinnedSocket(ssl.SSLSocket):
        def do_handshake(self, block: bool = False) -> None:
            try:
                super().do_handshake(block)
            except ssl.SSLCertVerificationError as exc:
                if exc.verify_code in own_faults:
                    raise
                raise CertificatePinError(source) from None
            der = self.getpeercert(binary_form=True)
            seen = hashlib.sha256(der or b"").digest()
            if der is None or not hmac.compare_digest(seen, digest):
                raise CertificatePinError(source)

    return PinnedSocket


class CertificatePinError(OSError):
    """The server presented a certificate other than the pinned one (an ``OSError``, as the
    socket's own errors are, so the connection is closed and the request fails)."""

    def __init__(self, source: Path) -> None:
        super().__init__(
            f"the server's certificate is not the API's certificate (the first in {source})"
        )

    def __str__(self) -> str:
        return str(self.args[0])


def check(url: str, timeout_s: float, context: ssl.SSLContext | None = None) -> tuple[bool, str]:
    """GET ``url`` with no proxy (``context``: how an https server is verified; default: the
    system's CAs); (ready, what was seen)."""
    import ssl
    import urllib.error
    import urllib.request

    handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
    if context is not None:
        handlers.append(urllib.request.HTTPSHandler(context=context))
    opener = urllib.request.build_opener(*handlers)
    try:
        with opener.open(url, timeout=timeout_s) as reply:
            return reply.status == 200, f"{reply.status}"
    except urllib.error.HTTPError as exc:
        return False, f"{exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, CertificatePinError | ssl.SSLCertVerificationError):
            return False, f"certificate refused: {reason}"
        return False, f"unreachable ({reason})"
    except http.client.HTTPException as exc:  # no HTTP answer (plain HTTP to a TLS port)
        return False, f"no HTTP answer ({type(exc).__name__})"


def register(app: typer.Typer) -> None:
    @app.command()
    def health(
        ctx: typer.Context,
        live: Annotated[
            bool, typer.Option("--live", help="Ask /healthz (alive) instead of /readyz.")
        ] = False,
        url: Annotated[
            str | None, typer.Option("--url", help="Probe this URL instead of the settings'.")
        ] = None,
        timeout: Annotated[float, typer.Option("--timeout", help="Seconds to wait.")] = 2.0,
        cacert: Annotated[
            Path | None,
            typer.Option(
                "--cacert",
                help="Verify an https server against this CA file (PEM), host name included.",
            ),
        ] = None,
    ) -> None:
        """Exit 0 if this host's sidecar answers /readyz (or /healthz) with 200."""
        import ssl

        context: ssl.SSLContext | None = None
        trust = cacert
        try:
            if cacert is not None:
                context = ssl.create_default_context(cafile=str(cacert))
            if url is None:
                from kvgov.cli._common import settings

                api = settings(ctx).api
                url = probe_url(api.host, api.port, live=live, tls=api.tls)
                if context is None and api.tls_cert_file is not None:
                    trust = api.tls_cert_file
                    context = pinned_context(api.tls_cert_file)
        except (OSError, ValueError) as exc:  # the file, never what it holds
            reason = getattr(exc, "strerror", None) or type(exc).__name__
            if isinstance(exc, ValueError):
                reason = str(exc)  # first_certificate's own words, no byte of the file
            typer.echo(f"cannot use {trust} to verify the API: {reason}", err=True)
            raise typer.Exit(1) from None
        ok, seen = check(url, timeout, context)
        from kvgov.cli._common import echo, shown

        echo(f"{url}: {shown(seen)}", err=not ok)  # what the peer answered: never raw
        raise typer.Exit(0 if ok else 1)

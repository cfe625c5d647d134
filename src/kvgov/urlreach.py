"""Where a ledger (Postgres) or Redis tier URL connects, and whether the URL itself demands TLS
that authenticates the server (review r16, finding 2).

Production refuses a URL that reaches beyond this host without it
(:meth:`kvgov.config.Settings.production_problems`): libpq's default, ``sslmode=prefer``, checks
no certificate and falls back to plaintext when whoever answers declines TLS, so an attacker
on the path to the database could answer in its place, relay the password exchange (no channel
binding without TLS) and keep a runtime-role session. ``sslmode=require`` encrypts but proves
nothing of the server either.

What counts is what the URL says. libpq also reads ``PGSSLMODE`` and ``PGSSLROOTCERT`` from the
environment, but only for a URL that names neither, and only in a process that has them (the
sidecar's container, not the migration Job or an operator's shell), so they do not count: the
URL, which travels in one Secret to every process that uses it, must say
``sslmode=verify-full`` (or ``verify-ca``) and ``sslrootcert``. Where the connection goes, on
the other hand, is read as libpq reads it, environment included (fail closed): the host and
``hostaddr`` psycopg is given (SQLAlchemy's own parse, so a ``?host=`` that replaces the URL's
authority counts), then ``PGHOST``/``PGHOSTADDR`` for what the URL leaves unset, and a
``service`` (``PGSERVICE``) whose ``pg_service.conf`` entry the URL does not show counts as
beyond this host.

Nothing here returns or quotes a password: a :class:`Reach` names hosts and TLS parameters
only.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

#: the sslmode values that make libpq authenticate the server (against ``sslrootcert``)
VERIFYING_SSLMODES = frozenset({"verify-full", "verify-ca"})
#: what to add to a Postgres URL (the shipped manifests mount the CA there)
POSTGRES_CURE = "sslmode=verify-full&sslrootcert=/etc/kvgov/database/ca.crt"
#: what :func:`libpq_params` gives for a parameter the URL repeats (SQLAlchemy passes psycopg
#: a tuple, which no libpq parameter means)
GIVEN_TWICE = "<given twice>"
#: redis-py reads these ``ssl_check_hostname`` values as false
_REDIS_FALSE = frozenset({"0", "F", "FALSE", "N", "NO"})


@dataclass(frozen=True)
class Reach:
    """Where a URL connects beyond this host (empty: loopback or a Unix socket only), whether
    the URL demands TLS that authenticates the server, and what it says of TLS (for messages:
    ``no sslmode``, ``sslmode=require`` ...). ``unreadable``: why the URL could not be read (it
    then counts as beyond this host and unverified)."""

    beyond: tuple[str, ...]
    verified: bool
    said: str
    unreadable: str | None = None
    #: it asks libpq to verify the server but names no CA (``sslrootcert``): libpq then trusts
    #: whatever ``~/.postgresql/root.crt`` the connecting process has
    lacks_ca: bool = False

    @property
    def exposed(self) -> bool:
        """The connection may cross a network without TLS that proves the server."""
        return bool(self.beyond) and not self.verified


def _unreadable(why: str) -> Reach:
    """A URL that could not be read: it counts as beyond this host, unverified."""
    return Reach(beyond=("<unreadable URL>",), verified=False, said="nothing", unreadable=why)


def is_loopback(host: str) -> bool:
    """A loopback address literal (127.0.0.0/8, ::1, an IPv4-mapped one) or ``localhost``.
    Nothing is resolved, and no other spelling counts (``localhost.``, ``127.1``,
    ``*.localhost``: a resolver decides where those go)."""
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def _listed(value: str | None) -> list[str] | None:
    """A libpq host or hostaddr list (comma-separated); None when unset or empty."""
    return [part.strip() for part in value.split(",")] if value else None


def libpq_params(url: str) -> dict[str, str]:
    """The connection parameters psycopg hands libpq for ``url``, as
    :func:`kvgov.db.engine.make_engine` connects (``postgresql://`` is psycopg's):
    SQLAlchemy's parse and its psycopg dialect's ``create_connect_args``, so that the host a
    ``?host=`` puts in place of the authority's, a host list, and repeated parameters read here
    as the driver reads them. Raises ``ValueError`` (never quoting the URL) when it cannot."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url[len("postgresql://") :]
    try:
        parsed = make_url(url)
        _args, params = parsed.get_dialect()().create_connect_args(parsed)
    except (ArgumentError, ValueError, TypeError, ImportError):
        raise ValueError("SQLAlchemy cannot read it as a postgresql+psycopg URL") from None
    out: dict[str, str] = {}
    for name, value in params.items():
        if isinstance(value, str | int):
            out[str(name)] = str(value)
        elif isinstance(value, list | tuple):  # given twice: psycopg hands libpq nonsense
            out[str(name)] = GIVEN_TWICE
    return out


def postgres_reach(url: str, environ: Mapping[str, str]) -> Reach:
    """Where libpq connects for ``url`` (``environ``: the process environment, whose
    ``PGHOST``, ``PGHOSTADDR`` and ``PGSERVICE`` fill what the URL leaves unset), and whether
    the URL demands a verified server (``sslmode=verify-full`` or ``verify-ca``, and
    ``sslrootcert``)."""
    try:
        params = libpq_params(url)
    except ValueError as exc:
        return _unreadable(str(exc))
    sslmode = params.get("sslmode", "")
    rootcert = params.get("sslrootcert", "")
    if rootcert == GIVEN_TWICE:  # libpq would look for a file named after the tuple
        rootcert = ""
    verified = sslmode in VERIFYING_SSLMODES and bool(rootcert)
    if sslmode in VERIFYING_SSLMODES and not rootcert:
        said = f"sslmode={sslmode} without sslrootcert"
    elif sslmode:
        said = f"sslmode={sslmode}"
    else:
        said = "no sslmode (libpq's default: prefer)"
    beyond = tuple(_postgres_beyond(params, environ))
    lacks_ca = sslmode in VERIFYING_SSLMODES and not rootcert
    return Reach(beyond=beyond, verified=verified, said=said, lacks_ca=lacks_ca)


def _postgres_beyond(params: Mapping[str, str], environ: Mapping[str, str]) -> list[str]:
    hosts = _listed(params.get("host"))
    addrs = _listed(params.get("hostaddr"))
    service = params.get("service") or environ.get("PGSERVICE")
    if service and (hosts is None or addrs is None):
        # pg_service.conf fills the host or the address the URL leaves unset: unseen here
        return [f"the host of service {service!r} (pg_service.conf)"]
    if hosts is None:
        hosts = _listed(environ.get("PGHOST")) or [""]  # "": libpq's default socket directory
    if addrs is None:
        addrs = _listed(environ.get("PGHOSTADDR")) or []
    beyond = [addr for addr in addrs if addr and not is_loopback(addr)]
    for i, host in enumerate(hosts):
        if i < len(addrs) and addrs[i]:
            continue  # dialled at hostaddr (checked above); the host names the certificate
        if host and not host.startswith("/") and not is_loopback(host):
            beyond.append(host)
    return list(dict.fromkeys(beyond))


def redis_reach(url: str) -> Reach:
    """Where redis-py connects for ``url`` and whether it demands a verified server:
    ``rediss://`` with the certificate required (redis-py's default, against the system's CAs
    or ``ssl_ca_certs``) and its host name checked (the default since redis-py 6). A
    ``unix://`` URL is a socket of this host."""
    try:
        parts = urlsplit(url)
        query = parse_qs(parts.query)
        hostname = parts.hostname
    except ValueError:
        return _unreadable("not a URL")
    scheme = parts.scheme.lower()
    if scheme == "unix":
        return Reach(beyond=(), verified=False, said="a Unix socket")
    if scheme not in ("redis", "rediss"):
        return _unreadable("not a redis://, rediss:// or unix:// URL")
    # redis-py: the authority's host, else a ?host= parameter, else localhost
    host = hostname or (query.get("host") or ["localhost"])[0]
    beyond = () if is_loopback(host) else (host,)
    cert_reqs = (query.get("ssl_cert_reqs") or ["required"])[0]
    check_hostname = (query.get("ssl_check_hostname") or ["true"])[0]
    if scheme == "redis":
        said = "redis:// (no TLS)"
    elif cert_reqs != "required":
        said = f"rediss:// with ssl_cert_reqs={cert_reqs}"
    elif check_hostname.upper() in _REDIS_FALSE:
        said = f"rediss:// with ssl_check_hostname={check_hostname}"
    else:
        return Reach(beyond=beyond, verified=True, said="rediss://")
    return Reach(beyond=beyond, verified=False, said=said)

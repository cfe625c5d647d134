"""The channel to OPA's REST API: ``http(s)://host[:port]`` or ``unix:///path/opa.sock``.

kvgov speaks to OPA through ``opa-python-client``'s ``AsyncOpaClient`` (:func:`opa_client`),
given a connector of kvgov's (:func:`connector_for`): the library builds a TCP connector of its
own and takes no other, so a small subclass hands it this one.

Why a Unix socket (review r8, F4): a TCP port on the pod's loopback is not scoped by uid.
Whenever OPA's process is gone (OOM, liveness, crash, the kubelet's back-off), any container of
the pod (vLLM's too) can bind OPA's port first, receive kvgov's token with every decision and
answer them all ``allowed``. A socket in a volume only ``opa`` and ``kvgov`` mount cannot be
taken by vLLM; and before kvgov sends anything on a new connection it checks that the socket is
OPA's (:func:`socket_path_problem`, :func:`peer_problem`):

- the socket's directory is owned by root, kvgov's uid or one of OPA's uids (an ``emptyDir``'s
  root is root's; that others may write it, sticky or not, is no refusal: another uid that
  replaced the socket is refused by the two checks below);
- the path is a socket (not a symlink or a file) owned by one of OPA's uids;
- the process listening on it runs as one of OPA's uids (the kernel's ``SO_PEERCRED``, Linux).

OPA's uids: ``policy.opa_uids``, else kvgov's own uid. A check that fails refuses the
connection (:class:`OpaUntrustedError`; a decision then denies ``opa_untrusted``) and is logged
once per session (``policy.opa_channel_refused``). These prove who serves the socket, not what:
a process of OPA's uid (kvgov itself, when they share one) is trusted.
"""

from __future__ import annotations

import os
import posixpath
import socket
import ssl
import stat
import struct
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import aiohttp

from kvgov.errors import PolicyError
from kvgov.logging import get_logger

if TYPE_CHECKING:
    from aiohttp.client_proto import ResponseHandler
    from aiohttp.client_reqrep import ClientRequest
    from aiohttp.tracing import Trace

log = get_logger(__name__)

#: the longest path a Unix socket address holds (Linux ``sun_path``, with its NUL)
_SUN_PATH_MAX = 107


#: the host a request over OPA's Unix socket names (OPA reads none): one that never resolves
UNIX_HOST = "opa.invalid"


@dataclass(frozen=True, slots=True)
class OpaEndpoint:
    host: str
    port: int
    ssl: bool
    #: ``unix://`` only: the socket's absolute path (host and port are then unused)
    socket_path: str | None = None

    @classmethod
    def parse(cls, url: str) -> OpaEndpoint:
        """``http(s)://host[:port]`` or ``unix:///absolute/path``; raises :class:`PolicyError`
        for anything else."""
        parts = urlsplit(url)
        if parts.scheme == "unix":
            path = parts.path
            if parts.netloc or parts.query or parts.fragment or not path.startswith("/"):
                raise PolicyError(
                    f"policy.opa_url must be unix:///absolute/path/opa.sock, got {url!r}"
                )
            if posixpath.normpath(path) != path or len(path.encode()) > _SUN_PATH_MAX:
                raise PolicyError(
                    f"policy.opa_url names a socket path that is not normalised or longer than"
                    f" {_SUN_PATH_MAX} bytes: {url!r}"
                )
            return cls(UNIX_HOST, 0, ssl=False, socket_path=path)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise PolicyError(
                f"policy.opa_url must be http(s)://host[:port] or unix:///path, got {url!r}"
            )
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise PolicyError(f"policy.opa_url must not carry a path or query: {url!r}")
        try:
            port = parts.port or (443 if parts.scheme == "https" else 8181)
        except ValueError as exc:
            raise PolicyError(f"policy.opa_url has an invalid port: {url!r}") from exc
        return cls(parts.hostname, port, parts.scheme == "https")


class OpaUntrustedError(aiohttp.ClientConnectionError):
    """The socket at ``policy.opa_url`` is not shown to be OPA's: nothing was sent to it."""


def allowed_uids(opa_uids: Collection[int] | None) -> frozenset[int]:
    """OPA's uids: ``policy.opa_uids``, else this process's uid (root only when named: a
    container running as root that reached the socket's folder would otherwise pass)."""
    return frozenset(opa_uids) if opa_uids is not None else frozenset({os.getuid()})


def _uids(allowed: Collection[int]) -> str:
    return ", ".join(str(u) for u in sorted(allowed))


def ownership_problem(
    path: str,
    *,
    dir_uid: int,
    dir_mode: int,
    sock_uid: int,
    sock_mode: int,
    allowed: Collection[int],
    own_uid: int,
) -> str | None:
    """Why the socket ``path`` (its directory's and its own ``lstat`` owner and mode) may not
    be OPA's, or None. Pure: the tests give it explicit uids."""
    parent = posixpath.dirname(path)
    dir_owners = {0, own_uid, *allowed}
    if not stat.S_ISDIR(dir_mode):
        return f"{parent} is not a directory"
    if dir_uid not in dir_owners:
        return (
            f"{parent} is owned by uid {dir_uid}, not by root, kvgov ({own_uid}) or OPA"
            f" ({_uids(allowed)}): its owner can put any socket there"
        )
    # a directory others may write (an emptyDir's root, sticky or not) is no refusal: only the
    # containers that mount the volume reach it, and whoever put a socket in OPA's place is
    # refused by the socket's owner here and by the listener's uid (peer_problem) after connecting
    if not stat.S_ISSOCK(sock_mode):
        return f"{path} is not a socket"
    if sock_uid not in allowed:
        return (
            f"{path} is owned by uid {sock_uid}, not by OPA ({_uids(allowed)}): another process"
            " created it"
        )
    return None


def socket_path_problem(path: str, allowed: Collection[int]) -> str | None:
    """:func:`ownership_problem` for the socket on disk now (None: it may be OPA's)."""
    try:
        dir_st = os.lstat(posixpath.dirname(path))
        sock_st = os.lstat(path)
    except FileNotFoundError:
        return None  # nothing listens: connecting fails (opa_unavailable), nothing is sent
    except OSError as exc:
        return f"{path} cannot be checked: {exc.strerror or type(exc).__name__}"
    return ownership_problem(
        path,
        dir_uid=dir_st.st_uid,
        dir_mode=dir_st.st_mode,
        sock_uid=sock_st.st_uid,
        sock_mode=sock_st.st_mode,
        allowed=allowed,
        own_uid=os.getuid(),
    )


def peer_problem(path: str, peer_uid: int | None, allowed: Collection[int]) -> str | None:
    """Why the process at the other end of a connection to ``path`` may not be OPA, or None.
    ``peer_uid`` None: the kernel could not tell (no ``SO_PEERCRED``): refused."""
    if peer_uid is None:
        return f"the process serving {path} cannot be identified (no SO_PEERCRED)"
    if peer_uid not in allowed:
        return f"the process serving {path} runs as uid {peer_uid}, not as OPA ({_uids(allowed)})"
    return None


def peer_uid(sock: socket.socket | None) -> int | None:
    """The uid of the process at the other end of a Unix socket (Linux), or None."""
    if sock is None or not hasattr(socket, "SO_PEERCRED"):
        return None
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("iII"))
    return int(struct.unpack("iII", creds)[1])  # pid, uid, gid


class CheckedUnixConnector(aiohttp.UnixConnector):
    """aiohttp's Unix connector that checks each new connection (:func:`socket_path_problem`
    before connecting, :func:`peer_problem` after, both before a byte is sent) and refuses
    one that fails with :class:`OpaUntrustedError`, logged the first time. It overrides
    aiohttp's (private) ``_create_connection``: an aiohttp that no longer calls it would skip
    the checks, so one without it is refused here (fail closed), and the tests
    (``tests/security/test_opa_channel.py``) refuse real squatters through this class."""

    def __init__(self, path: str, *, allowed: Collection[int]) -> None:
        if "_create_connection" not in vars(aiohttp.UnixConnector):
            raise PolicyError(
                f"aiohttp {aiohttp.__version__} changed its Unix connector: kvgov cannot check"
                " OPA's socket, so it does not use it"
            )
        super().__init__(path=path)
        self.allowed = frozenset(allowed)
        self._logged = False

    def _refuse(self, problem: str) -> OpaUntrustedError:
        if not self._logged:
            self._logged = True
            log.error(
                "policy.opa_channel_refused",
                extra={"problem": problem, "hint": "policy.opa_uids names OPA's uids"},
            )
        return OpaUntrustedError(problem)

    async def _create_connection(
        self,
        req: ClientRequest,
        traces: list[Trace],
        timeout: aiohttp.ClientTimeout,  # noqa: ASYNC109 - aiohttp's signature
    ) -> ResponseHandler:
        if problem := socket_path_problem(self.path, self.allowed):
            raise self._refuse(problem)
        proto = await super()._create_connection(req, traces, timeout)
        transport = proto.transport
        sock = transport.get_extra_info("socket") if transport is not None else None
        if problem := peer_problem(self.path, peer_uid(sock), self.allowed):
            proto.close()
            raise self._refuse(problem)
        return proto


def connector_for(
    endpoint: OpaEndpoint, opa_uids: Collection[int] | None = None
) -> aiohttp.BaseConnector:
    """The connector to OPA at ``endpoint`` (make it on the running loop): unix checks the
    socket (:class:`CheckedUnixConnector`); https verifies OPA's certificate with the system's
    CAs."""
    if endpoint.socket_path is not None:
        return CheckedUnixConnector(endpoint.socket_path, allowed=allowed_uids(opa_uids))
    return aiohttp.TCPConnector(ssl=ssl.create_default_context() if endpoint.ssl else False)


def opa_client(
    endpoint: OpaEndpoint,
    *,
    timeout_s: float,
    token: str | None = None,
    opa_uids: Collection[int] | None = None,
) -> Any:
    """``opa-python-client``'s ``AsyncOpaClient`` for ``endpoint`` (use it in ``async with``),
    speaking through :func:`connector_for`'s connector; no retries (a retry is a second
    timeout on the data path). The library builds a TCP connector of its own in
    ``_init_session``, which this subclass replaces: a release of the library that no longer
    has it is refused (fail closed) rather than left to build an unchecked one."""
    from opa_client import AsyncOpaClient

    if not callable(getattr(AsyncOpaClient, "_init_session", None)):
        raise PolicyError(
            "opa-python-client changed how it opens its session: kvgov cannot give it the"
            " checked connection to OPA, so it does not use it"
        )

    class _Client(AsyncOpaClient):  # type: ignore[misc] # an untyped library
        async def _init_session(self) -> None:
            self._connector = connector_for(endpoint, opa_uids)
            self._session = aiohttp.ClientSession(
                headers=self.headers,
                connector=self._connector,
                timeout=aiohttp.ClientTimeout(total=self.timeout),
            )

        async def __aenter__(self) -> Any:
            client = await super().__aenter__()
            # the session must be the one made above, whatever a later release of the
            # library does on the way (review r9): otherwise nothing is sent on it
            session = getattr(client, "_session", None)
            if endpoint.socket_path is not None and not isinstance(
                getattr(session, "connector", None), CheckedUnixConnector
            ):
                await client.close_connection()
                raise OpaUntrustedError(
                    "opa-python-client did not use the checked connection to OPA's socket"
                )
            return client

    # over a Unix socket the URL's host and port name nothing (OPA does not read them); the
    # host is one that never resolves (RFC 2606), so a session that fell back to TCP reaches
    # nobody rather than a port of this pod
    port = endpoint.port if endpoint.socket_path is None else 80
    return _Client(
        host=endpoint.host, port=port, ssl=endpoint.ssl, token=token, retries=0, timeout=timeout_s
    )

"""The kvgov wire protocol server (``docs/protocol.md``) over TCP and/or a Unix socket: the
listeners, engine authentication (HELLO) and the EVICT fan-out to the control connections of
the engines that may hold the purged tenant's data.
Each socket is served by a :class:`~kvgov.proxy.dataplane.wireconn.WireConnection`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import stat
import tempfile
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from kvgov.engine_ids import engine_id_problem
from kvgov.errors import ConfigError
from kvgov.privatefs import DIR_FLAGS, is_private
from kvgov.proxy.dataplane.identity import Identity
from kvgov.proxy.dataplane.limits import ConnectionLimits, Watchdog
from kvgov.proxy.dataplane.pipeline import Pipeline
from kvgov.proxy.dataplane.wireconn import (
    MAX_BATCH,
    MAX_PIPELINED_PUTS,
    Challenge,
    EngineEvictResult,
    ServerConfig,
    WireConnection,
)
from kvgov.wire import handshake
from kvgov.wire.codec import ErrorCode, WireError, utf8

__all__ = [
    "MAX_BATCH",
    "MAX_PIPELINED_PUTS",
    "EngineEvictResult",
    "ServerConfig",
    "WireConnection",
    "WireServer",
]

#: the longest Unix socket path Linux binds (``sun_path`` is 108 bytes with its NUL)
_SUN_PATH_MAX = 107

log = logging.getLogger("kvgov.dataplane.server")


class WireServer:
    """Owns the listeners, the set of live connections and the control connections."""

    def __init__(self, pipeline: Pipeline, config: ServerConfig, limits: ConnectionLimits) -> None:
        self.pipeline = pipeline
        self.config = config
        #: connection caps (shared with the lm:// listener by the sidecar)
        self.limits = limits
        self.watchdog = Watchdog(
            lambda: self.connections,
            Watchdog.tick_for(config.hello_timeout_s, config.frame_timeout_s),
        )
        self.connections: set[WireConnection] = set()
        self.controls: set[WireConnection] = set()
        #: told of each control connection once it is authenticated (the sidecar's owed
        #: evictions, :mod:`kvgov.proxy.purge.late`); None: nobody listens
        self.on_control: Callable[[WireConnection], None] | None = None
        self._servers: list[asyncio.Server] = []
        self.draining = False
        self.addresses: list[str] = []
        #: token id -> (token, engine id) (:func:`kvgov.wire.handshake.token_id`)
        self._token_ids = {
            handshake.token_id(token): (token, engine.get_secret_value())
            for token, engine in config.engine_tokens.items()
        }
        #: whether engine tokens were ever configured (at start, or by a reload); never
        #: cleared: an empty map then means every token was revoked, and admits nobody,
        #: never the peer-uid or anonymous admission of a sidecar run without tokens
        self.tokens_configured = bool(self._token_ids)

    def token_current(self, tid: str, engine: str) -> bool:
        held = self._token_ids.get(tid)
        return held is not None and held[1] == engine

    def control_opened(self, conn: WireConnection) -> None:
        """An authenticated control connection: EVICT goes there from now on, and whoever
        listens (:attr:`on_control`) may send what it owes that engine. Only at HELLO: the
        data path never comes here."""
        self.controls.add(conn)
        if self.on_control is not None:
            try:
                self.on_control(conn)
            except Exception:  # the listener's failure must not fail the engine's HELLO
                log.exception("dataplane.control.listener_failed")

    def replace_tokens(self, tokens: Mapping[str, SecretStr]) -> int:
        """Take ``tokens`` (``{"token": "engine-id"}``) from now on, and close every
        connection opened with a token that no longer stands for its engine (revoked, or given
        to another engine); the number closed. A HELLO half-way through its handshake is
        checked again at its end (:meth:`token_current`). An empty ``tokens`` revokes every
        token: every connection opened with one is closed and, tokens having been configured,
        every HELLO is refused until tokens are given again (:meth:`authenticate`)."""
        self._token_ids = {
            handshake.token_id(token): (token, engine.get_secret_value())
            for token, engine in tokens.items()
        }
        if self._token_ids:
            self.tokens_configured = True
        gone = [
            conn
            for conn in self.connections
            if conn.token_id is not None
            and conn.identity is not None
            and not self.token_current(conn.token_id, conn.identity.engine)
        ]
        for conn in gone:
            conn.close()
        return len(gone)

    def _factory(self, *, unix: bool) -> WireConnection:
        return WireConnection(self, unix=unix)

    async def start(self, host: str | None, port: int, unix_path: str | None = None) -> None:
        loop = asyncio.get_running_loop()
        if host:
            srv = await loop.create_server(lambda: self._factory(unix=False), host, port)
            self._servers.append(srv)
            sockname = srv.sockets[0].getsockname()
            self.addresses.append(f"tcp://{sockname[0]}:{sockname[1]}")
        if unix_path:
            try:  # a stale socket from a previous run
                os.unlink(unix_path)  # noqa: PTH108
            except FileNotFoundError:
                pass
            except OSError as exc:  # e.g. a folder the engine's container made in its place
                raise ConfigError(
                    f"dataplane.unix_path {unix_path}: something that is not a socket holds"
                    f" the path ({exc.strerror}); its folder is shared with the engine's"
                    " container, which may have put it there",
                    hint="remove it (or restart the pod: the folder is an emptyDir)",
                ) from None
            # a fresh volume (a container's emptyDir) may not hold the socket's folder yet;
            # group members (the engine's container, by fsGroup) may reach the socket in it
            Path(unix_path).parent.mkdir(parents=True, exist_ok=True, mode=0o750)
            srv = await self._bind_unix(loop, unix_path)
            self._servers.append(srv)
            self.addresses.append(f"unix://{unix_path}")
        self.watchdog.start()

    async def _bind_unix(self, loop: asyncio.AbstractEventLoop, unix_path: str) -> asyncio.Server:
        """Listen on ``unix_path``, mode 0660, without ever changing a mode through a path
        someone else can write.

        The socket's folder is shared with the engine's container (which may write it): a
        socket bound there and then ``chmod``-ed by path let the engine, in between, put a
        symlink in its place, and the ``chmod`` re-moded whatever sidecar file it pointed to
        (a journal segment made group-writable, say). So the socket is bound in a new 0700
        folder beside it, held open from its creation: the mode is set and the socket renamed
        into place relative to that descriptor (a rename replaces whatever is at the path, a
        planted symlink included, and follows nothing). Someone who renames the folder away
        and puts one of theirs in its place before the bind gets the socket bound in theirs,
        and the start fails: nothing of the sidecar's is re-moded."""
        staging = Path(tempfile.mkdtemp(prefix=".k", dir=Path(unix_path).parent))  # 0700
        try:
            dir_fd = os.open(staging, DIR_FLAGS)
        except OSError:
            with contextlib.suppress(OSError):
                os.rmdir(staging)  # noqa: PTH106
            raise
        try:
            staged = staging / "s"
            if len(os.fsencode(staged)) > _SUN_PATH_MAX:
                raise ConfigError(
                    f"dataplane.unix_path {unix_path} is too long to bind safely"
                    f" ({len(os.fsencode(unix_path))} bytes; at most"
                    f" {_SUN_PATH_MAX - len(os.fsencode(staged)) + len(os.fsencode(unix_path))})",
                    hint="use a shorter path, e.g. /run/kvgov/data.sock",
                )
            if not is_private(os.fstat(dir_fd), stat.S_ISDIR):
                raise ConfigError(f"the socket's staging folder {staging} is not the sidecar's own")
            srv = await loop.create_unix_server(lambda: self._factory(unix=True), str(staged))
            try:
                st = os.stat("s", dir_fd=dir_fd, follow_symlinks=False)
                if not stat.S_ISSOCK(st.st_mode):
                    raise ConfigError(f"no socket bound in {staging}: something replaced it")
                # in a folder only this process can write: "s" is the socket just bound
                os.chmod("s", 0o660, dir_fd=dir_fd)
                os.replace("s", unix_path, src_dir_fd=dir_fd)
            except FileNotFoundError:
                srv.close()
                raise ConfigError(
                    f"the Unix socket's staging folder {staging} was replaced while binding"
                    f" (whoever can write {Path(unix_path).parent} did it)"
                ) from None
            except BaseException:
                srv.close()
                raise
            return srv
        finally:
            with contextlib.suppress(OSError):
                os.unlink("s", dir_fd=dir_fd)  # gone already when renamed into place
            os.close(dir_fd)
            with contextlib.suppress(OSError):
                os.rmdir(staging)  # noqa: PTH106 - only ever an empty folder

    @property
    def tcp_port(self) -> int | None:
        for srv in self._servers:
            sock = srv.sockets[0]
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                port: int = sock.getsockname()[1]
                return port
        return None

    async def stop_accepting(self) -> None:
        self.draining = True
        for srv in self._servers:
            srv.close()

    async def drain(self, grace_s: float = 30.0) -> None:
        """Wait until no connection is in the middle of a request, then close them all."""
        deadline = time.monotonic() + grace_s
        while any(c.busy for c in self.connections) and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        for conn in list(self.connections):
            conn.close()
        await self.watchdog.stop()
        for srv in self._servers:
            await srv.wait_closed()

    async def evict_on_engines(
        self,
        digests: Sequence[str],
        timeout_s: float,
        *,
        tenant: str,
        holders: Collection[str] = (),
    ) -> list[EngineEvictResult]:
        """Send EVICT(digests) on the control connections of the engines that may hold
        ``tenant``'s data, and wait for the ACKs: each removes the entries whose key digests
        are named (the ledger's ``key_digest``s). Those engines are the ones the policy admits
        for the tenant and ``holders`` (engine ids the ledger saw store or read its data,
        e.g. before the tenant was disabled); no other engine learns the digests."""
        verdicts: dict[str, bool] = {}
        controls = []
        for conn in list(self.controls):
            engine = conn.identity.engine if conn.identity is not None else None
            if engine is None:
                continue
            if engine not in verdicts:
                verdicts[engine] = engine in holders or await self.pipeline.may_act_for(
                    engine, tenant
                )
            if verdicts[engine]:
                controls.append(conn)
        results = await asyncio.gather(*(c.evict(digests, timeout_s) for c in controls))
        return list(results)

    def authenticate(self, meta: Mapping[str, Any], conn: WireConnection) -> Identity | Challenge:
        """Who a HELLO is from: with engine tokens configured, the :class:`Challenge` its
        token id calls for (the engine is admitted once it answers it,
        :mod:`kvgov.wire.handshake`), or a refusal once every token was revoked; else (never
        configured) the engine it names, on a Unix socket from the sidecar's own uid or root,
        or anywhere in development."""
        engine = meta.get("engine")
        # the id a peer names becomes its identity where no tokens are configured: one a
        # receipt would show as another engine (``lm:...``, blanks, control characters) or the
        # ledger cannot record (a lone surrogate) is refused (:mod:`kvgov.engine_ids`)
        problem = engine_id_problem(engine)
        if problem is not None or not isinstance(engine, str):
            raise WireError(
                ErrorCode.UNAUTHENTICATED,
                f"HELLO needs a valid engine id: the id {problem}",
                hint="docs/protocol.md, Authentication",
            )
        if "token" in meta:
            # the token itself never crosses the wire (an impostor on the port would have it)
            raise WireError(
                ErrorCode.UNAUTHENTICATED,
                "a HELLO never carries the token: it names it (token_id) and proves it",
                hint="docs/protocol.md, Authentication",
            )
        if self.tokens_configured:
            if not self._token_ids:
                # every token was revoked (an emptied token file): nobody is admitted, least
                # of all by the fall-backs below, meant for a sidecar never given a token
                raise WireError(
                    ErrorCode.UNAUTHENTICATED,
                    "engine tokens revoked",
                    hint="docs/deploy.md, Rotating keys and tokens",
                )
            tid, nonce, role = meta.get("token_id"), meta.get("nonce"), meta.get("role", "")
            if not isinstance(tid, str) or not handshake.is_nonce(nonce):
                raise WireError(ErrorCode.UNAUTHENTICATED, "engine token required")
            if not isinstance(role, str) or len(role) > 32 or utf8(role) is None:
                raise WireError(ErrorCode.BAD_REQUEST, "role must be a short string")
            # the id is a hash of the token, not a secret: a lookup by it leaks nothing
            held = self._token_ids.get(tid)
            if held is None:
                raise WireError(ErrorCode.UNAUTHENTICATED, "engine token refused")
            token, engine_id = held
            return Challenge(
                meta,
                engine_id,
                token,
                claimed=engine,
                role=role,
                tid=tid,
                client_nonce=str(nonce),
            )
        if conn.unix and conn.peer_uid in (os.getuid(), 0):
            return Identity(engine, f"engine:{engine}")
        if self.config.allow_anonymous:
            return Identity(engine, f"engine:{engine}")
        raise WireError(ErrorCode.UNAUTHENTICATED, "no engine tokens configured")

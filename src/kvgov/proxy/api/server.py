"""How the REST API is served: uvicorn with limits from ``api.*`` settings
(``docs/operations.md``, "Limits").

uvicorn bounds concurrency (``limit_concurrency``: 503 beyond it), idle keep-alive connections
and the size of a request head (h11's incomplete-event limit), but not the time a client may
take to send a request, nor the time it may leave a response unread. :func:`api_protocol` adds
both deadlines and two caps:

- a request must arrive whole within ``api.request_timeout_s`` of its first byte (or of the
  connection, for the first request); otherwise the connection is closed;
- a response (or what is left of one when the connection closes) whose peer takes none of its
  bytes for ``api.response_timeout_s`` is dropped: the connection is reset, which also ends the
  request's task waiting for the peer and frees its ``limit_concurrency`` slot. Before, a peer
  that pipelined requests and read nothing held both for ever (review 2, finding 3). The
  deadline runs from the last byte the peer took, so a slow client that reads keeps its
  response;
- one peer address holds at most ``api.max_connections_per_peer`` connections;
- ``GET /healthz`` and ``/readyz`` are not counted by ``limit_concurrency``: a full API does
  not fail the kubelet's probes (and restart the sidecar, or take the pod out of service).

Bodies larger than ``api.max_body_bytes`` are refused (413) before they are read, and heads
larger than ``api.max_header_bytes`` (431; h11 alone only bounds a head that arrives in
pieces), by :class:`BodyLimit`.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import TYPE_CHECKING

from kvgov.proxy.dataplane.limits import SummaryLog

if TYPE_CHECKING:
    import ssl

    import uvicorn
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

    from kvgov.config import ApiSettings

log = logging.getLogger("kvgov.api.server")


#: the probes (a constant and a flag: no token, no database) that ``limit_concurrency`` does not
#: count
PROBES = frozenset({"/healthz", "/readyz"})


def api_protocol(
    request_timeout_s: float,
    summary: SummaryLog | None = None,
    *,
    response_timeout_s: float = 30.0,
    max_connections_per_peer: int = 0,
    tls: ssl.SSLContext | None = None,
) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol with a deadline on receiving each request and on the peer's
    reading of each response, a cap on connections per peer address (0: none), and the probes
    outside ``limit_concurrency``. One class per server: the per-peer counts are its own.

    With ``tls`` the protocol serves TLS itself (uvicorn is given no context): it is handed
    the plain connection at once, counts it against its peer's cap there, and then upgrades
    it (``loop.start_tls``), the handshake bounded by ``request_timeout_s``. Given a context,
    asyncio would call the protocol only once the handshake is done, so a connection still
    in its handshake was counted by no cap and held for asyncio's 60 s."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    note = summary if summary is not None else SummaryLog(log)
    peers: Counter[str] = Counter()
    #: how often a stalled response is looked at: it is dropped between ``response_timeout_s``
    #: and a quarter more after the peer last took a byte
    step = response_timeout_s / 4

    class DeadlineH11Protocol(H11Protocol):
        _request_timer: asyncio.TimerHandle | None = None
        _send_timer: asyncio.TimerHandle | None = None
        #: bytes the transport held at the last look, and when the peer last took some
        _unsent = 0
        _last_taken = 0.0
        _peer: str | None = None
        _limit: int | None = None
        #: the TLS handshake in progress (kept: the loop holds tasks weakly)
        _handshake: asyncio.Task[None] | None = None

        @property
        def limit_concurrency(self) -> int | None:
            """uvicorn reads this for each request, once its ``scope`` is set: the probes are
            answered however full the server is (each takes no token, database or I/O)."""
            scope = getattr(self, "scope", None)
            if scope is not None and scope["path"] in PROBES and scope["method"] == "GET":
                return None
            return self._limit

        @limit_concurrency.setter
        def limit_concurrency(self, value: int | None) -> None:
            self._limit = value

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            if max_connections_per_peer and (peer := _peer_host(transport)) is not None:
                if peers[peer] >= max_connections_per_peer:
                    note.note("api.connection.refused", cap="peer")
                    transport.abort()
                    return
                peers[peer] += 1
                self._peer = peer
            if tls is None:
                self._serve(transport)
                return
            # nothing is read until the handshake starts: start_tls resumes reading
            transport.pause_reading()
            self._handshake = self.loop.create_task(self._start_tls(transport, tls))

        async def _start_tls(self, raw: asyncio.Transport, context: ssl.SSLContext) -> None:
            # what arrives between the handshake's end and this task's turn (a TLS 1.3 client
            # sends its request at once) waits in ``early``, then goes to this protocol
            early = _Handshaking()
            try:
                secure = await self.loop.start_tls(
                    raw,
                    early,
                    context,
                    server_side=True,
                    ssl_handshake_timeout=request_timeout_s,
                )
            except Exception:  # noqa: BLE001 - a failed or stalled handshake: drop it
                note.note("api.tls.handshake_failed")
                raw.abort()
                self._forget_peer()  # asyncio tells a protocol of no loss before its handshake
                return
            if secure is None or early.lost:  # the connection went meanwhile
                self._forget_peer()
                return
            secure.set_protocol(self)
            self._serve(secure)
            for data in early.data:
                self.data_received(data)
            if early.eof:
                self.eof_received()  # uvicorn's: returns nothing, so the transport closes
                secure.close()

        def _serve(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            # pause_writing() as soon as the transport holds a byte the socket did not take
            # (and resume_writing() once it holds none): so a stall is seen at any size, also
            # after close(), which waits for the buffer to empty before the connection goes.
            # A TLS transport pauses at its high-water mark, a plain one above it: 0 would
            # pause a TLS connection before its first byte, for ever. (TLS pauses once the
            # socket's own transport under it holds its high-water mark, 64 KiB)
            secure = transport.get_extra_info("sslcontext") is not None
            transport.set_write_buffer_limits(high=1 if secure else 0, low=0)
            self._arm()

        def _forget_peer(self) -> None:
            if self._peer is not None:
                peers[self._peer] -= 1
                if peers[self._peer] <= 0:
                    del peers[self._peer]
                self._peer = None

        def data_received(self, data: bytes) -> None:
            if self._request_timer is None and self.conn.their_state is not h11.DONE:
                self._arm()
            super().data_received(data)
            if self.conn.their_state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.ERROR):
                self._disarm()  # the request is whole: the application has it now

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            self._stop_send_timer()
            self._forget_peer()
            super().connection_lost(exc)  # resumes writing: a task waiting in drain() ends

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._send_timer is None:
                self._unsent = self.transport.get_write_buffer_size()
                self._last_taken = self.loop.time()
                self._send_timer = self.loop.call_later(step, self._send_stalled)

        def resume_writing(self) -> None:
            self._stop_send_timer()
            super().resume_writing()

        def _send_stalled(self) -> None:
            self._send_timer = None
            unsent = self.transport.get_write_buffer_size()
            if not unsent:
                return
            now = self.loop.time()
            if unsent < self._unsent:
                self._last_taken = now  # the peer read some: the deadline starts again
            self._unsent = unsent
            if now - self._last_taken < response_timeout_s:
                self._send_timer = self.loop.call_later(step, self._send_stalled)
                return
            note.note("api.response.timed_out")
            self.transport.abort()  # not close(): that would wait for the peer to read

        def _stop_send_timer(self) -> None:
            if self._send_timer is not None:
                self._send_timer.cancel()
                self._send_timer = None

        def _arm(self) -> None:
            self._disarm()
            self._request_timer = self.loop.call_later(request_timeout_s, self._timed_out)

        def _disarm(self) -> None:
            if self._request_timer is not None:
                self._request_timer.cancel()
                self._request_timer = None

        def _timed_out(self) -> None:
            self._request_timer = None
            if self.conn.their_state is h11.DONE or self.transport.is_closing():
                return
            note.note("api.request.timed_out")
            self.transport.close()

    return DeadlineH11Protocol


class _Handshaking(asyncio.Protocol):
    """A TLS connection's protocol from its handshake's end until the API's takes it over:
    holds what arrives meanwhile."""

    def __init__(self) -> None:
        self.data: list[bytes] = []
        self.eof = False
        self.lost = False

    def data_received(self, data: bytes) -> None:
        self.data.append(data)

    def eof_received(self) -> bool:
        self.eof = True
        return True  # keep the transport open: the API's protocol decides

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True


def _peer_host(transport: asyncio.BaseTransport) -> str | None:
    """The peer's address (a TCP peer's host), or None where there is none to count by."""
    peer = transport.get_extra_info("peername")
    if isinstance(peer, tuple) and peer and isinstance(peer[0], str):
        return peer[0]
    return None


class BodyLimit:
    """ASGI middleware: a request whose ``Content-Length`` exceeds ``max_bytes`` is answered
    413 unread; a chunked body is cut off (413) once it exceeds it; headers of more than
    ``max_header_bytes`` in all are answered 431."""

    def __init__(self, app: ASGIApp, max_bytes: int, max_header_bytes: int = 16 * 1024) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_header_bytes = max_header_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope.get("headers", ())
        if sum(len(n) + len(v) + 4 for n, v in headers) > self.max_header_bytes:
            await _refuse(send, 431, "request header fields too large")
            return
        for name, value in headers:
            if name == b"content-length":
                try:
                    too_large = int(value) > self.max_bytes
                except ValueError:
                    too_large = True
                if too_large:
                    await _refuse(send)
                    return
        seen = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message.get("type") == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message.get("type") == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _TooLarge:
            if not started:
                await _refuse(send)


class _TooLarge(Exception):  # noqa: N818 - a signal inside BodyLimit
    pass


async def _refuse(send: Send, status: int = 413, title: str = "request body too large") -> None:
    body = ('{"title":"%s","status":%d}' % (title, status)).encode()  # noqa: UP031
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/problem+json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def api_config(app: ASGIApp, api: ApiSettings, tls: ssl.SSLContext | None = None) -> uvicorn.Config:
    """The uvicorn configuration of the REST API, its limits set from ``api``; over TLS when
    ``api.tls_cert_file``/``tls_key_file`` are set (``tls``: their context, built already by
    :func:`kvgov.proxy.api.tls.api_tls_context`; else built here), served by the protocol
    itself (:func:`api_protocol`). Raises :class:`~kvgov.errors.ConfigError` when those
    files do not make a TLS identity."""
    import uvicorn

    from kvgov.proxy.api.tls import api_tls_context

    if tls is None:
        tls = api_tls_context(api)
    return uvicorn.Config(
        BodyLimit(app, api.max_body_bytes, api.max_header_bytes),
        host=api.host,
        port=api.port,
        log_config=None,
        # no access log: its lines carry paths, and /v1/users/{user}/... names a raw user id
        # (admin requests are recorded in the ledger instead, by route template)
        access_log=False,
        lifespan="off",
        # no WebSocket routes: an upgrade would hand the connection to another protocol,
        # away from the deadlines and the per-peer count of this one
        ws="none",
        http=api_protocol(
            api.request_timeout_s,
            response_timeout_s=api.response_timeout_s,
            max_connections_per_peer=api.max_connections_per_peer,
            tls=tls,
        ),
        limit_concurrency=api.limit_concurrency,
        timeout_keep_alive=int(max(1, api.timeout_keep_alive_s)),
        h11_max_incomplete_event_size=api.max_header_bytes,
        backlog=api.backlog,
        # X-Forwarded-Proto/-For only from the proxies named (the dashboard's scheme)
        proxy_headers=True,
        forwarded_allow_ips=list(api.forwarded_allow_ips),
    )

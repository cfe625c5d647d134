"""How the REST API is served: uvicorn with limits from ``api.*`` settings
(``docs/operations.md``, "Limits").

uvicorn bounds concurrency (``limit_concurrency``: 503 beyond it), idle keep-alive connections
and the size of a request head (h11's incomplete-event limit), but not the time a client may
take to send a request: a connection that trickles (or never finishes) its head or body would
stay open for ever. :func:`api_protocol` adds that deadline: a request must arrive whole within
``api.request_timeout_s`` of its first byte (or of the connection, for the first request);
otherwise the connection is closed. Bodies larger than ``api.max_body_bytes`` are refused
(413) before they are read, and heads larger than ``api.max_header_bytes`` (431; h11 alone
only bounds a head that arrives in pieces), by :class:`BodyLimit`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from kvgov.proxy.dataplane.limits import SummaryLog

if TYPE_CHECKING:
    import uvicorn
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

    from kvgov.config import ApiSettings

log = logging.getLogger("kvgov.api.server")


def api_protocol(
    request_timeout_s: float, summary: SummaryLog | None = None
) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol with a deadline on receiving each request."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    note = summary if summary is not None else SummaryLog(log)

    class DeadlineH11Protocol(H11Protocol):
        _request_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._request_timer is None and self.conn.their_state is not h11.DONE:
                self._arm()
            super().data_received(data)
            if self.conn.their_state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.ERROR):
                self._disarm()  # the request is whole: the application has it now

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

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


def api_config(app: ASGIApp, api: ApiSettings) -> uvicorn.Config:
    """The uvicorn configuration of the REST API, its limits set from ``api``."""
    import uvicorn

    return uvicorn.Config(
        BodyLimit(app, api.max_body_bytes, api.max_header_bytes),
        host=api.host,
        port=api.port,
        log_config=None,
        # no access log: its lines carry paths, and /v1/users/{user}/... names a raw user id
        # (admin requests are recorded in the ledger instead, by route template)
        access_log=False,
        lifespan="off",
        http=api_protocol(api.request_timeout_s),
        limit_concurrency=api.limit_concurrency,
        timeout_keep_alive=int(max(1, api.timeout_keep_alive_s)),
        h11_max_incomplete_event_size=api.max_header_bytes,
        backlog=api.backlog,
        # X-Forwarded-Proto/-For only from the proxies named (the dashboard's scheme)
        proxy_headers=True,
        forwarded_allow_ips=list(api.forwarded_allow_ips),
    )

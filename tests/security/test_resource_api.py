"""The REST API's server limits: a request must arrive whole within ``api.request_timeout_s``;
bodies beyond ``api.max_body_bytes`` are refused unread; heads beyond ``api.max_header_bytes``
are refused; concurrency and keep-alive are bounded (``kvgov.proxy.api.server``).

Attack (issue 14, "what got through" 5): the API port kept hundreds of partial requests open.
"""

from __future__ import annotations

import asyncio
import select
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from kvgov.config import ApiSettings
from kvgov.proxy.api.app import create_control_app
from kvgov.proxy.app import _control_server_class
from tests.security import doors
from tests.security.doors import run

pytestmark = pytest.mark.postgres

PARTIALS = 300


@asynccontextmanager
async def api_server(sc: object, **limits: object) -> AsyncIterator[int]:
    from kvgov.proxy.api.server import api_config

    api = ApiSettings(host="127.0.0.1", port=0, **limits)  # type: ignore[arg-type]
    server = _control_server_class()(api_config(create_control_app(sc.control_plane()), api))  # type: ignore[arg-type]
    task = asyncio.get_running_loop().create_task(server.serve())
    while not server.started:  # noqa: ASYNC110 - uvicorn exposes a flag, no event
        await asyncio.sleep(0.01)
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        await task


def _status(port: int, request: bytes) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(request)
        line = s.makefile("rb").readline()
    return int(line.split()[1])


def _closed_count(socks: list[socket.socket], wait_s: float) -> int:
    import time

    closed = 0
    pending = list(socks)
    deadline = time.monotonic() + wait_s
    while pending and (left := deadline - time.monotonic()) > 0:
        readable, _, _ = select.select(pending, [], [], left)
        for s in readable:
            try:
                data = s.recv(4096)
            except OSError:
                data = b""
            if not data:
                closed += 1
                pending.remove(s)
    return closed


async def test_partial_requests_are_closed_and_the_api_still_answers(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    async with (
        doors.sidecar(tmp_path, prod_db) as sc,
        api_server(sc, request_timeout_s=1.0) as port,
    ):
        socks: list[socket.socket] = []

        def open_partials() -> None:
            for i in range(PARTIALS):
                s = socket.create_connection(("127.0.0.1", port), timeout=10)
                s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n" if i % 2 else b"")
                socks.append(s)

        try:
            await run(open_partials)
            # the API answers meanwhile
            assert await run(_status, port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n") == 200
            # and every partial request is closed by its deadline
            assert await run(_closed_count, socks, 6.0) == PARTIALS
        finally:
            for s in socks:
                s.close()


async def test_oversize_bodies_and_heads_are_refused(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    async with (
        doors.sidecar(tmp_path, prod_db) as sc,
        api_server(sc, max_body_bytes=4096, max_header_bytes=4096) as port,
    ):
        big = b"POST /v1/purges HTTP/1.1\r\nHost: x\r\nContent-Length: 10000000\r\n\r\n"
        assert await run(_status, port, big) == 413
        head = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 8000 + b"\r\n\r\n"
        assert await run(_status, port, head) in (400, 431)

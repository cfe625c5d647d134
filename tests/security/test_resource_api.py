"""The REST API's server limits: a request must arrive whole within ``api.request_timeout_s``;
bodies beyond ``api.max_body_bytes`` are refused unread; heads beyond ``api.max_header_bytes``
are refused; concurrency and keep-alive are bounded; a response its peer takes nothing of for
``api.response_timeout_s`` is dropped; one peer holds at most ``api.max_connections_per_peer``
connections; the probes answer however full the API is (``kvgov.proxy.api.server``).

Attacks: the API port kept hundreds of partial requests open (issue 14, "what got through"
5); a peer with no token that pipelined requests and read none of the answers held its
connections and their ``limit_concurrency`` slots for ever, so a few of them had every request
answered 503, the kubelet's liveness probe too, and the sidecar restarted (review 2, finding 3).
"""

from __future__ import annotations

import asyncio
import dataclasses
import select
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from kvgov.config import ApiSettings
from kvgov.proxy.api.app import ControlPlane, create_control_app
from kvgov.proxy.app import Sidecar, _control_server_class
from tests.security import doors
from tests.security.doors import run

if TYPE_CHECKING:
    import uvicorn
    from uvicorn.protocols.http.h11_impl import H11Protocol

pytestmark = pytest.mark.postgres

PARTIALS = 300


@asynccontextmanager
async def serving(
    sc: Sidecar, plane: ControlPlane | None = None, **limits: object
) -> AsyncIterator[uvicorn.Server]:
    """The sidecar's REST API served as ``kvgov serve`` serves it (``api_config``), ``limits``
    its ``api.*`` settings."""
    from kvgov.proxy.api.server import api_config

    api = ApiSettings(host="127.0.0.1", port=0, **limits)  # type: ignore[arg-type]
    app = create_control_app(plane or sc.control_plane())
    server = _control_server_class()(api_config(app, api))
    task = asyncio.get_running_loop().create_task(server.serve())
    while not server.started:  # noqa: ASYNC110 - uvicorn exposes a flag, no event
        await asyncio.sleep(0.01)
    try:
        yield server
    finally:
        server.should_exit = True
        await task


def _port(server: uvicorn.Server) -> int:
    return int(server.servers[0].sockets[0].getsockname()[1])


@asynccontextmanager
async def api_server(sc: Sidecar, **limits: object) -> AsyncIterator[int]:
    async with serving(sc, **limits) as server:
        yield _port(server)


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
        # one peer, many connections: the per-peer cap (tested below) off, so that each
        # partial request is left to its deadline
        api_server(sc, request_timeout_s=1.0, max_connections_per_peer=0) as port,
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


# -- responses nobody reads (review 2, finding 3) ---------------------------------------------

LIMIT = 8
#: the send deadline of these tests: a response whose peer reads none of it for this long
#: is dropped
STALL_S = 1.0
TIGHT = {
    "limit_concurrency": LIMIT,
    "request_timeout_s": 1.0,
    "timeout_keep_alive_s": 1.0,
    "response_timeout_s": STALL_S,
}
#: no token: the ~2.5 KB sign-in page with a 401, the same for anyone
DASHBOARD = b"GET /dashboard HTTP/1.1\r\nHost: x\r\n\r\n"
HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
READYZ = b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n"


def _connect(port: int, source: str = "127.0.0.1", rcvbuf: int = 0) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.bind((source, 0))
    s.settimeout(10)
    s.connect(("127.0.0.1", port))
    return s


async def _non_readers(
    server: uvicorn.Server, port: int, count: int, batch: int
) -> list[socket.socket]:
    """``count`` connections that pipeline requests, ``batch`` at a time, and read no answer,
    each until the server holds answers it could not hand to the socket. To keep the test
    short both ends get small buffers (the server's are squeezed before it answers), as in
    ``test_unread_replies.py``: the same stall, reached after a few answers instead of after
    megabytes of them."""

    def connect() -> list[socket.socket]:
        return [_connect(port, "127.0.0.1", 4096) for _ in range(count)]

    conns = server.server_state.connections

    def server_side(sock: socket.socket) -> H11Protocol | None:
        return next((c for c in conns if c.client == sock.getsockname()), None)

    socks = await run(connect)
    try:
        assert await _eventually(lambda: all(server_side(s) for s in socks), 2.0)
        for s in socks:
            conn = server_side(s)
            assert conn is not None
            conn.transport.get_extra_info("socket").setsockopt(
                socket.SOL_SOCKET, socket.SO_SNDBUF, 4096
            )
        # one after the other, each once its predecessor is stuck (several busy at once would
        # need several slots each)
        for s in socks:
            for _ in range(200):
                answered = server.server_state.total_requests + batch
                await run(s.sendall, DASHBOARD * batch)
                await _eventually(
                    lambda s=s, n=answered: (
                        _stuck(server_side(s)) or server.server_state.total_requests >= n
                    ),
                    2.0,
                    0.005,
                )
                if _stuck(server_side(s)):
                    break
            else:
                raise AssertionError("the server took every answer: no stall")
    except BaseException:
        for s in socks:
            s.close()
        raise
    return socks


def _stuck(conn: H11Protocol | None) -> bool:
    """Whether the server holds bytes of answers this connection's peer has not taken."""
    return conn is not None and conn.transport.get_write_buffer_size() > 0


def _status_or_error(port: int, request: bytes, source: str = "127.0.0.1") -> int | str:
    try:
        with _connect(port, source) as s:
            s.settimeout(5)
            s.sendall(request)
            line = s.makefile("rb").readline()
        return int(line.split()[1])
    except (OSError, IndexError) as exc:
        return type(exc).__name__


async def _eventually(check: Callable[[], bool], seconds: float, every: float = 0.05) -> bool:
    end = time.monotonic() + seconds
    while not check():
        if time.monotonic() > end:
            return False
        await asyncio.sleep(every)
    return True


@pytest.mark.parametrize(
    "batch",
    [
        # many answers at once: over the transport's high-water mark, so (before the fix)
        # uvicorn's task waited in drain() for ever
        pytest.param(200, id="waiting-to-write"),
        # a few at a time: under it, so (before the fix) the answers were all written, the
        # keep-alive deadline closed the connection, and close() waited for ever for the peer
        # to take the bytes left (no task, but the connection and its slot held all the same)
        pytest.param(10, id="closing"),
    ],
)
async def test_responses_nobody_reads_are_dropped_and_their_slots_freed(
    tmp_path: Path, prod_db: doors.ProdDatabase, batch: int
) -> None:
    """Finding 3: a peer with no token pipelines requests and never reads the answers. Each
    such connection stayed open for ever, holding a ``limit_concurrency`` slot (and uvicorn's
    task waiting for the peer): with a few of them every later request, the probes' too, was
    a 503 for as long as the peer kept its sockets. Now a response its peer takes none of for
    ``api.response_timeout_s`` is dropped (the connection reset), and the slots come back."""
    drop_s = 5.0  # long enough for the attack to take hold first, which the test checks
    limits = {
        **TIGHT,
        "response_timeout_s": drop_s,
        # no request deadline in the way of the idle connections below, and keep-alive
        # closes (the "closing" case) within the deadline but not while batches go out
        "request_timeout_s": 30.0,
        "timeout_keep_alive_s": 2.0,
    }
    # half the slots held by answers nobody reads (half: while a connection is answered, a
    # pipelined request's task starts before the last one's ends, so with fewer free slots
    # the attacker would get 503s and closes of its own), all but one of the rest by idle
    # connections (anyone's): one more connection and the API is full
    attackers = LIMIT // 2
    idle = LIMIT - 1 - attackers
    async with doors.sidecar(tmp_path, prod_db) as sc, serving(sc, **limits) as server:
        port = _port(server)
        state = server.server_state
        assert await run(_status_or_error, port, DASHBOARD) == 401
        began = time.monotonic()
        socks = await _non_readers(server, port, attackers, batch)
        try:
            socks += [await run(_connect, port) for _ in range(idle)]
            # the attack takes hold: each of its connections holds answers its peer does not
            # take, and the API is full
            assert await _eventually(
                lambda: (
                    len(state.connections) == LIMIT - 1
                    and sum(map(_stuck, state.connections)) == attackers
                ),
                2.0,
            ), (
                f"after {time.monotonic() - began:.1f} s: "
                f"{[c.transport.get_write_buffer_size() for c in state.connections]}"
            )
            assert await run(_status_or_error, port, DASHBOARD) == 503
            # within the deadline (and a look's slack) the unread answers are dropped, their
            # tasks end and their connections go; others are answered again
            assert await _eventually(
                lambda: not state.tasks and len(state.connections) == idle, drop_s + 2.0
            ), f"{len(state.tasks)} tasks and {len(state.connections)} connections still held"
            assert await run(_status_or_error, port, DASHBOARD) == 401
            # and the peer finds them reset (once it reads the little queued)
            closed = [await run(doors.closed_within, s, 1.0) for s in socks[:attackers]]
            assert all(closed), f"{closed.count(False)} of {attackers} left open"
        finally:
            for s in socks:
                s.close()


async def test_probes_answer_while_the_api_is_full(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    """Finding 3's consequence: ``limit_concurrency`` counted the kubelet's ``/healthz`` like
    any request, so whoever filled the API (with connections nobody reads, or just many of
    them) failed the liveness probe and had the sidecar restarted. ``/healthz`` and
    ``/readyz`` (a constant and a flag: no database, no token) are not counted."""
    async with (
        doors.sidecar(tmp_path, prod_db) as sc,
        api_server(sc, limit_concurrency=LIMIT, request_timeout_s=30.0) as port,
    ):
        socks = [await run(_connect, port) for _ in range(LIMIT)]  # idle: they say nothing
        try:
            assert await run(_status_or_error, port, DASHBOARD) == 503  # full
            assert await run(_status_or_error, port, HEALTHZ) == 200
            assert await run(_status_or_error, port, READYZ) == 200
            assert (
                await run(_status_or_error, port, b"GET /healthzz HTTP/1.1\r\nHost: x\r\n\r\n")
                == 503
            )
        finally:
            for s in socks:
                s.close()


def _read_slowly(sock: socket.socket, piece: int, pause_s: float) -> tuple[bytes, float]:
    """Read the whole of one response (``Content-Length``), ``piece`` bytes at a time with a
    pause after each: a slow peer, but one that reads."""
    start = time.monotonic()
    data = bytearray()
    length = -1
    while length < 0 or len(data) < length:
        chunk = sock.recv(piece)
        if not chunk:
            raise ConnectionError(f"closed after {len(data)} bytes")
        data += chunk
        head, sep, _ = bytes(data).partition(b"\r\n\r\n")
        if length < 0 and sep:
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = len(head) + 4 + int(value)
        time.sleep(pause_s)
    return bytes(data), time.monotonic() - start


async def test_a_slow_reader_gets_its_whole_response(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    """The control: the deadline is on a stall, not on the response. A client that reads a
    large response slowly, but steadily, gets all of it though the whole takes many times
    ``response_timeout_s`` and the server waits on it nearly all along."""
    async with doors.sidecar(tmp_path, prod_db) as sc:
        api = sc.settings.api.model_copy(update={"docs": True})  # /openapi.json: a large body
        plane = dataclasses.replace(
            sc.control_plane(), settings=sc.settings.model_copy(update={"api": api})
        )
        async with serving(sc, plane, **TIGHT) as server:
            port = _port(server)
            sock = await run(_connect, port, "127.0.0.1", 4096)
            try:
                mine = sock.getsockname()
                assert await _eventually(
                    lambda: any(c.client == mine for c in server.server_state.connections), 2.0
                )
                (conn,) = [c for c in server.server_state.connections if c.client == mine]
                # the server's side: a small send buffer, so it waits on this reader throughout
                conn.transport.get_extra_info("socket").setsockopt(
                    socket.SOL_SOCKET, socket.SO_SNDBUF, 4096
                )
                sock.sendall(b"GET /openapi.json HTTP/1.1\r\nHost: x\r\n\r\n")
                data, took = await run(_read_slowly, sock, 1024, 0.05)
            finally:
                sock.close()
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    assert body.startswith(b"{") and body.endswith(b"}"), "cut short"
    assert took > 3 * STALL_S, f"{len(body)} bytes in {took:.1f} s: too fast to prove anything"


async def test_connections_per_peer_are_capped(tmp_path: Path, prod_db: doors.ProdDatabase) -> None:
    """One peer address holds at most ``api.max_connections_per_peer`` connections (a further
    one is reset at once), so a single peer cannot take every ``limit_concurrency`` slot."""
    async with (
        doors.sidecar(tmp_path, prod_db) as sc,
        serving(sc, max_connections_per_peer=3) as server,
    ):
        port = _port(server)
        state = server.server_state
        socks = [await run(_connect, port, "127.0.0.2") for _ in range(3)]
        try:
            assert await _eventually(lambda: len(state.connections) == 3, 2.0)
            extra = await run(_connect, port, "127.0.0.2")
            socks.append(extra)
            assert await run(doors.closed_within, extra, 2.0), "a 4th connection of one peer"
            # another peer is not affected
            assert await run(_status_or_error, port, HEALTHZ, "127.0.0.1") == 200
            # and the peer gets its share back once it closes one
            socks.pop(0).close()
            assert await _eventually(lambda: len(state.connections) == 2, 2.0)
            assert await run(_status_or_error, port, HEALTHZ, "127.0.0.2") == 200
        finally:
            for s in socks:
                s.close()


def _tls_status(port: int, ca: Path, source: str = "127.0.0.1") -> int | str:
    import ssl

    ctx = ssl.create_default_context(cafile=str(ca))
    try:
        with _connect(port, source) as raw, ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
            s.settimeout(5)
            s.sendall(HEALTHZ)
            line = s.makefile("rb").readline()
        return int(line.split()[1])
    except (OSError, IndexError) as exc:
        return type(exc).__name__


async def test_tls_handshakes_are_capped_per_peer_and_timed_out(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    """Over TLS (``api.tls_*``) a connection counts against its peer's cap from its first
    byte, not from the end of its handshake, and a handshake must end within
    ``api.request_timeout_s``.

    Attack: asyncio hands a TLS connection to the API's protocol only once its handshake is
    done, so a peer that opened connections and never sent a ClientHello was counted by no
    cap and held each connection (and its descriptor, shared with the data plane) for
    asyncio's 60 s handshake timeout, however many it opened."""
    tls = doors.tls_identity(tmp_path / "tls")
    async with (
        doors.sidecar(tmp_path, prod_db) as sc,
        serving(
            sc,
            max_connections_per_peer=3,
            request_timeout_s=1.0,
            tls_cert_file=tls.cert,
            tls_key_file=tls.key,
        ) as server,
    ):
        port = _port(server)
        assert await run(_tls_status, port, tls.ca) == 200  # TLS is on, and answers
        silent = [await run(_connect, port, "127.0.0.2") for _ in range(3)]
        try:
            extra = await run(_connect, port, "127.0.0.2")
            silent.append(extra)
            assert await run(doors.closed_within, extra, 2.0), (
                "a 4th connection of one peer, still in its handshake, was not refused"
            )
            # another peer is not affected
            assert await run(_tls_status, port, tls.ca, "127.0.0.1") == 200
            # a handshake that never comes is given up within the request deadline
            assert await run(_closed_count, silent[:3], 4.0) == 3, (
                "connections that never sent a ClientHello were held open"
            )
            # and the peer has its share back
            assert await run(_tls_status, port, tls.ca, "127.0.0.2") == 200
        finally:
            for s in silent:
                s.close()

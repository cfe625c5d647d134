"""Attack: a peer that keeps sending small requests and never reads the replies.

Small replies (errors, pings, misses, EXISTS on the kvgov wire; HEALTH/EXIST on ``lm://``) go
to the transport without waiting, and neither listener waited for the peer to read them before
reading its next request: a peer that never read had the sidecar queue every reply in user
space, without bound, for as long as it kept the connection open (on the kvgov wire a repeated
HELLO of 24 bytes earns a ~95-byte ERROR; ``lm://`` needs no credentials at all). Now a
listener reads no further request while its write buffer is over the high-water mark, and a
peer that does not read its replies within the frame deadline is disconnected (phase
``reply``).

To keep the test short the sidecar's side of the connection is given a small kernel send
buffer and a 64 KiB high-water mark (the production mark is 4 MiB, the send buffer the
kernel's), and the client a small receive buffer: the same code path, reached in a fraction of
a second instead of minutes.
"""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from kvgov.wire.codec import FrameType, encode_frame
from tests.security import doors
from tests.security.doors import run

pytestmark = pytest.mark.postgres

HIGH = 64 << 10
#: what may be queued: the mark, plus the reply that crossed it
BOUND = HIGH + 4096
FLOOD_S = 8.0


def _client(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    return sock


def _flood(sock: socket.socket, chunk: bytes, seconds: float) -> None:
    """Send ``chunk`` over and over, never reading, until the server stops taking it."""
    sock.settimeout(0.5)
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            sock.sendall(chunk)
    except OSError:
        pass  # the server stopped reading (a full window: timeout), or closed


def _squeeze(conn: Any) -> None:
    """The sidecar's end of the connection: a small send buffer and a 64 KiB mark."""
    t = conn.transport
    t.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    t.set_write_buffer_limits(high=HIGH)


async def _watch(conn: Any, flood: asyncio.Future[None]) -> tuple[int, bool]:
    """The largest reply backlog seen, and whether the sidecar closed the connection."""
    peak = 0
    give_up = None  # once the flood stopped (the server stopped reading): the deadline's turn
    while not conn.closed and (give_up is None or time.monotonic() < give_up):
        t = conn.transport
        if t is not None and not t.is_closing():
            peak = max(peak, t.get_write_buffer_size())
        if give_up is None and flood.done():
            give_up = time.monotonic() + 5.0
        await asyncio.sleep(0.01)
    await flood
    return peak, conn.closed


async def test_wire_replies_nobody_reads_are_bounded_and_the_peer_dropped(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    """An authenticated engine repeats HELLO (a non-fatal error each) and never reads."""
    async with doors.sidecar(tmp_path, prod_db, frame_timeout_s=1.0) as sc:
        sock = _client(sc.server.tcp_port)
        try:
            first, answer = doors.token_hello("tok-acme", {"version": 1, "engine": "x"})
            sock.sendall(encode_frame(FrameType.HELLO, 1, first))
            challenge = await run(doors.RawWire.read_from, sock)
            sock.sendall(encode_frame(FrameType.HELLO, 1, answer(challenge.meta)))
            await run(sock.recv, 4096)  # the HELLO reply; nothing is read after it
            (conn,) = list(sc.server.connections)
            _squeeze(conn)
            again = encode_frame(FrameType.HELLO, 2, None) * 2000
            flood = asyncio.ensure_future(run(_flood, sock, again, FLOOD_S))
            peak, closed = await _watch(conn, flood)
        finally:
            sock.close()
        assert peak <= BOUND, f"{peak} bytes of replies queued for a peer that reads none"
        assert closed, "a peer that read no reply for the frame deadline is still connected"


async def test_lm_replies_nobody_reads_are_bounded_and_the_peer_dropped(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    """``lm://`` (no handshake): any local process pipelines HEALTH and never reads."""
    async with doors.sidecar(
        tmp_path,
        prod_db,
        frame_timeout_s=1.0,
        lm_host="127.0.0.1",
        lm_port=0,
        lm_engine_id="lm-acme",
        lm_tenants=["acme"],
    ) as sc:
        assert sc.lm_server is not None
        sock = _client(sc.lm_server.port)
        try:
            health = doors.LM_REQUEST.pack(5, 0, 0, 0, 0, 0, 0, 0, 0, b"".ljust(150))
            sock.sendall(health)
            await run(sock.recv, 4096)  # connected and answered; nothing is read after it
            (conn,) = list(sc.lm_server.connections)
            _squeeze(conn)
            flood = asyncio.ensure_future(run(_flood, sock, health * 500, FLOOD_S))
            peak, closed = await _watch(conn, flood)
        finally:
            sock.close()
        assert peak <= BOUND, f"{peak} bytes of lm:// replies queued for a peer that reads none"
        assert closed, "a peer that read no reply for the frame deadline is still connected"

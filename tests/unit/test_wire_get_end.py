"""The client's side of ``late_miss``: a GET reply that says ``tail`` is followed by a GET_END
frame whose ``missed`` hits the client turns into misses; a GET_END that withdraws anything but
an announced hit is a malformed frame (the connection is dropped, nothing is returned).

A hand-rolled sidecar on a loopback socket (one thread) plays the server's frames."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from kvgov.wire import WireClient
from kvgov.wire.codec import (
    HEADER_SIZE,
    ErrorCode,
    Flag,
    FrameType,
    WireError,
    decode_header,
    decode_meta,
    encode_frame,
)

HELLO_REPLY = {
    "server": "kvgov",
    "version": "test",
    "protocol": 1,
    "sidecar": "sc",
    "engine": "e1",
    "max_frame_bytes": 1 << 20,
    "max_batch": 16,
    "features": ["late_miss"],
}


def _recv(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError
        buf += chunk
    return buf


def _read(sock: socket.socket) -> tuple[int, dict[str, Any]]:
    header = decode_header(_recv(sock, HEADER_SIZE))
    meta = decode_meta(_recv(sock, header.meta_len)) if header.meta_len else {}
    return header.stream_id, meta


@pytest.fixture
def sidecar(request: pytest.FixtureRequest) -> Iterator[tuple[str, dict[str, Any]]]:
    """Answers HELLO, then one GET: hits ``a`` (3 bytes) and ``b`` (2 bytes), ``tail``, and
    the GET_END ``request.param`` gives. Yields the address and what HELLO offered."""
    end: dict[str, Any] = request.param
    listener = socket.create_server(("127.0.0.1", 0))
    seen: dict[str, Any] = {}

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            sid, hello = _read(conn)
            seen.update(hello)
            conn.sendall(encode_frame(FrameType.HELLO, sid, HELLO_REPLY, 0, Flag.REPLY))
            sid, _ = _read(conn)
            items = [{"code": 0, "len": 3}, {"code": 0, "len": 2}, {"code": 5}]
            reply = {"items": items, "tail": True}
            conn.sendall(encode_frame(FrameType.GET, sid, reply, 5, Flag.REPLY) + b"abc\0\0")
            conn.sendall(encode_frame(FrameType.GET_END, sid, end, 0, Flag.REPLY))
            conn.recv(1)  # until the client goes

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    host, port = listener.getsockname()
    yield f"tcp://{host}:{port}", seen
    thread.join(5)
    listener.close()


@pytest.mark.parametrize("sidecar", [{"missed": [1]}], indirect=True)
def test_a_withdrawn_hit_is_a_miss(sidecar: tuple[str, dict[str, Any]]) -> None:
    address, hello = sidecar
    with WireClient(address, engine_id="e1") as client:
        got = client.get_many(["a", "b", "c"])
        assert client.hello().features == frozenset({"late_miss"})
    assert hello["features"] == ["late_miss"]  # offered
    assert got[0][0] is not None and bytes(got[0][1]) == b"abc"
    assert got[1:] == [(None, None), (None, None)]


@pytest.mark.parametrize(
    "sidecar",
    [{"missed": [2]}, {"missed": [3]}, {"missed": [-1]}, {"missed": ["1"]}, {"missed": 1}, {}],
    indirect=True,
    ids=["a-miss", "past-the-end", "negative", "a-string", "not-a-list", "absent"],
)
def test_a_get_end_that_withdraws_no_announced_hit_is_malformed(
    sidecar: tuple[str, dict[str, Any]],
) -> None:
    address, _ = sidecar
    with WireClient(address, engine_id="e1") as client:
        with pytest.raises(WireError) as err:
            client.get_many(["a", "b", "c"])
        assert err.value.error == ErrorCode.BAD_FRAME

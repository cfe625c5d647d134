"""Attack on the engine side (s9 review, item 4): a sidecar (wedged, malicious, or an impostor
at its address) that drips a reply one byte at a time, each byte within the client's timeout,
or announces a payload far larger than the request allows.

``timeout`` bounds one operation, from its request being sent to its reply fully read (it
bounded each socket read only: a dripping peer held the GET, its pool thread and LMCache's
retrieve for as long as it kept dripping), and a reply may carry no more payload than its
request allows (the u64 length was never capped: the client allocated what the peer
announced). Either way the connection is closed, never reused mid-frame.

Fails while the attack works. A fake sidecar in-process plays the peer (``fake_sidecar.py``).
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest

from kvgov.wire import WireClient, WireConnectionError
from kvgov.wire.codec import ErrorCode, Flag, FrameHeader, FrameType, WireError, encode_frame
from kvgov.wire.messages import GetResult
from tests.security.fake_sidecar import HELLO_REPLY, bounded, fake_sidecar, reply

T = 0.4
#: how long an operation may take past its deadline (scheduling, a loaded CI machine)
SLACK = 1.0
KEY = "m@1@0@abcd@bfloat16@tenant%acme"


def _client(endpoint: str, **kwargs: Any) -> WireClient:
    return WireClient(endpoint, engine_id="engine-test", timeout=T, **kwargs)


def _timed_out(outcome: object) -> bool:
    """``WireTimeoutError``: a connection error (the connector's miss and backoff) of its own."""
    return isinstance(outcome, WireConnectionError) and outcome.code == "wire_timeout"


def _answer_ping(conn: socket.socket, header: FrameHeader) -> bool:
    if header.type is FrameType.PING:
        conn.sendall(reply(FrameType.PING, header.stream_id, None))
        return True
    return False


def test_a_dripping_get_payload_times_out_at_the_operation_deadline() -> None:
    size = 1 << 16

    def handler(conn: socket.socket, header: FrameHeader, meta: dict[str, Any], _: bytes) -> None:
        if _answer_ping(conn, header):
            return
        items = [{"code": 0, "len": size, "meta": {}}]
        conn.sendall(reply(FrameType.GET, header.stream_id, {"items": items}, size))
        fake.drip(conn, b"x" * size, every_s=T * 0.6)  # each byte within the per-read timeout

    with fake_sidecar(handler) as fake, _client(fake.endpoint) as client:
        outcome, took = bounded(lambda: client.get(KEY), 10 * T)
        assert _timed_out(outcome), outcome
        assert "within" in str(outcome)
        assert took < T + SLACK, f"a GET took {took:.2f}s with timeout {T}s"
        # the connection it timed out on is closed, not handed back to the pool mid-frame
        assert client.ping() >= 0
        assert fake.accepted == 2


def test_a_dripping_reply_header_times_out() -> None:
    def handler(conn: socket.socket, header: FrameHeader, meta: dict[str, Any], _: bytes) -> None:
        frame = reply(FrameType.EXISTS, header.stream_id, {"found": [True]})
        fake.drip(conn, frame, every_s=T * 0.6)

    with fake_sidecar(handler) as fake, _client(fake.endpoint) as client:
        outcome, took = bounded(lambda: client.exists(KEY), 10 * T)
        assert _timed_out(outcome), outcome
        assert took < T + SLACK


def test_a_dripping_hello_times_out() -> None:
    def hello(conn: socket.socket, header: FrameHeader) -> None:
        fake.drip(conn, reply(FrameType.HELLO, header.stream_id, HELLO_REPLY), every_s=T * 0.6)

    with fake_sidecar(hello=hello) as fake, _client(fake.endpoint) as client:
        outcome, took = bounded(client.ping, 10 * T)
        assert _timed_out(outcome), outcome
        assert took < T + SLACK


def test_a_sidecar_that_stops_reading_a_put_times_it_out() -> None:
    # the fake reads a PUT's header and metadata, never its payload, and never answers
    with fake_sidecar(read_payloads=False) as fake, _client(fake.endpoint) as client:
        outcome, took = bounded(lambda: client.put(KEY, bytes(64 << 20)), 10 * T)
        assert _timed_out(outcome), outcome
        assert took < T + SLACK


def test_a_put_whose_ack_never_comes_times_out_in_a_stream() -> None:
    with fake_sidecar() as fake, _client(fake.endpoint) as client:  # reads, never answers
        items = [(f"{KEY}@{i}", b"v" * 100) for i in range(3)]
        outcome, took = bounded(lambda: client.put_stream(items, depth=2), 10 * T)
        assert _timed_out(outcome), outcome
        assert took < T + SLACK


def test_a_reply_arriving_in_pieces_within_the_deadline_is_read() -> None:
    size = 1 << 20

    def handler(conn: socket.socket, header: FrameHeader, meta: dict[str, Any], _: bytes) -> None:
        if _answer_ping(conn, header):
            return
        items = [{"code": 0, "len": size, "meta": {"fmt": 1}}]
        conn.sendall(reply(FrameType.GET, header.stream_id, {"items": items}, size))
        for i in range(8):  # 8 pieces, T/16 apart: all of it well within T
            time.sleep(T / 16)
            conn.sendall(bytes([i]) * (size // 8))

    with fake_sidecar(handler) as fake, _client(fake.endpoint) as client:
        got = client.get(KEY)
        assert got is not None
        assert got[1] == GetResult(KEY, size, {"fmt": 1})
        assert got[0] == b"".join(bytes([i]) * (size // 8) for i in range(8))
        assert client.ping() >= 0
        assert fake.accepted == 1  # the connection was reused


@pytest.mark.parametrize("announced", [1 << 62, (1 << 30) + 1], ids=["u64", "over-hello"])
def test_a_get_reply_longer_than_the_hello_allows_is_refused_unread(announced: int) -> None:
    def handler(conn: socket.socket, header: FrameHeader, meta: dict[str, Any], _: bytes) -> None:
        if _answer_ping(conn, header):
            return
        items = [{"code": 0, "len": announced, "meta": {}}]
        conn.sendall(reply(FrameType.GET, header.stream_id, {"items": items}, announced))
        fake.drip(conn, b"x" * 64, every_s=T * 0.6)

    asked: list[GetResult] = []

    def alloc(result: GetResult) -> bytearray:
        asked.append(result)
        return bytearray(16)

    with fake_sidecar(handler) as fake, _client(fake.endpoint) as client:
        outcome, took = bounded(lambda: client.get_many([KEY], None, alloc), 10 * T)
        assert isinstance(outcome, WireError), outcome
        assert outcome.error == ErrorCode.TOO_LARGE
        assert not asked, "a buffer was asked for a hit the reply may not carry"
        assert took < T
        assert client.ping() >= 0
        assert fake.accepted == 2  # that connection was closed


def test_a_get_reply_longer_than_the_caller_allows_is_refused_unread() -> None:
    def handler(conn: socket.socket, header: FrameHeader, meta: dict[str, Any], _: bytes) -> None:
        if _answer_ping(conn, header):
            return
        items = [{"code": 0, "len": 1000, "meta": {}}, {"code": 0, "len": 1000, "meta": {}}]
        conn.sendall(reply(FrameType.GET, header.stream_id, {"items": items}, 2000) + bytes(2000))

    with fake_sidecar(handler) as fake, _client(fake.endpoint) as client:
        with pytest.raises(WireError) as err:
            client.get_many([KEY, KEY + "x"], max_bytes=1500)
        assert err.value.error == ErrorCode.TOO_LARGE
        assert client.ping() >= 0
        assert fake.accepted == 2
        # what the caller allows: read as usual
        got = client.get_many([KEY, KEY + "x"], max_bytes=2000)
        assert [bytes(b) for _, b in got] == [bytes(1000), bytes(1000)]


@pytest.mark.parametrize("ftype", [FrameType.PING, FrameType.EXISTS, FrameType.ERROR])
def test_a_payload_on_a_reply_that_carries_none_is_refused(ftype: FrameType) -> None:
    def handler(conn: socket.socket, header: FrameHeader, meta: dict[str, Any], _: bytes) -> None:
        body = {"found": [True]} if ftype is FrameType.EXISTS else None
        if ftype is FrameType.ERROR:
            body = {"code": int(ErrorCode.INTERNAL), "name": "internal", "message": "x"}
            frame = encode_frame(ftype, header.stream_id, body, 1 << 40, Flag.NONE)
        else:
            frame = reply(ftype, header.stream_id, body, 1 << 40)
        conn.sendall(frame)

    with fake_sidecar(handler) as fake, _client(fake.endpoint) as client:
        call = client.ping if ftype is not FrameType.EXISTS else (lambda: client.exists(KEY))
        outcome, took = bounded(call, 10 * T)
        assert isinstance(outcome, WireError), outcome
        assert outcome.error == ErrorCode.TOO_LARGE
        assert took < T


def test_an_idle_control_connection_outlives_the_timeout() -> None:
    """The deadline ends with the operation: a control connection waits for EVICTs for ever."""
    pinged = threading.Event()

    def hello(conn: socket.socket, header: FrameHeader) -> None:
        conn.sendall(reply(FrameType.HELLO, header.stream_id, HELLO_REPLY))
        time.sleep(4 * T)  # idle, then ask the engine for a PING reply
        conn.sendall(encode_frame(FrameType.PING, 7, None, 0, Flag.NONE))

    def handler(conn: socket.socket, header: FrameHeader, meta: dict[str, Any], _: bytes) -> None:
        if header.type is FrameType.PING and header.is_reply and header.stream_id == 7:
            pinged.set()

    with fake_sidecar(handler, hello=hello) as fake, _client(fake.endpoint) as client:
        channel = client.control(lambda request: [], reconnect_delay=0.05)
        try:
            assert pinged.wait(10 * T), "the control connection did not answer after idling"
            assert fake.accepted == 1
        finally:
            channel.close()

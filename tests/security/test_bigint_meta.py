"""A JSON integer too long to convert in a frame's metadata (review 2, finding 1).

CPython's ``json`` turns an integer literal of more than 4300 digits into a plain
``ValueError`` ("Exceeds the limit (4300 digits) for integer string conversion"), not a
``JSONDecodeError``, and the codec caught only the latter. So one such frame:

- from an impostor at the sidecar's address (no token needed: it answers the engine's first
  HELLO) ended the engine's control thread for good: it never reconnected, and every later
  purge counted that engine as unreachable while its local tiers kept the purged user's KV;
- answering a ``WireClient`` request leaked that ``ValueError`` to the caller (the contract is
  ``WireError``) and could hand the connection back to the pool mid-frame;
- sent to the sidecar before HELLO, by any peer that can connect, crashed the connection
  handler: no ERROR frame, a full traceback logged at ERROR for every connection.

The door holds when metadata holding an integer of more than 20 digits (no field needs more:
a u64 has 20) is ``bad_frame`` on either side, the control channel survives any exception
and reconnects, and a request that fails in any way discards its connection and raises
``WireError``. Fails while the attack works. Engine side: a fake sidecar in-process plays the
peer (``fake_sidecar.py``); sidecar side: a production sidecar (``doors.py``).
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvgov.wire import WireClient, WireError
from kvgov.wire._conn import Connection
from kvgov.wire.codec import (
    ErrorCode,
    Flag,
    FrameHeader,
    FrameType,
    decode_meta,
    encode_frame,
    encode_header,
)
from kvgov.wire.digest import KeyDigester
from kvgov.wire.messages import GetResult, RequestContext, evict_meta
from tests.security import doors
from tests.security.doors import RawWire, key, run
from tests.security.fake_sidecar import HELLO_REPLY, FakeSidecar, fake_sidecar, reply

T = 0.5
#: a generous bound for what must happen within about ``T`` (a loaded CI machine)
LIMIT = 10 * T
DIGESTER = KeyDigester(bytes(range(32)))
KEY = "m@1@0@abcd@bfloat16@tenant%acme"
SID = 0x8000_0001  # server-initiated stream ids have the top bit set
#: more digits than CPython converts (``sys.int_max_str_digits``, 4300)
BIGINT = "1" * 5000
#: what a log record must never hold of the poison
TRACE = "1" * 64


def _frame(ftype: FrameType, sid: int, meta_json: str, flags: Flag = Flag.NONE) -> bytes:
    """A frame whose metadata is the JSON text given."""
    body = meta_json.encode()
    return encode_header(ftype, sid, len(body), 0, flags) + body


def _no_poison_logged(caplog: pytest.LogCaptureFixture) -> None:
    for record in caplog.records:
        assert TRACE not in str(record.__dict__), record.getMessage()


# -- the codec ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "meta_json",
    [
        f'{{"nonce":{BIGINT}}}',
        f'{{"version":-{BIGINT}}}',
        f'{{"items":[{{"code":0,"len":{BIGINT}}}]}}',
    ],
    ids=["top", "negative", "nested"],
)
@pytest.mark.parametrize("cap", [4300, 0, 100_000], ids=["default-cap", "no-cap", "raised-cap"])
def test_a_long_integer_in_metadata_is_a_bad_frame(meta_json: str, cap: int) -> None:
    """Whatever the process's ``sys.int_max_str_digits`` (an engine may lift it): the default
    cap refuses the literal itself (a ValueError the codec used to let through); without one,
    or a higher one, the codec's own bound (20 digits) does."""
    before = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(cap)
    try:
        with pytest.raises(WireError) as caught:
            decode_meta(meta_json.encode())
    finally:
        sys.set_int_max_str_digits(before)
    assert caught.value.error is ErrorCode.BAD_FRAME
    assert TRACE not in str(caught.value)


def test_without_the_interpreters_cap_more_than_20_digits_is_a_bad_frame() -> None:
    before = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        with pytest.raises(WireError) as caught:
            decode_meta(b'{"len":123456789012345678901}')  # 21 digits
        assert decode_meta(b'{"len":18446744073709551615}') == {"len": (1 << 64) - 1}
    finally:
        sys.set_int_max_str_digits(before)
    assert caught.value.error is ErrorCode.BAD_FRAME


def test_every_64_bit_integer_still_decodes() -> None:
    """The bound refuses nothing a field carries: u64 (a payload length) and i64 (item meta)."""
    meta = decode_meta(b'{"a":18446744073709551615,"b":-9223372036854775808,"c":0,"d":-1}')
    assert meta == {"a": (1 << 64) - 1, "b": -(1 << 63), "c": 0, "d": -1}
    assert decode_meta(b'{"f":1.5e300}') == {"f": 1.5e300}  # floats are not bounded by digits


# -- the engine's control channel -----------------------------------------------------------


def _hello_reply(conn: socket.socket, header: FrameHeader) -> None:
    answer = {**HELLO_REPLY, "key_digest_key": DIGESTER.to_hex()}
    conn.sendall(reply(FrameType.HELLO, header.stream_id, answer))


def _control(fake: FakeSidecar, token: str | None = None) -> tuple[bool, bool]:
    """Open a control channel to ``fake`` and wait for its second connection: (the thread is
    alive, it reconnected)."""
    client = WireClient(fake.endpoint, engine_id="engine-test", token=token, timeout=T)
    channel = client.control(lambda request: list(request.digests), reconnect_delay=0.05)
    try:
        doors.wait_for(lambda: fake.accepted >= 2, LIMIT)
        # token-less the fake completes HELLO; with a token it cannot (it is no sidecar), so
        # there only the retry itself is asked for
        reconnected = fake.accepted >= 2 and (token is not None or channel.connected.wait(LIMIT))
        alive = channel._thread.is_alive()
    finally:
        channel.close()
        client.close()
    return alive, reconnected


@pytest.mark.parametrize("token", [None, "engine-token-the-impostor-does-not-know"])
def test_a_bigint_answer_to_the_control_hello_does_not_end_the_channel(
    token: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    """The impostor answers the engine's first HELLO with one poison frame (no token needed);
    then the real sidecar is back. The channel must reconnect to it."""
    count = [0]
    lock = threading.Lock()

    def hello(conn: socket.socket, header: FrameHeader) -> None:
        with lock:
            first = count[0] == 0
            count[0] += 1
        if first:
            conn.sendall(
                _frame(FrameType.HELLO, header.stream_id, f'{{"nonce":{BIGINT}}}', Flag.REPLY)
            )
            return
        _hello_reply(conn, header)

    with (
        caplog.at_level(logging.WARNING, logger="kvgov.wire.client"),
        fake_sidecar(hello=hello) as fake,
    ):
        alive, reconnected = _control(fake, token)
    assert alive, "the control thread died on one malformed frame (it never reconnects)"
    assert reconnected, "the control channel never reconnected to the real sidecar"
    failed = [r for r in caplog.records if r.getMessage() == "wire.control.connect_failed"]
    assert failed and getattr(failed[0], "error", None) == "BAD_FRAME"
    _no_poison_logged(caplog)


def test_a_bigint_evict_after_hello_drops_that_connection_and_reconnects(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An authenticated-looking peer sends an EVICT whose metadata holds a poison integer:
    nothing is evicted, that connection is dropped, the channel reconnects."""
    count = [0]
    lock = threading.Lock()
    evicted: list[Any] = []

    def hello(conn: socket.socket, header: FrameHeader) -> None:
        _hello_reply(conn, header)
        with lock:
            first = count[0] == 0
            count[0] += 1
        if first:
            digests = evict_meta([DIGESTER.digest(KEY)])["digests"]
            meta = f'{{"digests":["{digests[0]}"],"reason":"purge","job":{BIGINT}}}'
            conn.sendall(_frame(FrameType.EVICT, SID, meta))

    with (
        caplog.at_level(logging.WARNING, logger="kvgov.wire.client"),
        fake_sidecar(hello=hello) as fake,
    ):
        client = WireClient(fake.endpoint, engine_id="engine-test", timeout=T)
        channel = client.control(lambda req: evicted.append(req) or [], reconnect_delay=0.05)
        try:
            doors.wait_for(lambda: fake.accepted >= 2, LIMIT)
            reconnected = fake.accepted >= 2 and channel.connected.wait(LIMIT)
            alive = channel._thread.is_alive()
        finally:
            channel.close()
            client.close()
    assert alive, "the control thread died on one malformed EVICT"
    assert reconnected, "the control channel never reconnected"
    assert not evicted
    lost = [r for r in caplog.records if r.getMessage() == "wire.control.lost"]
    assert lost and getattr(lost[0], "error", None) == "BAD_FRAME"
    _no_poison_logged(caplog)


def test_control_malformed_json_is_survived() -> None:
    """Control (passes with or without the fix): JSON that merely does not parse."""

    count = [0]
    lock = threading.Lock()

    def hello(conn: socket.socket, header: FrameHeader) -> None:
        with lock:
            first = count[0] == 0
            count[0] += 1
        if first:
            broken = '{"nonce":"' + "1" * 5000  # an unterminated string
            conn.sendall(_frame(FrameType.HELLO, header.stream_id, broken, Flag.REPLY))
            return
        _hello_reply(conn, header)

    with fake_sidecar(hello=hello) as fake:
        alive, reconnected = _control(fake)
    assert alive and reconnected


@pytest.mark.parametrize("where", ["connect", "serve"])
def test_any_exception_in_the_control_thread_is_survived(
    where: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Defence in depth, whatever the codec does: an exception of any kind while connecting or
    serving is logged (its type only, never its text) and the channel reconnects."""
    secret = "secret-" + TRACE
    calls = [0]
    if where == "connect":
        original = Connection.hello

        def hello(self: Connection, *args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            if calls[0] == 1:
                self.close()
                raise RuntimeError(secret)
            return original(self, *args, **kwargs)

        monkeypatch.setattr(Connection, "hello", hello)
    else:

        def parse_evict(meta: Any) -> list[str]:
            calls[0] += 1
            raise RuntimeError(secret)

        monkeypatch.setattr("kvgov.wire.control.parse_evict", parse_evict)

    def sidecar_hello(conn: socket.socket, header: FrameHeader) -> None:
        _hello_reply(conn, header)
        if where == "serve" and calls[0] == 0:
            conn.sendall(encode_frame(FrameType.EVICT, SID, evict_meta([DIGESTER.digest(KEY)])))

    with (
        caplog.at_level(logging.WARNING, logger="kvgov.wire.client"),
        fake_sidecar(hello=sidecar_hello) as fake,
    ):
        alive, reconnected = _control(fake)
    assert calls[0] >= 1, "the fault was never injected"
    assert alive, "the control thread died on an unexpected exception"
    assert reconnected
    lost = [r for r in caplog.records if r.getMessage() == "wire.control.lost"]
    assert lost and getattr(lost[0], "error", None) == "RuntimeError"
    for record in caplog.records:
        assert "secret-" not in str(record.__dict__) and not record.exc_info


# -- the engine's data-plane client ------------------------------------------------------------


def _client(endpoint: str) -> WireClient:
    return WireClient(endpoint, engine_id="engine-test", timeout=T, pool_size=1)


def _poison_handler() -> Any:
    """Answers each request with a reply (or ERROR frame) whose metadata holds the poison."""

    def handler(conn: socket.socket, header: FrameHeader, meta: dict[str, Any], _: bytes) -> None:
        sid = header.stream_id
        if header.type is FrameType.PING:
            conn.sendall(reply(FrameType.PING, sid, None))
        elif header.type is FrameType.EXISTS:
            conn.sendall(_frame(FrameType.EXISTS, sid, f'{{"found":[{BIGINT}]}}', Flag.REPLY))
        elif header.type is FrameType.GET:
            items = f'{{"items":[{{"code":0,"len":{BIGINT}}}]}}'
            conn.sendall(_frame(FrameType.GET, sid, items, Flag.REPLY))
        elif header.type is FrameType.PUT:
            conn.sendall(
                _frame(FrameType.PUT, sid, f'{{"results":[{{"code":{BIGINT}}}]}}', Flag.REPLY)
            )
        elif header.type is FrameType.REMOVE:  # an ERROR frame whose code is the poison
            conn.sendall(_frame(FrameType.ERROR, sid, f'{{"code":{BIGINT},"message":"x"}}'))

    return handler


OPS: dict[str, Callable[[WireClient], Any]] = {
    "exists": lambda c: c.exists(KEY),
    "get": lambda c: c.get(KEY),
    "put": lambda c: c.put(KEY, b"v" * 16),
    "put_stream": lambda c: c.put_stream([(KEY, b"v" * 16)]),
    "error-frame": lambda c: c.remove(KEY),
}


@pytest.mark.parametrize("op", list(OPS))
def test_a_bigint_reply_is_a_wire_error_and_its_connection_is_not_reused(op: str) -> None:
    with fake_sidecar(_poison_handler()) as fake, _client(fake.endpoint) as client:
        with pytest.raises(WireError) as caught:
            OPS[op](client)
        assert caught.value.error is ErrorCode.BAD_FRAME, caught.value
        # that connection is closed, not handed back to the pool mid-frame
        assert client.ping() >= 0
        assert fake.accepted == 2


def test_a_bigint_hello_reply_is_a_wire_error() -> None:
    def hello(conn: socket.socket, header: FrameHeader) -> None:
        meta = '{"server":"kvgov","version":"x","protocol":' + BIGINT + "}"
        conn.sendall(_frame(FrameType.HELLO, header.stream_id, meta, Flag.REPLY))

    with fake_sidecar(hello=hello) as fake, _client(fake.endpoint) as client:
        with pytest.raises(WireError) as caught:
            client.ping()
        assert caught.value.error is ErrorCode.BAD_FRAME


def test_any_other_exception_in_a_request_discards_its_connection() -> None:
    """Defence in depth: an exception that is not a WireError (here the caller's allocator
    failing with the hit's bytes still on the wire) discards the connection and reaches the
    caller as a WireError, the original kept as its cause."""
    size = 64

    def handler(conn: socket.socket, header: FrameHeader, meta: dict[str, Any], _: bytes) -> None:
        if header.type is FrameType.PING:
            conn.sendall(reply(FrameType.PING, header.stream_id, None))
            return
        items = [{"code": 0, "len": size, "meta": {}}]
        conn.sendall(reply(FrameType.GET, header.stream_id, {"items": items}, size) + b"x" * size)

    def alloc(result: GetResult) -> Any:
        raise RuntimeError("the caller's allocator failed")

    with fake_sidecar(handler) as fake, _client(fake.endpoint) as client:
        with pytest.raises(WireError) as caught:
            client.get_many([KEY], None, alloc)
        assert isinstance(caught.value.__cause__, RuntimeError)
        assert client.ping() >= 0  # not the unread hit's bytes taken for a reply
        assert fake.accepted == 2


# -- the sidecar -----------------------------------------------------------------------------


@pytest.mark.postgres
@pytest.mark.parametrize(
    "hello",
    [
        f'{{"version":{BIGINT},"engine":"x"}}',
        f'{{"version":1,"engine":"x","features":[{BIGINT}]}}',
    ],
    ids=["version", "features"],
)
async def test_a_bigint_hello_before_authentication_is_an_error_frame(
    tmp_path: Path, prod_db: doors.ProdDatabase, caplog: pytest.LogCaptureFixture, hello: str
) -> None:
    """Any peer that can connect, no token: the usual ERROR frame and the connection closed,
    no traceback logged; the sidecar still serves an honest engine."""
    caplog.set_level(logging.INFO)
    async with doors.sidecar(tmp_path, prod_db) as sc:
        port = sc.server.tcp_port
        assert port is not None
        raw = RawWire(port)
        try:
            raw.send_raw(_frame(FrameType.HELLO, 1, hello))
            answer = await run(raw.read)
            assert answer.error == "bad_frame", answer
            assert await run(raw.closed_by_peer)
        finally:
            raw.close()
        honest = doors.engine(sc, "tok-acme")
        try:
            ctx = RequestContext(request_id="after", tenant="acme")
            assert (await run(honest.put, key(9, "acme"), b"v" * 64, ctx)).ok
        finally:
            honest.close()
    assert not doors.error_logs(caplog.records), [
        r.getMessage() for r in doors.error_logs(caplog.records)
    ]
    _no_poison_logged(caplog)


@pytest.mark.postgres
async def test_a_bigint_request_after_hello_is_a_bad_frame(
    tmp_path: Path, prod_db: doors.ProdDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    """An authenticated engine's request with a poison integer: ``bad_frame``, that connection
    closed, no traceback, and the engine's other connections unaffected."""
    caplog.set_level(logging.INFO)
    async with doors.sidecar(tmp_path, prod_db) as sc:
        port = sc.server.tcp_port
        assert port is not None
        honest = doors.engine(sc, "tok-acme")
        raw = RawWire(port)
        try:
            assert await run(honest.ping) >= 0
            assert (await run(raw.hello, "tok-acme")).type == FrameType.HELLO
            meta = f'{{"keys":["{key(1, "acme")}"],"ctx":{{"tenant":"acme"}},"n":{BIGINT}}}'
            raw.send_raw(_frame(FrameType.EXISTS, 2, meta))
            answer = await run(raw.read)
            assert answer.error == "bad_frame", answer
            assert await run(raw.closed_by_peer)
            assert await run(honest.ping) >= 0
        finally:
            raw.close()
            honest.close()
    assert not doors.error_logs(caplog.records), [
        r.getMessage() for r in doors.error_logs(caplog.records)
    ]
    _no_poison_logged(caplog)

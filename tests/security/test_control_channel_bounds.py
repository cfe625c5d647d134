"""Attack on the engine side of the control connection: a sidecar (wedged, malicious, or an
impostor at its address) that starts an EVICT frame and then stalls or drips it, or announces a
payload on a frame that carries none.

``ControlChannel`` waits for the sidecar with no deadline (it speaks only during a purge), but it
read a frame once begun with no deadline either, and read and discarded whatever payload a
header announced: half a header and silence held the control thread for ever (purges never
reached that engine again), and a 4 GiB payload was read to the end. Now the first byte of a
frame starts the client's ``timeout`` for the whole frame (header and metadata; the codec caps
the metadata at 1 MiB) and a control frame may carry no payload: either way the channel closes
that connection, logs a warning and reconnects.

Fails while the attack works. A fake sidecar in-process plays the peer (``fake_sidecar.py``).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvgov.wire import WireClient
from kvgov.wire.codec import HEADER_SIZE, Flag, FrameHeader, FrameType, encode_frame
from kvgov.wire.digest import KeyDigester
from kvgov.wire.messages import EvictRequest, evict_meta
from tests.security import doors
from tests.security.fake_sidecar import HELLO_REPLY, FakeSidecar, fake_sidecar, read_frame, reply

T = 0.4
#: a generous bound for what must happen within about ``T`` (a loaded CI machine)
LIMIT = 10 * T
DIGESTER = KeyDigester(bytes(range(32)))
HELD = "m@1@0@abcd@bfloat16@tenant%acme"
DIGEST = DIGESTER.digest(HELD)
OTHER = DIGESTER.digest(HELD + "@other")
SID = 0x8000_0001  # server-initiated stream ids have the top bit set


def _evict(payload_len: int = 0, ftype: FrameType = FrameType.EVICT) -> bytes:
    meta = evict_meta([DIGEST, OTHER]) if ftype is FrameType.EVICT else None
    return encode_frame(ftype, SID, meta, payload_len, Flag.NONE)


@dataclass
class Attack:
    """What the fake sidecar saw of the attacked (first) control connection."""

    #: the engine closed it (EOF or reset) within :data:`LIMIT` of the attack
    dropped: threading.Event = field(default_factory=threading.Event)
    #: the fake is done with it (dropped, gave up, or the control exchange ended)
    done: threading.Event = field(default_factory=threading.Event)
    #: bytes the engine sent on it after the attack (an EVICT_ACK would be here)
    received: bytearray = field(default_factory=bytearray)
    #: payload bytes the fake managed to send
    sent: int = 0
    #: what a control exchange saw
    out: dict[str, Any] = field(default_factory=dict)


AttackFn = Callable[[FakeSidecar, socket.socket, Attack], None]


def _wait_closed(conn: socket.socket, attack: Attack, limit: float) -> None:
    """Read until the engine closes ``conn``; set ``attack.dropped`` if it does within ``limit``."""
    deadline = time.monotonic() + limit
    try:
        while (left := deadline - time.monotonic()) > 0:
            conn.settimeout(left)
            chunk = conn.recv(65536)
            if not chunk:
                attack.dropped.set()
                return
            attack.received += chunk
    except TimeoutError:
        return
    except OSError:  # reset: the engine closed with our bytes unread
        attack.dropped.set()


@contextlib.contextmanager
def _control_sidecar(attack_fn: AttackFn, *, drop: bool) -> Iterator[tuple[FakeSidecar, Attack]]:
    """A fake sidecar whose first connection, after HELLO (with a key-digest key), is attacked
    by ``attack_fn`` (then, if ``drop``, watched until the engine closes it); later ones (the
    reconnects) idle."""
    attack = Attack()
    count = [0]
    lock = threading.Lock()

    def hello(conn: socket.socket, header: FrameHeader) -> None:
        answer = {**HELLO_REPLY, "key_digest_key": DIGESTER.to_hex()}
        conn.sendall(reply(FrameType.HELLO, header.stream_id, answer))
        with lock:
            first = count[0] == 0
            count[0] += 1
        if not first:
            return
        try:
            attack_fn(fake, conn, attack)
            if drop:
                _wait_closed(conn, attack, LIMIT)
        except OSError:  # a send failed: the engine closed (reset) mid-attack
            attack.dropped.set()
        finally:
            attack.done.set()

    with fake_sidecar(hello=hello) as fake:
        yield fake, attack


def _run(attack_fn: AttackFn, *, drop: bool = True) -> tuple[FakeSidecar, Attack, list[Any]]:
    """Open a control channel to a fake sidecar that attacks it; wait (within generous bounds)
    for the attack to end and, if ``drop``, for a second control connection."""
    calls: list[EvictRequest] = []

    def on_evict(request: EvictRequest) -> list[str]:
        calls.append(request)
        return list(request.digests)

    with (
        _control_sidecar(attack_fn, drop=drop) as (fake, attack),
        WireClient(fake.endpoint, engine_id="engine-test", timeout=T) as client,
    ):
        channel = client.control(on_evict, reconnect_delay=0.05)
        try:
            assert attack.done.wait(2 * LIMIT), "the attack never ended"
            if drop:
                doors.wait_for(lambda: fake.accepted >= 2, LIMIT)
        finally:
            channel.close()
    return fake, attack, calls


def _assert_dropped_and_reconnected(fake: FakeSidecar, attack: Attack) -> None:
    assert attack.dropped.is_set(), f"the control connection was not dropped within {LIMIT}s"
    assert fake.accepted >= 2, "the channel did not reconnect"


def test_half_a_header_then_silence_is_dropped_and_the_channel_reconnects(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def attack_fn(fake: FakeSidecar, conn: socket.socket, attack: Attack) -> None:
        conn.sendall(_evict()[: HEADER_SIZE // 2])  # and stall

    with caplog.at_level(logging.WARNING, logger="kvgov.wire.client"):
        fake, attack, calls = _run(attack_fn)
    _assert_dropped_and_reconnected(fake, attack)
    assert not calls
    assert not attack.received, "the engine answered a frame it never got"
    lost = [r for r in caplog.records if r.getMessage() == "wire.control.lost"]
    assert lost, [r.getMessage() for r in caplog.records]
    for record in caplog.records:  # no digest, no key in what is logged
        text = str(record.__dict__)
        assert DIGEST not in text and OTHER not in text and DIGESTER.to_hex() not in text


def test_half_the_metadata_then_silence_is_dropped() -> None:
    def attack_fn(fake: FakeSidecar, conn: socket.socket, attack: Attack) -> None:
        frame = _evict()
        conn.sendall(frame[: HEADER_SIZE + (len(frame) - HEADER_SIZE) // 2])

    fake, attack, calls = _run(attack_fn)
    _assert_dropped_and_reconnected(fake, attack)
    assert not calls


def test_a_frame_dripped_slower_than_the_deadline_is_dropped() -> None:
    def attack_fn(fake: FakeSidecar, conn: socket.socket, attack: Attack) -> None:
        # each byte well within the timeout, the whole frame far beyond it
        fake.drip(conn, _evict(), every_s=T * 0.3)

    fake, attack, calls = _run(attack_fn)
    _assert_dropped_and_reconnected(fake, attack)
    assert not calls, "a frame dripped past the deadline was acted on"


@pytest.mark.parametrize("ftype", [FrameType.EVICT, FrameType.PING])
def test_a_4gib_payload_on_the_control_connection_is_refused_unread(ftype: FrameType) -> None:
    def attack_fn(fake: FakeSidecar, conn: socket.socket, attack: Attack) -> None:
        conn.sendall(_evict(payload_len=4 << 30, ftype=ftype))  # and nothing more

    fake, attack, calls = _run(attack_fn)
    _assert_dropped_and_reconnected(fake, attack)
    assert not calls, "an EVICT with a payload was acted on"
    assert not attack.received, "the engine answered a frame with a payload"


def test_a_streamed_4gib_payload_is_not_read() -> None:
    """The fake sends what it announced as fast as it can: the engine stops reading at the
    header, so little more than the sockets' buffers ever leaves the fake."""
    cap = 128 << 20
    chunk = bytes(1 << 20)

    def attack_fn(fake: FakeSidecar, conn: socket.socket, attack: Attack) -> None:
        conn.sendall(_evict(payload_len=4 << 30))
        while attack.sent < cap and not fake.stop.is_set():
            conn.sendall(chunk)  # raises once the engine closed (reset)
            attack.sent += len(chunk)

    fake, attack, calls = _run(attack_fn)
    _assert_dropped_and_reconnected(fake, attack)
    assert not calls
    assert attack.sent <= 32 << 20, f"the engine read {attack.sent >> 20} MiB of the payload"


# -- controls: these pass with or without the bounds --------------------------------------------


def _serve_engine(conn: socket.socket, limit: float) -> tuple[FrameHeader, dict[str, Any]]:
    conn.settimeout(limit)
    header, meta, _ = read_frame(conn)
    return header, meta


def test_an_idle_control_connection_outlives_the_timeout_and_answers_a_ping() -> None:
    def attack_fn(fake: FakeSidecar, conn: socket.socket, attack: Attack) -> None:
        conn.settimeout(4 * T)  # idle for 4 x the timeout: the engine neither closes nor speaks
        try:
            attack.out["early"] = conn.recv(1)
        except TimeoutError:
            attack.out["early"] = None
        conn.sendall(encode_frame(FrameType.PING, SID, None, 0, Flag.NONE))
        attack.out["reply"] = _serve_engine(conn, LIMIT)[0]

    fake, attack, calls = _run(attack_fn, drop=False)
    out = attack.out
    assert out["early"] is None, "the engine closed (or spoke on) an idle control connection"
    header = out["reply"]
    assert header.type is FrameType.PING and header.is_reply and header.stream_id == SID
    assert fake.accepted == 1, "the idle control connection was dropped"
    assert not calls


def test_an_evict_after_idle_and_in_pieces_within_the_deadline_is_answered() -> None:
    def attack_fn(fake: FakeSidecar, conn: socket.socket, attack: Attack) -> None:
        time.sleep(3 * T)  # idle past the timeout
        frame = _evict()
        for piece in (frame[:1], frame[1:HEADER_SIZE], frame[HEADER_SIZE:]):
            conn.sendall(piece)
            time.sleep(T / 8)  # all of it well within the deadline
        attack.out["ack"] = _serve_engine(conn, LIMIT)

    fake, attack, calls = _run(attack_fn, drop=False)
    header, meta = attack.out["ack"]
    assert header.type is FrameType.EVICT_ACK and header.stream_id == SID
    assert sorted(meta["removed"]) == sorted([DIGEST, OTHER])
    assert len(calls) == 1 and calls[0].digests == {DIGEST, OTHER}
    assert fake.accepted == 1, "a well-formed EVICT cost the connection"

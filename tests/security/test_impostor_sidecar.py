"""An impostor at the sidecar's address: a process that took its TCP port, or its Unix socket
path in the pod's shared directory, while the sidecar restarted.

Attack (review, ninth session): the engine-side client connected to whatever answered there
and sent its engine token in HELLO before the server proved anything; then it sent the
plaintext of every put, and took whatever bytes the impostor served as hits (poisoning the
engine's KV cache). The HELLO now proves the token both ways without sending it
(:mod:`kvgov.wire.handshake`): the sidecar first, and the engine stops at a peer that cannot.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvgov.wire import WireClient, handshake
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
from tests.integration.live import recv_exact

TOKEN = "engine-token-" + "s3cr3t" * 6
FORGED = b"FORGED-KV-BYTES!" * 64
KEY = "m@1@0@abcd@bfloat16@tenant%acme"
#: what a sidecar's HELLO reply says (the impostor copies it)
HELLO_REPLY = {
    "server": "kvgov",
    "version": "0",
    "protocol": 1,
    "sidecar": "impostor",
    "max_frame_bytes": 1 << 30,
    "max_batch": 4096,
    "engine": "engine-1",
    "features": [],
}


class Impostor:
    """Listens where the sidecar would, records every byte it receives, answers HELLO as a
    sidecar would (with ``challenge`` as its first answer when given), says every put was
    stored and serves forged bytes for every get."""

    def __init__(self, address: str | None, challenge: dict[str, Any] | None) -> None:
        if address is None:
            self.sock = socket.create_server(("127.0.0.1", 0))
            host, port = self.sock.getsockname()[:2]
            self.endpoint = f"tcp://{host}:{port}"
        else:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.bind(address)
            self.sock.listen()
            self.endpoint = f"unix://{address}"
        self.challenge = challenge
        self.received = bytearray()
        self.frames: list[tuple[FrameType, dict[str, Any]]] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._conn, args=(conn,), daemon=True).start()

    def _conn(self, conn: socket.socket) -> None:
        hellos = 0
        try:
            while True:
                head_bytes = recv_exact(conn, HEADER_SIZE)
                head = decode_header(head_bytes)
                meta_bytes = recv_exact(conn, head.meta_len)
                payload = recv_exact(conn, head.payload_len)
                self.received += head_bytes + meta_bytes + payload
                meta = decode_meta(meta_bytes)
                self.frames.append((head.type, meta))
                sid, reply = head.stream_id, Flag.REPLY
                if head.type is FrameType.HELLO:
                    hellos += 1
                    answer = self.challenge if hellos == 1 and self.challenge else HELLO_REPLY
                    conn.sendall(encode_frame(FrameType.HELLO, sid, answer, 0, reply))
                elif head.type is FrameType.PUT:
                    results = [{"code": 0} for _ in meta["items"]]
                    conn.sendall(encode_frame(FrameType.PUT, sid, {"results": results}, 0, reply))
                elif head.type is FrameType.GET:
                    items = [{"code": 0, "len": len(FORGED), "meta": {}} for _ in meta["keys"]]
                    n = len(FORGED) * len(items)
                    conn.sendall(encode_frame(FrameType.GET, sid, {"items": items}, n, reply))
                    conn.sendall(FORGED * len(items))
                else:
                    conn.sendall(encode_frame(head.type, sid, None, 0, reply))
        except (ConnectionError, OSError, WireError):
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self.sock.close()


#: how the impostor answers the first HELLO: as a sidecar's final reply (as if it needed no
#: proof), with a challenge whose proof it made up, or with a well-formed but wrong proof
ANSWERS: dict[str, dict[str, Any] | None] = {
    "reply": None,
    "made-up-proof": {"nonce": "ab" * 32, "proof": "00" * 32},
    "other-token": {
        "nonce": "cd" * 32,
        "proof": handshake.proof(
            "another-token",
            "server",
            role="data",
            engine="engine-1",
            tid=handshake.token_id(TOKEN),
            client_nonce="00" * 32,
            server_nonce="cd" * 32,
        ),
    },
}


@pytest.fixture(params=[(t, a) for t in ("tcp", "unix") for a in ANSWERS], ids=str)
def impostor(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Impostor]:
    transport, answer = request.param
    address = None if transport == "tcp" else str(tmp_path / "data.sock")
    fake = Impostor(address, ANSWERS[answer])
    yield fake
    fake.close()


def _use(impostor: Impostor, act: str) -> Any:
    client = WireClient(impostor.endpoint, engine_id="engine-1", token=TOKEN, timeout=2)
    try:
        if act == "put":
            return client.put(KEY, b"user prompt KV " * 100)
        if act == "get":
            return client.get(KEY)
        return client.ping()
    finally:
        client.close()


@pytest.mark.parametrize("act", ["ping", "put", "get"])
def test_an_impostor_gets_no_token_no_bytes_and_serves_nothing(
    impostor: Impostor, act: str
) -> None:
    with pytest.raises(WireError, match="did not prove it holds the engine token") as refused:
        _use(impostor, act)
    assert refused.value.error is ErrorCode.UNAUTHENTICATED
    received = bytes(impostor.received)
    assert TOKEN.encode() not in received, "the engine token was handed to an impostor"
    assert b"user prompt KV" not in received, "plaintext KV bytes went to an impostor"
    # it saw one HELLO naming a token id, and nothing after it
    assert [t for t, _ in impostor.frames] == [FrameType.HELLO]
    (hello,) = (m for _, m in impostor.frames)
    assert "token" not in hello
    assert hello["token_id"] == handshake.token_id(TOKEN) != TOKEN


#: who the impostor of the token-less tests runs as: not the engine's uid, not root
NOBODY = 65534


def _impostor_as(uid: int, address: str, out: str, ready: Any, stop: Any) -> None:
    """A child process: become ``uid``, listen at ``address`` (the kernel remembers who
    listened: what ``SO_PEERCRED`` tells a client), answer as a sidecar that needs no token
    would, and write every byte received to ``out`` when told to stop."""
    os.setgid(uid)
    os.setuid(uid)
    fake = Impostor(address, None)
    ready.set()
    stop.wait(30)
    Path(out).write_bytes(bytes(fake.received))
    fake.close()


@pytest.fixture
def foreign_impostor() -> Iterator[tuple[str, Callable[[], bytes]]]:
    """A Unix-socket impostor of another uid where a token-less sidecar would listen: its
    address, and a call that stops it and returns what it received."""
    if os.getuid() != 0:
        pytest.skip("needs root, to run the impostor as another uid")
    ctx = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp).chmod(0o777)  # the other uid must create its socket here
        address, out = str(Path(tmp) / "data.sock"), str(Path(tmp) / "received")
        ready, stop = ctx.Event(), ctx.Event()
        child = ctx.Process(target=_impostor_as, args=(NOBODY, address, out, ready, stop))
        child.start()
        try:
            assert ready.wait(10), "the impostor did not start"

            def received() -> bytes:
                stop.set()
                child.join(10)
                return Path(out).read_bytes()

            yield f"unix://{address}", received
        finally:
            stop.set()
            child.join(10)
            if child.is_alive():
                child.kill()


@pytest.mark.parametrize("act", ["ping", "put", "get"])
def test_without_tokens_an_impostor_of_another_uid_gets_nothing(
    foreign_impostor: tuple[str, Callable[[], bytes]], act: str
) -> None:
    """Review s10: without engine tokens (a Unix socket, the sidecar admitting the engine by
    its uid) the engine had no way to tell the sidecar from whoever took the socket's path:
    it sent its HELLO, the plaintext of its puts, and took forged hits. Now it asks the
    kernel who listens there, and a process that is neither the engine's uid nor root (nor a
    configured ``kvgov.sidecar_uids``) gets not one byte."""
    endpoint, received = foreign_impostor
    client = WireClient(endpoint, engine_id="engine-1", timeout=2)
    try:
        with pytest.raises(WireError, match=f"runs as uid {NOBODY}") as refused:
            if act == "put":
                client.put(KEY, b"user prompt KV " * 100)
            elif act == "get":
                client.get(KEY)
            else:
                client.ping()
    finally:
        client.close()
    assert refused.value.error is ErrorCode.UNAUTHENTICATED
    assert received() == b"", "bytes went to a process that is not the sidecar"


def test_a_sidecar_running_as_a_named_uid_is_accepted_without_tokens(
    foreign_impostor: tuple[str, Callable[[], bytes]],
) -> None:
    """The control: where the sidecar runs as another uid (``kvgov.sidecar_uids``), the same
    peer is spoken to (here it is the fake, which takes the put)."""
    endpoint, received = foreign_impostor
    with WireClient(endpoint, engine_id="engine-1", timeout=2, sidecar_uids=[NOBODY]) as client:
        client.put(KEY, b"user prompt KV " * 100)
    assert b"user prompt KV" in received()

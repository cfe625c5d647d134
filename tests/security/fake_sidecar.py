"""A fake kvgov sidecar for the engine-side attack tests: a loopback listener that speaks just
enough of the wire protocol to be taken for the sidecar (what a wedged, malicious or
impostor sidecar could send), so the client's and the connector's bounds can be tested.

It answers a plain HELLO (the tests use no engine token) and hands every other request to
``handler(conn, header, meta, payload)``; ``hello`` replaces the HELLO answer. Every thread it
starts ends when :meth:`FakeSidecar.close` is called (a drip stops at once).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from kvgov.wire.codec import (
    HEADER_SIZE,
    Flag,
    FrameHeader,
    FrameType,
    decode_header,
    decode_meta,
    encode_frame,
)
from tests.integration.live import recv_exact

HELLO_REPLY: dict[str, Any] = {
    "server": "kvgov",
    "version": "test",
    "protocol": 1,
    "sidecar": "fake",
    "engine": "engine-test",
    "max_frame_bytes": 1 << 30,
    "max_batch": 4096,
    "features": [],
}

Handler = Callable[[socket.socket, FrameHeader, dict[str, Any], bytes], None]


def read_frame(
    sock: socket.socket, *, payload: bool = True
) -> tuple[FrameHeader, dict[str, Any], bytes]:
    header = decode_header(recv_exact(sock, HEADER_SIZE))
    meta = decode_meta(recv_exact(sock, header.meta_len)) if header.meta_len else {}
    body = recv_exact(sock, header.payload_len) if payload and header.payload_len else b""
    return header, meta, body


def reply(
    ftype: FrameType, stream_id: int, meta: dict[str, Any] | None, payload_len: int = 0
) -> bytes:
    """A reply frame's header and metadata (its payload, if any, is the caller's to send)."""
    return encode_frame(ftype, stream_id, meta, payload_len, Flag.REPLY)


class FakeSidecar:
    def __init__(
        self,
        handler: Handler | None = None,
        *,
        hello: Callable[[socket.socket, FrameHeader], None] | None = None,
        read_payloads: bool = True,
    ) -> None:
        self.handler = handler
        self.hello = hello
        self.read_payloads = read_payloads
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.05)
        self.stop = threading.Event()
        #: connections accepted so far (a client that reuses a broken connection opens none)
        self.accepted = 0
        #: (type, metadata) of every request received after HELLO
        self.requests: list[tuple[FrameType, dict[str, Any]]] = []
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    @property
    def endpoint(self) -> str:
        host, port = self.listener.getsockname()[:2]
        return f"tcp://{host}:{port}"

    def drip(self, conn: socket.socket, data: bytes, every_s: float) -> None:
        """Send ``data`` one byte every ``every_s`` seconds (until closed)."""
        for i in range(len(data)):
            if self.stop.wait(every_s):
                return
            conn.sendall(data[i : i + 1])

    def close(self) -> None:
        self.stop.set()
        with self._lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for thread in list(self._threads):
            thread.join(5)
        for conn in conns:
            conn.close()
        self.listener.close()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(None)
            with self._lock:
                if self.stop.is_set():
                    conn.close()
                    return
                self.accepted += 1
                self._conns.append(conn)
                thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
                self._threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        # whatever a test's client does (closes mid-frame, times out), this thread just ends
        with contextlib.suppress(Exception):
            header, _, _ = read_frame(conn)
            if self.hello is not None:
                self.hello(conn, header)
            else:
                conn.sendall(reply(FrameType.HELLO, header.stream_id, HELLO_REPLY))
            while not self.stop.is_set():
                header, meta, body = read_frame(conn, payload=self.read_payloads)
                self.requests.append((header.type, meta))
                if self.handler is None:
                    continue
                self.handler(conn, header, meta, body)


@contextlib.contextmanager
def fake_sidecar(handler: Handler | None = None, **kwargs: Any) -> Iterator[FakeSidecar]:
    fake = FakeSidecar(handler, **kwargs)
    try:
        yield fake
    finally:
        fake.close()


def bounded(fn: Callable[[], Any], limit_s: float) -> tuple[Any, float]:
    """Run ``fn`` in a thread; its result (or the exception it raised) and how long it took.
    Fails the test if it is still running after ``limit_s`` (the thread is left to end when
    the fake sidecar closes)."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # handed to the test
            out.append(exc)

    start = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit_s)
    took = time.monotonic() - start
    if thread.is_alive():
        raise AssertionError(f"still blocked after {took:.1f}s (limit {limit_s}s)")
    return out[0], took

"""One blocking connection to a kvgov sidecar: connect, HELLO, send a frame, read a reply.

Private to :mod:`kvgov.wire.client`. A connection is used by one thread at a time (the client's
pool hands it out); any socket error or timeout closes it, because its framing state is lost.

An operation is bounded by one monotonic deadline (:meth:`Connection.arm`), from its request
being sent to its reply fully read: before each send and receive the socket's timeout is set
to what is left of it, so a peer that drips a reply byte by byte, or announces more than it
sends, costs at most that long (:class:`WireTimeoutError`, the connection closed). A reply's payload
is capped at what the request allows (``max_payload``): a longer one is a protocol error.

Without an engine token, a Unix-socket peer is checked by the kernel's word for who it is
(``SO_PEERCRED``) before anything is sent to it: it must run as one of ``sidecar_uids``
(default: this process's uid or root, the rule by which the sidecar admits a token-less engine),
so a process of another uid that took the socket's path learns nothing, not even the engine id.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from kvgov.wire import handshake
from kvgov.wire.codec import (
    FEATURES,
    HEADER_SIZE,
    MAX_STREAM_ID,
    PROTOCOL_VERSION,
    ErrorCode,
    Flag,
    FrameHeader,
    FrameType,
    WireConnectionError,
    WireError,
    decode_header,
    decode_meta,
    encode_frame,
    error_from_meta,
    widen_unix_send_buffer,
)
from kvgov.wire.messages import ServerInfo

Buffer = bytes | bytearray | memoryview

_DISCARD_CHUNK = 1 << 20


class WireTimeoutError(WireConnectionError):
    """An operation's deadline passed before its reply was fully read (or its request sent):
    the connection is closed, its framing state being unknown."""

    code = "wire_timeout"


def parse_address(address: str) -> tuple[int, Any]:
    """``tcp://host:port``, ``host:port`` or ``unix:///path`` -> (family, sockaddr)."""
    if address.startswith("unix:"):
        path = address[len("unix:") :]
        while path.startswith("//"):
            path = path[1:]
        if not path:
            raise ValueError("unix address needs a path")
        return socket.AF_UNIX, path
    if address.startswith("tcp://"):
        address = address[len("tcp://") :]
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"bad sidecar address {address!r}: expected tcp://host:port or unix:///p")
    return socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET, (
        host.strip("[]"),
        int(port),
    )


def as_bytes_view(data: Buffer | Any) -> memoryview:
    """A flat byte view of any C-contiguous buffer (bytes, bytearray, numpy, torch storage)."""
    view = memoryview(data)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


class Connection:
    def __init__(self, address: str, *, connect_timeout: float, timeout: float) -> None:
        family, sockaddr = parse_address(address)
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.settimeout(connect_timeout)
            sock.connect(sockaddr)
            sock.settimeout(timeout)
            if family != socket.AF_UNIX:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            widen_unix_send_buffer(sock)  # puts: what may be in flight to the sidecar
        except OSError as exc:
            sock.close()
            raise WireConnectionError(
                ErrorCode.INTERNAL, f"cannot connect to sidecar at {address}: {exc}"
            ) from exc
        self.sock = sock
        self.closed = False
        #: the running operation's deadline (``time.monotonic()``), None between operations
        self._deadline: float | None = None
        self._budget = timeout
        self._next_id = 0
        self._hdr = bytearray(HEADER_SIZE)
        self.info: ServerInfo | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()

    def hello(
        self,
        engine_id: str,
        token: str | None,
        role: str,
        *,
        sidecar_uids: Collection[int] | None = None,
    ) -> ServerInfo:
        if token is None:
            self._check_peer_uid(sidecar_uids)
        meta: dict[str, Any] = {
            "version": PROTOCOL_VERSION,
            "engine": engine_id,
            "role": role,
            "client": "kvgov-python",
            "features": sorted(FEATURES),
        }
        if token is not None:
            reply = self._prove(meta, token)
        else:
            _, reply = self.call(FrameType.HELLO, meta)
        try:
            info = ServerInfo.from_reply(reply)
        except WireError:
            self.close()
            raise
        self.info = info
        return info

    def _check_peer_uid(self, sidecar_uids: Collection[int] | None) -> None:
        """Token-less, over a Unix socket: refuse a peer that does not run as one of
        ``sidecar_uids`` (None: this process's uid or root) before sending it anything."""
        if self.sock.family != socket.AF_UNIX or not hasattr(socket, "SO_PEERCRED"):
            return  # TCP: nothing to check without a token (development only)
        allowed = set(sidecar_uids) if sidecar_uids is not None else {os.getuid(), 0}
        creds = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
        uid = struct.unpack("iII", creds)[1]  # pid, uid, gid: uids are unsigned
        if uid not in allowed:
            self.close()
            raise WireError(
                ErrorCode.UNAUTHENTICATED,
                f"the process at the sidecar's socket runs as uid {uid}, not as the sidecar's"
                f" ({', '.join(str(u) for u in sorted(allowed))})",
                hint="check what listens on the sidecar's socket, or set kvgov.sidecar_uids"
                " (better: engine tokens)",
            )

    # -- deadline ------------------------------------------------------------------------------

    def arm(self, timeout: float) -> None:
        """Start an operation: every send and receive until :meth:`disarm` must be done within
        ``timeout`` seconds from now, or :class:`WireTimeoutError` is raised (connection closed)."""
        self._budget = timeout
        self._deadline = time.monotonic() + timeout

    def disarm(self) -> None:
        """End the operation: later reads (a control connection idling) have no deadline."""
        self._deadline = None

    def _time_left(self) -> None:
        """Bound the next socket call by what is left of the deadline (if any)."""
        if self._deadline is None:
            return
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        self.sock.settimeout(left)

    def _timed_out(self, what: str) -> WireTimeoutError:
        self.close()
        return WireTimeoutError(
            ErrorCode.INTERNAL, f"timed out: {what} not complete within {self._budget:g}s"
        )

    def _prove(self, meta: dict[str, Any], token: str) -> dict[str, Any]:
        """The token handshake (:mod:`kvgov.wire.handshake`): name the token and send a nonce;
        the sidecar must prove it holds the token before the engine proves it does, and
        before anything else is sent. A peer that cannot (whoever took the sidecar's port or
        socket) is refused: the connection is closed and nothing more reaches it."""
        first, answer = handshake.start(token, meta)
        _, challenge = self.call(FrameType.HELLO, first)
        mine = answer(challenge)
        if mine is None:
            self.close()
            raise WireError(
                ErrorCode.UNAUTHENTICATED,
                "the peer did not prove it holds the engine token: it is not the sidecar",
                hint="check what listens on the sidecar's address (dataplane.host/unix_path)",
            )
        _, reply = self.call(FrameType.HELLO, mine)
        return reply

    # -- frames --------------------------------------------------------------------------------

    def new_stream_id(self) -> int:
        self._next_id = self._next_id + 1 if self._next_id < MAX_STREAM_ID else 1
        return self._next_id

    def send(
        self,
        ftype: FrameType,
        stream_id: int,
        meta: Mapping[str, Any] | None,
        payloads: Sequence[memoryview] = (),
        flags: Flag = Flag.NONE,
    ) -> None:
        total = sum(p.nbytes for p in payloads)
        head = encode_frame(ftype, stream_id, meta, total, flags)
        try:
            self._time_left()  # sendall's timeout bounds the whole call, not each send
            if payloads and len(head) + payloads[0].nbytes <= 64 * 1024:
                # small items: one syscall for header and first payload
                self.sock.sendall(head + payloads[0])
                rest: Sequence[memoryview] = payloads[1:]
            else:
                self.sock.sendall(head)
                rest = payloads
            for part in rest:
                self._time_left()
                self.sock.sendall(part)
        except TimeoutError:
            raise self._timed_out("request to the sidecar") from None
        except OSError as exc:
            self.close()
            raise WireConnectionError(ErrorCode.INTERNAL, f"send failed: {exc}") from exc

    def recv_exact(self, view: memoryview) -> None:
        got = 0
        n = view.nbytes
        sock = self.sock
        try:
            while got < n:
                if self._deadline is not None:
                    self._time_left()
                k = sock.recv_into(view[got:], n - got)
                if k == 0:
                    raise WireConnectionError(ErrorCode.INTERNAL, "sidecar closed the connection")
                got += k
        except TimeoutError:
            raise self._timed_out("sidecar reply") from None
        except OSError as exc:
            self.close()
            raise WireConnectionError(ErrorCode.INTERNAL, f"receive failed: {exc}") from exc
        except WireConnectionError:
            self.close()
            raise

    def discard(self, n: int) -> None:
        scratch = memoryview(bytearray(min(n, _DISCARD_CHUNK)))
        while n > 0:
            step = min(n, scratch.nbytes)
            self.recv_exact(scratch[:step])
            n -= step

    def read_frame(self) -> tuple[FrameHeader, dict[str, Any]]:
        """Read a header and its metadata; the caller then reads ``payload_len`` bytes."""
        self.recv_exact(memoryview(self._hdr))
        try:
            header = decode_header(self._hdr)
        except WireError:
            self.close()
            raise
        body = bytearray(header.meta_len)
        if header.meta_len:
            self.recv_exact(memoryview(body))
        try:
            meta = decode_meta(body)
        except WireError:
            self.close()
            raise
        return header, meta

    def read_reply(
        self, ftype: FrameType, stream_id: int, max_payload: int = 0
    ) -> tuple[FrameHeader, dict[str, Any]]:
        """Read the reply to ``stream_id``. A payload over ``max_payload`` bytes (what the
        request allows: none but a GET's hits) is a protocol error: the connection is closed
        before any of it is read."""
        header, meta = self.read_frame()
        if header.payload_len > max_payload:
            self.close()
            raise WireError(
                ErrorCode.TOO_LARGE,
                f"reply payload of {header.payload_len} bytes, over the {max_payload} allowed",
            )
        if header.stream_id != stream_id and not (
            header.type is FrameType.ERROR and header.stream_id == 0
        ):
            self.close()
            raise WireError(ErrorCode.BAD_FRAME, "reply for another stream")
        if header.type is FrameType.ERROR:
            if header.payload_len:
                self.discard(header.payload_len)
            error = error_from_meta(meta)
            if error.fatal or header.stream_id == 0:
                self.close()
            raise error
        if header.type is not ftype or not header.is_reply:
            self.close()
            raise WireError(ErrorCode.BAD_FRAME, "unexpected reply type")
        return header, meta

    def call(
        self,
        ftype: FrameType,
        meta: Mapping[str, Any] | None,
        payloads: Sequence[memoryview] = (),
        *,
        max_payload: int = 0,
    ) -> tuple[FrameHeader, dict[str, Any]]:
        """Send a request and read the reply's header and metadata (payload left unread, at
        most ``max_payload`` bytes)."""
        stream_id = self.new_stream_id()
        self.send(ftype, stream_id, meta, payloads)
        return self.read_reply(ftype, stream_id, max_payload)

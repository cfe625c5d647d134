"""The engine side of the control connection: EVICT (purge) messages in, EVICT_ACK out.

``ControlChannel`` (opened with :meth:`kvgov.wire.client.WireClient.control`) holds a
``role=control`` connection in a background thread. An EVICT names entries by their keyed
digests (never raw keys); the sidecar's HELLO reply on that connection carries the key-digest
key, so the callback gets an :class:`~kvgov.wire.messages.EvictRequest` that recognises the
named entries among the engine's own local keys, removes them, and returns the digests it
removed; the channel answers EVICT_ACK with those. See ``docs/protocol.md``.

The channel waits for the sidecar with no deadline (it speaks only during a purge), but a frame,
once its first byte arrived, must arrive whole (header and metadata, the codec capping the
metadata at ``MAX_META_BYTES``) within the client's ``timeout``, and its answer be sent within
it too (the data path's one deadline per operation, :meth:`Connection.arm`). A control frame
carries no payload: one that announces any is a protocol error, never read. Either way the
connection is closed (its framing state is lost) and the channel reconnects, so a sidecar (or
whoever took its address) that starts a frame and stalls, drips it, or announces gigabytes
cannot hold the control thread, and with it every later purge of this engine.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from kvgov.wire._conn import Connection
from kvgov.wire.codec import ErrorCode, Flag, FrameType, WireConnectionError, WireError
from kvgov.wire.messages import EvictRequest, parse_evict

#: what an engine does with an EVICT: remove the named entries, return the digests removed
EvictCallback = Callable[[EvictRequest], Iterable[str]]


class Connector(Protocol):
    """What the channel needs of :class:`kvgov.wire.client.WireClient`: a HELLO-authenticated
    connection in the given role, and the deadline of one operation (a frame read or sent)."""

    @property
    def timeout(self) -> float: ...

    def _connect(self, *, role: str = ...) -> Connection: ...


log = logging.getLogger("kvgov.wire.client")


class ControlChannel:
    """A background thread holding a ``role=control`` connection: EVICT in, EVICT_ACK out.

    It reconnects after a failure (every ``reconnect_delay`` seconds) until :meth:`close`.
    ``connected`` is set while a HELLO-authenticated connection is up.
    """

    def __init__(
        self, client: Connector, on_evict: EvictCallback, *, reconnect_delay: float = 1.0
    ) -> None:
        self._client = client
        self._on_evict = on_evict
        self._delay = reconnect_delay
        self._stop = threading.Event()
        self.connected = threading.Event()
        self._conn: Connection | None = None
        self._thread = threading.Thread(target=self._loop, name="kvgov-control", daemon=True)
        self.evictions = 0

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        conn = self._conn
        if conn is not None:
            conn.close()
        self._thread.join(timeout)

    def _loop(self) -> None:
        # The thread must not end while the channel is open: whatever a peer sends (or a bug
        # raises), the connection is dropped and the channel reconnects. An exception that is
        # not a WireError is logged by its type alone: its text may quote what the peer sent.
        while not self._stop.is_set():
            try:
                conn = self._client._connect(role="control")
            except WireError as exc:
                log.warning("wire.control.connect_failed", extra={"error": exc.error.name})
                self._stop.wait(self._delay)
                continue
            except Exception as exc:  # noqa: BLE001 - never ends the thread; type only
                log.warning("wire.control.lost", extra={"error": type(exc).__name__})
                self._stop.wait(self._delay)
                continue
            self._conn = conn
            self.connected.set()
            try:
                self._serve(conn)
            except WireError as exc:
                if not self._stop.is_set():  # what failed, never what the frame said
                    log.warning(
                        "wire.control.lost", extra={"error": exc.error.name, "reason": exc.code}
                    )
            except Exception as exc:  # noqa: BLE001 - never ends the thread; type only
                if not self._stop.is_set():
                    log.warning("wire.control.lost", extra={"error": type(exc).__name__})
            finally:
                self.connected.clear()
                conn.close()
                self._conn = None
            self._stop.wait(self._delay)

    def _serve(self, conn: Connection) -> None:
        timeout = self._client.timeout
        while not self._stop.is_set():
            _await_frame(conn)  # idle until the sidecar speaks: no deadline
            conn.arm(timeout)  # from its first byte, the whole frame within the timeout
            try:
                header, meta = conn.read_frame()
                if header.payload_len:  # none is sent here: refused unread, not discarded
                    conn.close()
                    raise WireError(
                        ErrorCode.TOO_LARGE,
                        f"{header.type.name} frame with a payload on the control connection",
                    )
            finally:
                conn.disarm()
            if header.type is FrameType.PING and not header.is_reply:
                self._answer(conn, FrameType.PING, header.stream_id, None, Flag.REPLY)
            elif header.type is FrameType.EVICT and not header.is_reply:
                ack = self._evict(conn, meta)
                self._answer(conn, FrameType.EVICT_ACK, header.stream_id, ack)
            # nothing else is expected; ignore rather than tear the channel down

    def _answer(
        self,
        conn: Connection,
        ftype: FrameType,
        stream_id: int,
        meta: dict[str, Any] | None,
        flags: Flag = Flag.NONE,
    ) -> None:
        """Send a frame within the timeout (as a request is: the callback's time apart)."""
        conn.arm(self._client.timeout)
        try:
            conn.send(ftype, stream_id, meta, flags=flags)
        finally:
            conn.disarm()

    def _evict(self, conn: Connection, meta: dict[str, Any]) -> dict[str, Any]:
        """Run the callback for one EVICT; the EVICT_ACK's metadata."""
        self.evictions += 1
        digests = frozenset(parse_evict(meta))
        digester = conn.info.digester if conn.info is not None else None
        if digester is None:  # the sidecar did not give this connection its digest key
            log.warning("wire.control.evict_without_digest_key")
            return {"removed": [], "error": "no_digest_key"}
        if not digests:
            return {"removed": []}
        job = meta.get("job")
        request = EvictRequest(
            digests,
            digester,
            reason=str(meta.get("reason") or "purge"),
            job=job if isinstance(job, str) else None,
        )
        try:
            # only digests it was asked for, each once, in a stable order
            removed = sorted(set(self._on_evict(request)) & digests)
        except Exception as exc:  # the callback is the engine's code; report, keep serving
            log.exception("wire.control.evict_failed")
            return {"removed": [], "error": type(exc).__name__}
        return {"removed": removed}


def _await_frame(conn: Connection) -> None:
    """Block, with no deadline, until the next frame's first byte has arrived (left unread).

    Raises :class:`WireConnectionError` (connection closed) if the sidecar closes it or the
    socket fails, or :meth:`ControlChannel.close` closed it."""
    try:
        conn.sock.settimeout(None)
        first = conn.sock.recv(1, socket.MSG_PEEK)
    except OSError as exc:
        conn.close()
        raise WireConnectionError(ErrorCode.INTERNAL, f"receive failed: {exc}") from exc
    if not first:
        conn.close()
        raise WireConnectionError(ErrorCode.INTERNAL, "sidecar closed the connection")

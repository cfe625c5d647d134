"""The engine-side client of the kvgov wire protocol (blocking sockets, thread-safe, stdlib only).

``WireClient`` keeps a small pool of authenticated connections; each call takes one, sends a
request frame, reads the reply and gives the connection back, so calls from several threads run
in parallel and a connection is never shared mid-frame. Payloads are sent from the caller's
buffers and received straight into the caller's buffers (``get_into`` / ``alloc``): no copies.
``put_stream`` pipelines PUT frames on one connection (several in flight, acks read in order)
so that the sidecar's ledger commits overlap the transfers.

``timeout`` bounds each operation as a whole, from its request being sent to its reply fully
read (one deadline, not a per-read timeout): a sidecar that answers too slowly, drips its reply
or announces bytes it never sends raises :class:`WireTimeoutError` and that connection is closed,
never reused mid-frame. A reply carrying more payload than its request allows (a GET: at most
the HELLO's ``max_frame_bytes`` and the caller's ``max_bytes``; any other reply: none) is a
protocol error (``TOO_LARGE``), and the connection is closed before any of it is read.

``control()`` opens a :class:`~kvgov.wire.control.ControlChannel`: a dedicated connection on
which the sidecar sends EVICT (purge) messages, answered with EVICT_ACK.
See ``docs/protocol.md``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

from kvgov.wire._conn import Buffer, Connection, WireTimeoutError, as_bytes_view
from kvgov.wire.codec import (
    ErrorCode,
    FrameType,
    WireConnectionError,
    WireError,
)
from kvgov.wire.control import ControlChannel, EvictCallback
from kvgov.wire.messages import (
    EMPTY_CONTEXT,
    GetResult,
    PutAck,
    PutItem,
    RequestContext,
    ServerInfo,
)

log = logging.getLogger("kvgov.wire.client")

__all__ = ["Allocator", "WireClient", "WireTimeoutError"]

#: ``alloc(result) -> writable buffer of at least result.length bytes`` (or None to skip it)
Allocator = Callable[[GetResult], Any]


class WireClient:
    """Blocking, thread-safe client. Every method raises :class:`WireError` on failure
    (:class:`WireConnectionError` when the sidecar cannot be reached, :class:`WireTimeoutError` when
    an operation is not done within ``timeout``); an engine-side connector turns those into
    misses (fail closed). Any other exception raised during a request (the caller's ``alloc``
    or ``items`` failing, a bug) drops that connection and is raised as ``WireError``
    (``INTERNAL``, naming its type) with the original as its ``__cause__``."""

    def __init__(
        self,
        address: str,
        *,
        engine_id: str,
        token: str | None = None,
        timeout: float = 10.0,
        connect_timeout: float = 2.0,
        pool_size: int = 4,
        sidecar_uids: Collection[int] | None = None,
    ) -> None:
        if pool_size < 1:
            raise ValueError("pool_size must be at least 1")
        self.address = address
        self.engine_id = engine_id
        self._token = token
        #: without a token, the uids a Unix-socket sidecar may run as (None: ours or root)
        self._sidecar_uids = frozenset(sidecar_uids) if sidecar_uids is not None else None
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self._idle: queue.LifoQueue[Connection] = queue.LifoQueue()
        self._slots = threading.BoundedSemaphore(pool_size)
        self._closing = threading.Event()
        self.info: ServerInfo | None = None

    # -- pool ----------------------------------------------------------------------------------

    def _connect(self, role: str = "data") -> Connection:
        conn = Connection(self.address, connect_timeout=self.connect_timeout, timeout=self.timeout)
        try:
            conn.arm(self.timeout)  # the HELLO exchange is one operation
            self.info = conn.hello(
                self.engine_id, self._token, role, sidecar_uids=self._sidecar_uids
            )
        except BaseException:
            conn.close()
            raise
        finally:
            conn.disarm()
        return conn

    def _run(self, fn: Callable[[Connection], Any]) -> Any:
        if self._closing.is_set():
            raise WireConnectionError(ErrorCode.INTERNAL, "client is closed")
        if not self._slots.acquire(timeout=self.timeout):
            raise WireError(ErrorCode.BUSY, "no free connection in the client pool")
        conn: Connection | None = None
        try:
            try:
                conn = self._idle.get_nowait()
            except queue.Empty:
                conn = self._connect()
            conn.arm(self.timeout)
            try:
                return fn(conn)
            finally:
                conn.disarm()
        except WireError:
            raise  # the operation closed the connection if its framing state is lost
        except BaseException as exc:
            # anything else (a bug, the caller's allocator or items failing): where the
            # connection's framing stands is unknown, so it is dropped, never pooled
            if conn is not None:
                conn.close()
            if not isinstance(exc, Exception):
                raise  # KeyboardInterrupt, SystemExit: as they are
            raise WireError(ErrorCode.INTERNAL, f"request failed: {type(exc).__name__}") from exc
        finally:
            if conn is not None and not conn.closed:
                if self._closing.is_set():
                    conn.close()
                else:
                    self._idle.put(conn)
            self._slots.release()

    def close(self) -> None:
        self._closing.set()
        while True:
            try:
                self._idle.get_nowait().close()
            except queue.Empty:
                return

    def __enter__(self) -> WireClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- operations ----------------------------------------------------------------------------

    def hello(self) -> ServerInfo:
        """Connect (if needed) and return what the sidecar said in HELLO."""

        def op(conn: Connection) -> ServerInfo:
            if conn.info is None:
                raise WireError(ErrorCode.INTERNAL, "connection without HELLO")
            return conn.info

        result: ServerInfo = self._run(op)
        return result

    def ping(self) -> float:
        """Round-trip time of a PING, in seconds."""

        def op(conn: Connection) -> float:
            start = time.perf_counter()
            conn.call(FrameType.PING, None)
            return time.perf_counter() - start

        result: float = self._run(op)
        return result

    def exists(self, key: str, ctx: RequestContext | None = None) -> bool:
        return self.exists_many([key], ctx)[0]

    def exists_many(self, keys: Sequence[str], ctx: RequestContext | None = None) -> list[bool]:
        found = self._keys_call(FrameType.EXISTS, keys, ctx, "found")
        return [bool(x) for x in found]

    def remove(self, key: str, ctx: RequestContext | None = None) -> bool:
        return self.remove_many([key], ctx)[0]

    def remove_many(self, keys: Sequence[str], ctx: RequestContext | None = None) -> list[bool]:
        removed = self._keys_call(FrameType.REMOVE, keys, ctx, "removed")
        return [bool(x) for x in removed]

    def _keys_call(
        self, ftype: FrameType, keys: Sequence[str], ctx: RequestContext | None, field: str
    ) -> list[Any]:
        if not keys:
            return []
        meta = {"keys": list(keys), "ctx": (ctx or EMPTY_CONTEXT).to_meta()}

        def op(conn: Connection) -> list[Any]:
            _, reply = conn.call(ftype, meta)
            values = reply.get(field)
            if not isinstance(values, list) or len(values) != len(keys):
                conn.close()
                raise WireError(ErrorCode.BAD_FRAME, f"malformed {ftype.name} reply")
            return values

        result: list[Any] = self._run(op)
        return result

    def put(
        self,
        key: str,
        data: Buffer | Any,
        ctx: RequestContext | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> PutAck:
        """Store one value; the ack says whether the sidecar stored it (and why not)."""
        return self.put_many([(key, data, meta)], ctx)[0]

    def put_many(
        self,
        items: Sequence[
            tuple[str, Buffer | Any] | tuple[str, Buffer | Any, Mapping[str, Any] | None]
        ],
        ctx: RequestContext | None = None,
    ) -> list[PutAck]:
        """Store several values in one frame; one ack per item, in order."""
        if not items:
            return []
        views: list[memoryview] = []
        put_items: list[dict[str, Any]] = []
        for entry in items:
            key, data = entry[0], entry[1]
            item_meta = entry[2] if len(entry) > 2 else None
            view = as_bytes_view(data)
            views.append(view)
            put_items.append(PutItem(key, view.nbytes, item_meta or {}).to_meta())
        meta = {"items": put_items, "ctx": (ctx or EMPTY_CONTEXT).to_meta()}

        def op(conn: Connection) -> list[PutAck]:
            stream_id = conn.new_stream_id()
            conn.send(FrameType.PUT, stream_id, meta, views)
            _, reply = conn.read_reply(FrameType.PUT, stream_id)
            results = reply.get("results")
            if not isinstance(results, list) or len(results) != len(items):
                conn.close()
                raise WireError(ErrorCode.BAD_FRAME, "malformed PUT reply")
            return [_ack(entry[0], r) for entry, r in zip(items, results, strict=True)]

        result: list[PutAck] = self._run(op)
        return result

    def put_stream(
        self,
        items: Iterable[
            tuple[str, Buffer | Any] | tuple[str, Buffer | Any, Mapping[str, Any] | None]
        ],
        ctx: RequestContext | None = None,
        *,
        depth: int = 4,
    ) -> list[PutAck]:
        """Store values one PUT frame each, pipelined on one connection: up to ``depth``
        frames are sent before the oldest ack is read, so the sidecar's ledger commits overlap
        the transfers. One ack per item, in order. On any failure the connection is dropped
        (which of the unacknowledged puts were stored is then unknown) and the error raised.

        ``items`` is read one item ahead, so that every frame but the last tells the sidecar
        more follow (``docs/protocol.md``): an iterator that produces its items slowly has
        each frame sent once the next item is there (or it is exhausted).

        ``timeout`` bounds each frame: from its send to the read of the ack it waits for (the
        oldest), and each ack read once all are sent."""
        if depth < 1:
            raise ValueError("depth must be at least 1")
        ctx_meta = (ctx or EMPTY_CONTEXT).to_meta()

        def op(conn: Connection) -> list[PutAck]:
            acks: list[PutAck] = []
            waiting: deque[tuple[int, str]] = deque()
            ahead = iter(items)
            following = next(ahead, None)
            try:
                while following is not None:
                    entry, following = following, next(ahead, None)
                    key, view = entry[0], as_bytes_view(entry[1])
                    item_meta = entry[2] if len(entry) > 2 else None
                    item = PutItem(key, view.nbytes, item_meta or {})
                    stream_id = conn.new_stream_id()
                    meta: dict[str, Any] = {"items": [item.to_meta()], "ctx": ctx_meta}
                    if depth > 1 and following is not None:
                        # another frame follows before this one's reply is read (the last
                        # does not say so: the sidecar then syncs its journal at once)
                        meta["more"] = True
                    conn.arm(self.timeout)
                    conn.send(FrameType.PUT, stream_id, meta, [view])
                    waiting.append((stream_id, key))
                    if len(waiting) >= depth:
                        acks.append(_read_put_ack(conn, *waiting.popleft()))
                while waiting:
                    conn.arm(self.timeout)
                    acks.append(_read_put_ack(conn, *waiting.popleft()))
            except BaseException:
                if waiting:
                    conn.close()
                raise
            return acks

        result: list[PutAck] = self._run(op)
        return result

    def get_into(
        self, key: str, buffer: Buffer | Any, ctx: RequestContext | None = None
    ) -> GetResult | None:
        """Read a value straight into ``buffer``; None on a miss (a denial is a miss).

        Raises WireError(TOO_LARGE) if the value does not fit (the connection stays usable).
        """
        target = as_bytes_view(buffer)

        def alloc(result: GetResult) -> memoryview:
            if result.length > target.nbytes:
                raise WireError(ErrorCode.TOO_LARGE, "value larger than the caller's buffer")
            return target

        return self.get_many([key], ctx, alloc)[0][0]

    def get(self, key: str, ctx: RequestContext | None = None) -> tuple[bytes, GetResult] | None:
        """Read a value into a new ``bytes`` object (convenient, not for the hot path)."""
        hit = self.get_many([key], ctx)[0]
        if hit[0] is None:
            return None
        return bytes(hit[1]), hit[0]

    def get_many(
        self,
        keys: Sequence[str],
        ctx: RequestContext | None = None,
        alloc: Allocator | None = None,
        *,
        max_bytes: int | None = None,
    ) -> list[tuple[GetResult | None, Any]]:
        """Read several values in one frame. For each key: ``(result, buffer)`` on a hit (the
        buffer is what ``alloc`` returned, or a new bytearray), ``(None, None)`` on a miss.

        ``max_bytes`` caps the reply's payload (all hits together) below the HELLO's
        ``max_frame_bytes``: a reply announcing more is a protocol error (``TOO_LARGE``, the
        connection closed, nothing read or allocated).

        A hit the sidecar withdrew after announcing it (feature ``late_miss``: a segment failed
        its checks as it was sent) is a miss too, though ``alloc`` was asked for its buffer
        (which then holds the hit's authenticated start and zeros, to be ignored)."""
        if not keys:
            return []
        meta = {"keys": list(keys), "ctx": (ctx or EMPTY_CONTEXT).to_meta()}

        def op(conn: Connection) -> list[tuple[GetResult | None, Any]]:
            cap = conn.info.max_frame_bytes if conn.info is not None else 0
            if max_bytes is not None:
                cap = min(cap, max_bytes)
            header, reply = conn.call(FrameType.GET, meta, max_payload=cap)
            tail = reply.get("tail") is True  # a GET_END frame follows the payload
            items = reply.get("items")
            if not isinstance(items, list) or len(items) != len(keys):
                conn.close()
                raise WireError(ErrorCode.BAD_FRAME, "malformed GET reply")
            remaining = header.payload_len
            out: list[tuple[GetResult | None, Any]] = []
            pending_error: WireError | None = None
            for key, item in zip(keys, items, strict=True):
                if not isinstance(item, dict) or item.get("code") != ErrorCode.OK:
                    out.append((None, None))
                    continue
                length = item.get("len")
                if not isinstance(length, int) or length < 0 or length > remaining:
                    conn.close()
                    raise WireError(ErrorCode.BAD_FRAME, "GET reply lengths exceed payload")
                result = GetResult(key, length, item.get("meta") or {})
                remaining -= length
                buf: Any = None
                if pending_error is None:
                    try:
                        buf = alloc(result) if alloc is not None else bytearray(length)
                    except WireError as exc:
                        pending_error = exc
                if buf is None:
                    conn.discard(length)
                    out.append((None, None))
                    continue
                conn.recv_exact(as_bytes_view(buf)[:length])
                out.append((result, buf))
            if remaining:
                conn.discard(remaining)
            if tail:
                _withdraw(conn, header.stream_id, items, out)
            if pending_error is not None:
                raise pending_error
            return out

        result: list[tuple[GetResult | None, Any]] = self._run(op)
        return result

    def control(self, on_evict: EvictCallback, *, reconnect_delay: float = 1.0) -> ControlChannel:
        """Open the control connection that receives EVICT messages (a :class:`ControlChannel`)."""
        channel = ControlChannel(self, on_evict, reconnect_delay=reconnect_delay)
        channel.start()
        return channel


def _withdraw(
    conn: Connection, stream_id: int, items: list[Any], out: list[tuple[GetResult | None, Any]]
) -> None:
    """Read a GET's GET_END frame and turn the hits it withdraws into misses."""
    _, end = conn.read_reply(FrameType.GET_END, stream_id)
    missed = end.get("missed")
    if not isinstance(missed, list) or not all(
        type(i) is int
        and 0 <= i < len(items)
        and isinstance(items[i], dict)
        and items[i].get("code") == ErrorCode.OK
        for i in missed
    ):
        conn.close()
        raise WireError(ErrorCode.BAD_FRAME, "malformed GET_END")
    for i in missed:
        out[i] = (None, None)


def _read_put_ack(conn: Connection, stream_id: int, key: str) -> PutAck:
    _, reply = conn.read_reply(FrameType.PUT, stream_id)
    results = reply.get("results")
    if not isinstance(results, list) or len(results) != 1:
        conn.close()
        raise WireError(ErrorCode.BAD_FRAME, "malformed PUT reply")
    return _ack(key, results[0])


def _ack(key: str, result: object) -> PutAck:
    if not isinstance(result, dict):
        return PutAck(key, ErrorCode.INTERNAL, "malformed ack")
    try:
        error = ErrorCode(result.get("code", ErrorCode.INTERNAL))
    except ValueError:
        error = ErrorCode.INTERNAL
    reason = result.get("reason")
    return PutAck(key, error, reason if isinstance(reason, str) else None)

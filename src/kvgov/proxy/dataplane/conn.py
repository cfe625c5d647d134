"""Receive machinery shared by the data-plane listeners: an ``asyncio.BufferedProtocol`` whose
bytes go straight into the buffers a coroutine asks for.

A connection's handler coroutine calls ``await read_into(view)``; the event loop's
``recv_into`` then writes into that view directly (payloads land in pooled buffers, no copy).
Small reads (headers, metadata, what is left of a view below 64 KiB) go through a 64 KiB
scratch buffer, whose one ``recv`` also takes what follows (:data:`DIRECT_BYTES`: a frame's
header, metadata and first payload bytes arrive in one pass of the event loop, not three).
When no read is pending and the scratch buffer is full, the protocol pauses reading: TCP flow
control pushes back on the sender and memory stays bounded. Writes respect the transport's
high-water mark (``drain``).

Small replies go out with :meth:`StreamProtocol.send_view`: while the transport holds nothing,
the socket takes straight from the caller's view (Python 3.11's transport would copy whatever
the kernel does not take at once into a growing ``bytearray``); when the socket is full, only a
small piece goes through the transport, which waits for the socket, and the send resumes once
it is flushed. A hit's segments are opened and authenticated by the pipeline before it is
announced; large hits then go out from a sender thread (:meth:`StreamProtocol.send_plan`), and
up to ``dataplane.inline_crypto_bytes`` (every size on two CPUs or fewer) from the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import queue
import select
import threading
from collections.abc import Coroutine
from concurrent.futures import Executor, Future
from concurrent.futures import wait as futures_wait
from typing import TYPE_CHECKING, Any

from kvgov.errors import CorruptValueError
from kvgov.proxy.dataplane.plans import INLINE_CRYPTO_BYTES, settle
from kvgov.wire.codec import widen_unix_send_buffer

if TYPE_CHECKING:
    from kvgov.proxy.dataplane.plans import GetPlan
    from kvgov.proxy.dataplane.sealers import Opener

log = logging.getLogger("kvgov.dataplane.conn")

SCRATCH_BYTES = 64 * 1024
#: what is left of a read at least this large is received straight into the reader's view; a
#: smaller one (a frame's header, its metadata, a value's last few KiB) goes through the
#: scratch buffer, so that one ``recv`` takes what follows it too: a frame's header arrives
#: with its metadata and the first bytes of its payload, and the reads after it find their
#: bytes already here (no future, no pass of the event loop, no further ``recv`` each). At
#: most ``SCRATCH_BYTES`` is copied per read so.
DIRECT_BYTES = SCRATCH_BYTES
WRITE_HIGH_WATER = 4 * 1024 * 1024
#: what :meth:`StreamProtocol.send_view` hands the transport (copied) when the socket is full
SEND_PIECE = 256 * 1024


def refuse(transport: asyncio.BaseTransport) -> None:
    """Close a connection over a cap at once (a reset: its descriptor goes back now)."""
    if isinstance(transport, asyncio.Transport):
        transport.abort()
    else:
        transport.close()


class ConnectionClosed(Exception):  # noqa: N818 - a signal between the protocol and its handler
    """The peer closed the connection (or it failed) while a read was pending."""


class StreamProtocol(asyncio.BufferedProtocol):
    """Subclasses implement :meth:`handle` (the per-connection coroutine)."""

    listener = "kvgov"

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._scratch = bytearray(SCRATCH_BYTES)
        self._sview = memoryview(self._scratch)
        self._start = 0
        self._end = 0
        self._target: memoryview | None = None
        self._tgot = 0
        self._into_target = False
        self._read_fut: asyncio.Future[None] | None = None
        self._paused = False
        self._closed = False
        self._eof = False
        self._write_ready: asyncio.Event = asyncio.Event()
        self._write_ready.set()
        self._task: asyncio.Task[None] | None = None
        self._fd = -1
        self._flushed: asyncio.Event = asyncio.Event()
        self._flushed.set()
        #: a duplicate of the socket's fd for the sender threads (:meth:`send_plan`; closed when the
        #: connection is lost and no thread job uses it any more)
        self._wfd = -1
        #: the sender-thread job writing a hit to ``_wfd`` now (done only once the thread let go
        #: of the hit's buffers); ``write`` holds data meanwhile
        self._wjob: Future[None] | None = None
        self._held: list[bytes] = []
        #: frames the handler has taken since this connection's reads last waited for the
        #: event loop (:meth:`read_into` resets it when it waits): a frame whose bytes are
        #: buffered already is read with no pass of the loop, so the handler gives the other
        #: connections one every ``pipeline.SLICE`` of them (both listeners' handlers)
        self.frames_this_turn = 0
        #: loop time after which the listener's watchdog closes this connection (math.inf:
        #: none); set by :meth:`arm`, or by the first byte after :meth:`arm_on_data`
        self.deadline = math.inf
        self._arm_after = 0.0
        #: what the deadline guards now ("hello", "frame", "reply"), for the timeout metric
        self.phase = "frame"

    # -- deadlines -----------------------------------------------------------------------------

    def arm(self, seconds: float, phase: str = "frame") -> None:
        """Close the connection unless :meth:`disarm` comes within ``seconds``."""
        self._arm_after = 0.0
        self.phase = phase
        self.deadline = asyncio.get_running_loop().time() + seconds

    def arm_on_data(self, seconds: float) -> None:
        """Arm a frame deadline of ``seconds`` once the next byte arrives (idle between
        frames is allowed; a frame, once begun, must arrive in time)."""
        if self._end > self._start:
            self.arm(seconds)
        else:
            self._arm_after = seconds

    def disarm(self) -> None:
        self._arm_after = 0.0
        self.deadline = math.inf

    def expire(self) -> None:
        """The deadline passed (called by the watchdog): close; the pending read fails, and
        the handler releases what it held (pool buffers, unfinished plans)."""
        self.deadline = math.inf
        self.timed_out(self.phase)
        self.close()

    def timed_out(self, phase: str) -> None:
        """Count a timeout (subclasses: metrics and summarised logs)."""

    # -- protocol callbacks --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not isinstance(transport, asyncio.Transport):
            raise TypeError("a stream transport is required")
        self.transport = transport
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)
        sock = transport.get_extra_info("socket")
        self._fd = sock.fileno() if sock is not None else -1
        if sock is not None:
            widen_unix_send_buffer(sock)  # hits: what may be in flight to the engine
        self._task = asyncio.get_running_loop().create_task(self._main())

    async def _main(self) -> None:
        try:
            await self.handle()
        except ConnectionClosed:
            pass
        except Exception:
            log.exception("dataplane.connection.failed", extra={"listener": self.listener})
        finally:
            self.close()

    def handle(self) -> Coroutine[Any, Any, None]:
        raise NotImplementedError

    def get_buffer(self, sizehint: int) -> memoryview:
        target = self._target
        if (
            target is not None
            and self._start == self._end
            and target.nbytes - self._tgot >= DIRECT_BYTES
        ):
            self._into_target = True
            return target[self._tgot :]
        self._into_target = False
        if self._end == len(self._scratch):
            self._compact()
        return self._sview[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._arm_after:
            self.arm(self._arm_after)
        if self._into_target:
            self._tgot += nbytes
            self._check_target()
        else:
            self._end += nbytes
            self._feed()

    def eof_received(self) -> bool:
        self._eof = True
        self._fail()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._write_ready.set()
        self._flushed.set()
        self._fail()
        self._held.clear()
        if self._wjob is None or self._wjob.done():
            self._close_wfd()
        else:
            self._wjob.add_done_callback(lambda _: self._close_wfd())

    def _close_wfd(self) -> None:
        if self._wfd >= 0:
            os.close(self._wfd)
            self._wfd = -1

    def pause_writing(self) -> None:
        self._write_ready.clear()
        self._flushed.clear()

    def resume_writing(self) -> None:
        self._write_ready.set()
        self._flushed.set()

    # -- for the handler -----------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    async def read_into(self, view: memoryview) -> None:
        """Fill ``view`` with the next bytes of the stream (raises ConnectionClosed)."""
        if self._closed:
            raise ConnectionClosed
        if view.nbytes == 0:
            return
        self._target = view
        self._tgot = 0
        if self._end > self._start:  # bytes already here (a frame's header and metadata)
            self._feed()
            if self._tgot >= view.nbytes:  # all of them: no future, no pass of the event loop
                return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._read_fut = fut
        self._feed()
        if not fut.done() and self._eof:
            self._fail()
        if not fut.done() and self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        if fut.done():  # (failed, or filled by bytes here already): no pass of the loop either
            await fut
            return
        await fut
        self.frames_this_turn = 0  # the loop ran the other connections meanwhile

    async def read_exact(self, n: int) -> bytes:
        """The next ``n`` bytes of the stream (raises ConnectionClosed)."""
        start = self._start
        if self._end - start >= n and not self._closed:
            # here already (a frame's metadata arrives with its header): taken from the scratch
            # buffer as :meth:`read_into` would copy them, without a buffer and a view for it
            self._start = start + n
            if self._start == self._end:
                self._start = self._end = 0
            return bytes(self._sview[start : start + n])
        buf = bytearray(n)
        await self.read_into(memoryview(buf))
        return bytes(buf)

    async def discard(self, n: int) -> None:
        scratch = memoryview(bytearray(min(n, 1 << 20))) if n else memoryview(b"")
        while n > 0:
            step = min(n, scratch.nbytes)
            await self.read_into(scratch[:step])
            n -= step

    def write(self, data: bytes | bytearray | memoryview) -> None:
        t = self.transport
        if t is not None and not self._closed and not t.is_closing():
            if self._wjob is not None:  # a sender thread is writing a hit: follow it
                self._held.append(bytes(data))
                return
            t.write(data)

    async def send_view(self, data: memoryview) -> None:
        """Write ``data`` (after what is already queued), taking no copy of what the socket
        accepts directly; returns once at most one small piece is left with the transport."""
        t = self.transport
        if t is None or self._fd < 0:
            self.write(data)
            await self.drain()
            return
        view = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        while view.nbytes:
            if self._closed or t.is_closing():
                raise ConnectionClosed
            if t.get_write_buffer_size() == 0:
                try:
                    n = os.write(self._fd, view)
                except (BlockingIOError, InterruptedError):
                    n = 0
                except OSError:
                    t.write(view)  # the transport reports the failure and closes
                    raise ConnectionClosed from None
                view = view[n:]
                if not view.nbytes:
                    return
            piece = view[:SEND_PIECE]
            view = view[piece.nbytes :]
            t.write(piece)  # the transport waits for the socket to take it
            if view.nbytes:
                await self._until_flushed(t)

    async def _until_flushed(self, t: asyncio.Transport) -> None:
        """Wait until the transport has handed everything it holds to the socket."""
        if t.get_write_buffer_size() == 0:
            return
        t.set_write_buffer_limits(high=0)  # pause now; resume when the buffer is empty
        try:
            await self._flushed.wait()
        finally:
            if not self._closed:
                t.set_write_buffer_limits(high=WRITE_HIGH_WATER)
        if self._closed:
            raise ConnectionClosed

    async def drain(self) -> None:
        await self._write_ready.wait()
        if self._closed:
            raise ConnectionClosed

    async def replies_read(self, seconds: float) -> None:
        """Before the next request is read: wait until the peer has read its replies down to
        the write buffer's high-water mark, for at most ``seconds`` (then the connection is
        closed, phase ``reply``). Small replies (errors, pings, misses, EXISTS) go to the
        transport without waiting, so a peer that kept asking and never read would otherwise
        have them queued in the sidecar without limit."""
        if self._write_ready.is_set():
            return
        if self.deadline != math.inf:  # a deadline runs already (HELLO's): it bounds this too
            await self.drain()
            return
        self.arm(seconds, phase="reply")
        try:
            await self.drain()
        finally:
            self.disarm()

    async def send_plan(
        self,
        plan: GetPlan,
        sender: Executor,
        *,
        crypto: Executor | None = None,
        inline_bytes: int = INLINE_CRYPTO_BYTES,
        pad: bool = False,
        ahead: Executor | None = None,
    ) -> None:
        """Stream a hit: its segments already opened and authenticated by the pipeline, or, for
        one opened as it is sent (``plan.opener``: :class:`GetPlan`), the first, and each next
        one opened while the one before goes out. One up to ``inline_bytes`` is written on the
        event loop. A larger one is written by a ``sender`` thread, waiting on the socket with
        the GIL released (what ``lmcache_server``'s blocking ``sendall`` does): no event-loop
        round per socketful. Writes the loop makes meanwhile (other replies) are held back and
        follow the hit (:meth:`write`).

        The next segment of a hit opened as it is sent is opened by the writing thread once
        the socket took what it could of this one (while the peer drains it), or, on the event
        loop given a ``crypto`` pool, there, while this one is written: a peer that waits for
        each hit of a few MiB (``lm://``) gets it sooner, while for frames of many hits in
        flight, and for larger ``lm://`` hits, which ``lm://`` therefore gives a sender thread,
        the hand-off measured worse (``docs/operations.md``, "Threads"). Given an ``ahead``
        pool, a sender thread's hit of more than two segments has them opened there instead,
        by one job running ahead of the writes (:class:`_OpenAhead`): ``lm://``'s large hits,
        one at a time, gain from it; the kvgov wire's frames of many hits measured worse
        (a real engine's retrieve -20%), so it passes none.

        A segment that fails as it is opened raises its
        :class:`~kvgov.errors.CorruptValueError` once the segments before it are sent: nothing
        of it goes out, but for ``pad``: then zeros stand in for the rest of the hit first (the
        bytes its announcement promised)."""
        if plan.length <= inline_bytes:
            await self._send_windows(plan.windows, plan.opener, crypto, pad)
            return
        t = self.transport
        if t is None or self._fd < 0 or self._closed:
            raise ConnectionClosed
        await self._until_flushed(t)  # what is queued (the reply head) goes first
        if t.get_write_buffer_size():
            await self.drain()
        if self._wfd < 0:
            self._wfd = os.dup(self._fd)
        if plan.opener is None or len(plan.windows) <= 2 or ahead is sender:
            # (one pool for both: the writer would wait on an open queued behind itself)
            ahead = None
        job = sender.submit(_write_windows, self, plan.windows, plan.opener, pad, ahead)
        self._wjob = job
        try:
            await asyncio.wrap_future(job)
        except asyncio.CancelledError:
            # the thread still reads the hit's buffers (and opens segments into them): a hit
            # cut short leaves the stream out of step, so the connection goes, which stops the
            # thread at its next write; the buffers are the caller's again only after that
            self.close()
            with contextlib.suppress(Exception):
                await settle([job])
            raise
        finally:
            self._wjob = None
            held, self._held = self._held, []
            for data in held:
                self.write(data)

    async def _send_windows(
        self,
        windows: list[memoryview],
        opener: Opener | None,
        crypto: Executor | None,
        pad: bool,
    ) -> None:
        """:meth:`send_plan` on the event loop. Each next window of a hit opened as it is sent
        goes into the buffer of the one before this one, all handed to the socket by then."""
        last = len(windows) - 1
        for i, window in enumerate(windows):
            if opener is None or i == last:
                await self.send_view(window)
                continue
            t = self.transport
            if t is not None and t.get_write_buffer_size():
                await self._until_flushed(t)  # the next window's buffer is free
            failed: CorruptValueError | None = None
            if crypto is None:  # what the socket takes now; the next opened as it drains
                rest = self._write_now(window)
                try:
                    opener.open_segment(i + 1, windows[i + 1])
                except CorruptValueError as exc:
                    failed = exc
                await self.send_view(rest)
            else:  # the next opened in the pool while this one is written
                job = crypto.submit(opener.open_segment, i + 1, windows[i + 1])
                try:
                    await self.send_view(window)
                except BaseException:
                    with contextlib.suppress(Exception):
                        await settle([job])  # the pool is done with the buffer
                    raise
                try:
                    if not job.done():  # (a done one costs no pass of the event loop)
                        await settle([job])
                    job.result()
                except CorruptValueError as exc:
                    failed = exc
            if failed is not None:
                if pad:
                    await self.send_view(_zeros(windows[i + 1 :]))
                raise failed

    def _write_now(self, view: memoryview) -> memoryview:
        """Write what the socket takes of ``view`` at once, if nothing is queued before it;
        return the rest."""
        t = self.transport
        if t is None or self._fd < 0 or self._closed or t.get_write_buffer_size():
            return view
        try:
            n = os.write(self._fd, view)
        except OSError:  # full, or failed: send_view goes on with it
            return view
        return view[n:]

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()
        self._closed = True
        self._fail()

    # -- internals -----------------------------------------------------------------------------

    def _compact(self) -> None:
        if self._start:
            n = self._end - self._start
            self._scratch[:n] = self._scratch[self._start : self._end]
            self._start, self._end = 0, n

    def _feed(self) -> None:
        target = self._target
        if target is not None and self._end > self._start:
            n = min(target.nbytes - self._tgot, self._end - self._start)
            target[self._tgot : self._tgot + n] = self._sview[self._start : self._start + n]
            self._tgot += n
            self._start += n
            if self._start == self._end:
                self._start = self._end = 0
            self._check_target()
        if (
            self._target is None
            and self._end == len(self._scratch)
            and self._start == 0
            and not self._paused
            and self.transport is not None
        ):
            self._paused = True
            self.transport.pause_reading()

    def _check_target(self) -> None:
        target = self._target
        if target is not None and self._tgot >= target.nbytes:
            self._target = None
            fut = self._read_fut
            self._read_fut = None
            if fut is not None and not fut.done():
                fut.set_result(None)

    def _fail(self) -> None:
        fut = self._read_fut
        self._read_fut = None
        self._target = None
        if fut is not None and not fut.done():
            fut.set_exception(ConnectionClosed())


def _write_windows(
    conn: StreamProtocol,
    windows: list[memoryview],
    opener: Opener | None,
    pad: bool,
    ahead: Executor | None = None,
) -> None:
    """A sender-thread job: write ``windows`` to the connection's socket, waiting on the socket
    (GIL released) while it is full; the windows after the first of a hit opened as it is sent
    are opened with ``opener``: by a thread of ``ahead`` while this thread writes the ones
    before (:class:`_OpenAhead`), or, without it, here, each while the socket drains the one
    before. Raises ConnectionClosed, or the failure of a segment as
    :meth:`StreamProtocol.send_plan` does (after the zeros that stand in for the rest, for
    ``pad``)."""
    fd = conn._wfd
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    if opener is not None and ahead is not None:
        _write_opened_ahead(conn, fd, poller, windows, opener=opener, pad=pad, ahead=ahead)
        return
    last = len(windows) - 1
    for i, window in enumerate(windows):
        view = _bytes_view(window)
        if opener is None or i == last:
            _write_all(conn, fd, poller, view)
            continue
        # what the socket takes now; the next window is opened while the peer drains it (its
        # buffer held the window before this one, all written)
        view = _write_once(conn, fd, view)
        try:
            opener.open_segment(i + 1, windows[i + 1])
        except CorruptValueError:
            _write_all(conn, fd, poller, view)  # authenticated: it goes whole
            if pad:
                _write_all(conn, fd, poller, _zeros(windows[i + 1 :]))
            raise
        _write_all(conn, fd, poller, view)


def _bytes_view(window: memoryview) -> memoryview:
    return window.cast("B") if window.format != "B" or window.ndim != 1 else window


class _OpenAhead:
    """Opens windows 1.. of a hit in the ``ahead`` pool while a sender thread writes the ones
    before. The windows take turns in two segment buffers (:func:`~kvgov.proxy.dataplane.plans.
    open_value`): window ``i`` is opened once window ``i - 2``, whose buffer it reuses, was
    handed to the socket. A job opens what it may and returns when it must wait for a write
    (a slow reader holds no pool thread); the writer submits the next job once it wrote that
    window. At most one job runs at a time; opened windows are announced in order on a queue
    (its wait releases the GIL)."""

    __slots__ = (
        "_ahead",
        "_job",
        "_lock",
        "_next",
        "_opened",
        "_running",
        "_stopped",
        "_windows",
        "_written",
        "opener",
    )

    def __init__(self, opener: Opener, windows: list[memoryview], ahead: Executor) -> None:
        self.opener = opener
        self._windows = windows
        self._ahead = ahead
        self._lock = threading.Lock()
        self._next = 1  # the next window to open (the pipeline opened window 0)
        self._written = 0  # windows handed to the socket
        self._running = False
        self._stopped = False
        self._job: Future[None] | None = None
        #: (index, failure or None) per window opened, in order
        self._opened: queue.SimpleQueue[tuple[int, BaseException | None]] = queue.SimpleQueue()

    def start(self) -> None:
        with self._lock:
            self._running = True
        self._job = self._ahead.submit(self._run)

    def _run(self) -> None:
        """A pool job: open windows while their buffers are free; any failure ends the hit."""
        n = len(self._windows)
        while True:
            with self._lock:
                i = self._next
                if self._stopped or i >= n or (i >= 2 and self._written < i - 1):
                    self._running = False  # done, or wait for a write: the writer resubmits
                    return
            try:
                self.opener.open_segment(i, self._windows[i])
            except BaseException as exc:  # noqa: BLE001 - handed to the writer, which raises it
                with self._lock:
                    self._stopped = True
                    self._running = False
                self._opened.put((i, exc))
                return
            with self._lock:
                self._next = i + 1
            self._opened.put((i, None))

    def opened(self) -> BaseException | None:
        """Wait until the next window is opened; its failure, if it failed."""
        return self._opened.get()[1]

    def written(self, index: int) -> None:
        """Window ``index`` was handed to the socket: its buffer may take the one two after."""
        with self._lock:
            self._written = index + 1
            resume = not self._running and not self._stopped and self._next < len(self._windows)
            if resume:
                self._running = True
        if resume:
            self._job = self._ahead.submit(self._run)

    def stop(self) -> None:
        """Open no more; returns once no job touches the windows."""
        with self._lock:
            self._stopped = True
        if self._job is not None:
            futures_wait([self._job])


def _write_opened_ahead(
    conn: StreamProtocol,
    fd: int,
    poller: select.poll,
    windows: list[memoryview],
    *,
    opener: Opener,
    pad: bool,
    ahead: Executor,
) -> None:
    """:func:`_write_windows` with the windows after the first opened in the ``ahead`` pool
    (:class:`_OpenAhead`); returns only once no job of it touches them."""
    turns = _OpenAhead(opener, windows, ahead)
    turns.start()
    try:
        for i, window in enumerate(windows):
            if i:
                failed = turns.opened()
                if isinstance(failed, CorruptValueError) and pad:
                    _write_all(conn, fd, poller, _zeros(windows[i:]))
                if failed is not None:
                    raise failed
            _write_all(conn, fd, poller, _bytes_view(window))
            turns.written(i)
    finally:
        turns.stop()


def _write_once(conn: StreamProtocol, fd: int, view: memoryview) -> memoryview:
    """One write of ``view`` to the (non-blocking) socket; the rest."""
    if conn._closed:
        raise ConnectionClosed
    try:
        n = os.write(fd, view)
    except (BlockingIOError, InterruptedError):
        return view
    except OSError:
        raise ConnectionClosed from None
    return view[n:]


def _write_all(conn: StreamProtocol, fd: int, poller: select.poll, view: memoryview) -> None:
    """Write all of ``view``, waiting on the socket (GIL released) while it is full."""
    while view.nbytes:
        rest = _write_once(conn, fd, view)
        if rest.nbytes == view.nbytes:
            for _, ev in poller.poll(100):
                if ev & (select.POLLERR | select.POLLHUP | select.POLLNVAL):
                    raise ConnectionClosed
        view = rest


def _zeros(windows: list[memoryview]) -> memoryview:
    """As many zero bytes as ``windows`` hold: what stands in for a hit's unsent rest."""
    return memoryview(bytes(sum(w.nbytes for w in windows)))

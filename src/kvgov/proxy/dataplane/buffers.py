"""A bounded pool of reusable byte buffers for chunks in flight.

Every chunk the data plane receives or serves lives in a pooled buffer while it is in flight;
the pool never holds more than ``max_bytes`` (in use plus idle). When it is exhausted,
:meth:`BufferPool.acquire` waits: the connection asking stops reading from its socket, which
is how backpressure reaches the engine (TCP flow control), instead of memory growing.

Buffers are recycled by size class (powers of two from 64 KiB to 1 MiB, whole MiB above), so
steady-state traffic of one chunk size allocates nothing.
"""

from __future__ import annotations

import asyncio
from collections import deque

from kvgov.errors import ProtocolError

MIN_CLASS = 64 * 1024
LARGE_STEP = 1 << 20


def size_class(n: int) -> int:
    """Powers of two from 64 KiB up to 1 MiB, then whole MiB: a 32 MiB chunk plus its few
    bytes of header takes a 33 MiB buffer, not a 64 MiB one."""
    if n > LARGE_STEP:
        return -(-n // LARGE_STEP) * LARGE_STEP
    size = MIN_CLASS
    while size < n:
        size <<= 1
    return size


class Lease:
    """One buffer on loan; :meth:`release` returns it (idempotent)."""

    __slots__ = ("_pool", "buf", "size")

    def __init__(self, pool: BufferPool, buf: bytearray, size: int) -> None:
        self._pool: BufferPool | None = pool
        self.buf = buf
        self.size = size

    @property
    def view(self) -> memoryview:
        return memoryview(self.buf)[: self.size]

    def release(self) -> None:
        pool = self._pool
        if pool is not None:
            self._pool = None
            pool._give_back(self.buf)


class BufferPool:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._idle: dict[int, deque[bytearray]] = {}
        self._idle_bytes = 0
        self._in_use = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    @property
    def in_use_bytes(self) -> int:
        return self._in_use

    @property
    def idle_bytes(self) -> int:
        return self._idle_bytes

    async def acquire(self, n: int) -> Lease:
        """A buffer of at least ``n`` bytes (its ``view`` is exactly ``n``); waits for room."""
        cls = size_class(n)
        if cls > self.max_bytes:
            raise ProtocolError(f"a {n}-byte chunk does not fit the buffer pool")
        while not self._fits(cls):
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append((cls, fut))
            try:
                await fut
            except asyncio.CancelledError:
                self._wake()
                raise
        lease = self._take(cls, n)
        if self._waiters:
            self._wake()
        return lease

    def _fits(self, cls: int) -> bool:
        if self._idle.get(cls):
            return True
        if self._in_use + self._idle_bytes + cls <= self.max_bytes:
            return True
        # drop idle buffers of other sizes to make room
        for size, bufs in list(self._idle.items()):
            while bufs and self._in_use + self._idle_bytes + cls > self.max_bytes:
                bufs.pop()
                self._idle_bytes -= size
            if not bufs:
                del self._idle[size]
        return self._in_use + self._idle_bytes + cls <= self.max_bytes

    def _take(self, cls: int, n: int) -> Lease:
        bufs = self._idle.get(cls)
        if bufs:
            buf = bufs.pop()
            self._idle_bytes -= cls
        else:
            buf = bytearray(cls)
        self._in_use += cls
        return Lease(self, buf, n)

    def _give_back(self, buf: bytearray) -> None:
        cls = len(buf)
        self._in_use -= cls
        self._idle.setdefault(cls, deque()).append(buf)
        self._idle_bytes += cls
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            cls, fut = self._waiters[0]
            if fut.done():
                self._waiters.popleft()
                continue
            if not self._fits(cls):
                return
            self._waiters.popleft()
            fut.set_result(None)
            return

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
from collections import Counter, deque
from collections.abc import Sequence

from kvgov.connectors.tiers.memory import Pooled, new_buffer
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

    def __init__(self, pool: BufferPool, buf: Pooled, size: int) -> None:
        self._pool: BufferPool | None = pool
        self.buf = buf
        self.size = size

    @property
    def view(self) -> memoryview:
        return memoryview(self.buf)[: self.size]

    def resize(self, n: int) -> Lease:
        """This lease with a view of exactly ``n`` bytes (raises if its buffer is smaller)."""
        if n > len(self.buf):
            self.release()
            raise ProtocolError(f"a {n}-byte item does not fit the {len(self.buf)}-byte buffer")
        self.size = n
        return self

    def release(self) -> None:
        pool = self._pool
        if pool is not None:
            self._pool = None
            pool._give_back(self.buf)


class BufferPool:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._idle: dict[int, deque[Pooled]] = {}
        self._idle_bytes = 0
        self._in_use = 0
        self._waiters: deque[tuple[tuple[int, ...], asyncio.Future[None]]] = deque()

    @property
    def in_use_bytes(self) -> int:
        return self._in_use

    @property
    def idle_bytes(self) -> int:
        return self._idle_bytes

    async def acquire(self, n: int) -> Lease:
        """A buffer of at least ``n`` bytes (its ``view`` is exactly ``n``); waits for room."""
        return (await self.acquire_many((n,)))[0]

    async def acquire_many(self, sizes: Sequence[int]) -> list[Lease]:
        """Buffers for every size at once, or none: waits until all of them fit together.

        What one request (a PUT or GET frame of several items) holds together is taken in one
        step, so no connection ever holds part of the pool while waiting for more (two
        connections doing that could wait for each other for ever). Waiters are served in
        order."""
        classes = tuple(size_class(n) for n in sizes)
        if sum(classes) > self.max_bytes:
            raise ProtocolError(f"{sum(sizes)} bytes in one request do not fit the buffer pool")
        if not classes:
            return []
        queued = False
        # behind earlier waiters (in order), then until they fit: a woken waiter that finds
        # its room taken by a newcomer waits again at the head of the line
        while (self._waiters and not queued) or not self._fits(classes):
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            if queued:
                self._waiters.appendleft((classes, fut))
            else:
                self._waiters.append((classes, fut))
                queued = True
            try:
                await fut
            except asyncio.CancelledError:
                self._wake()  # if it had been woken, the next waiter's turn
                raise
        leases = [self._take(cls, n) for cls, n in zip(classes, sizes, strict=True)]
        if self._waiters:
            self._wake()
        return leases

    def _fits(self, classes: Sequence[int]) -> bool:
        """Whether buffers of these classes can be taken now (idle ones first; idle buffers
        of other sizes are dropped to make room)."""
        reuse: Counter[int] = Counter()
        fresh = 0
        for cls in classes:
            if reuse[cls] < len(self._idle.get(cls, ())):
                reuse[cls] += 1
            else:
                fresh += cls
        if self._in_use + self._idle_bytes + fresh <= self.max_bytes:
            return True
        for size, bufs in list(self._idle.items()):
            keep = reuse.get(size, 0)
            while len(bufs) > keep and self._in_use + self._idle_bytes + fresh > self.max_bytes:
                bufs.pop()
                self._idle_bytes -= size
            if not bufs:
                del self._idle[size]
        return self._in_use + self._idle_bytes + fresh <= self.max_bytes

    def _take(self, cls: int, n: int) -> Lease:
        bufs = self._idle.get(cls)
        if bufs:
            buf = bufs.pop()
            self._idle_bytes -= cls
        else:
            buf = new_buffer(cls)  # its pages faulted in at once
        self._in_use += cls
        return Lease(self, buf, n)

    def _give_back(self, buf: Pooled) -> None:
        cls = len(buf)
        self._in_use -= cls
        self._idle.setdefault(cls, deque()).append(buf)
        self._idle_bytes += cls
        self._wake()

    def _wake(self) -> None:
        """Resolve the first waiter if its buffers fit now (the next ones wait their turn)."""
        while self._waiters:
            classes, fut = self._waiters[0]
            if fut.done():
                self._waiters.popleft()
                continue
            if not self._fits(classes):
                return
            self._waiters.popleft()
            fut.set_result(None)
            return

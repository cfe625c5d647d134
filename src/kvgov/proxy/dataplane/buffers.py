"""A bounded pool of reusable byte buffers for chunks in flight.

Every chunk the data plane receives or serves lives in a pooled buffer while it is in flight;
the pool never holds more than ``max_bytes`` (in use plus idle). When it is exhausted,
:meth:`BufferPool.acquire` waits: the connection asking stops reading from its socket, which
is how backpressure reaches the engine (TCP flow control), instead of memory growing.

One owner (an engine identity) may hold at most ``owner_max_bytes`` of it at once
(``dataplane.buffer_pool_engine_share``): an engine that stalls its frames, or pipelines
without end, waits for its own buffers without holding up another engine's requests.

Buffers are recycled by size class (powers of two from 64 KiB to 1 MiB, whole MiB above), so
steady-state traffic of one chunk size allocates nothing.
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from collections.abc import Sequence

from kvgov.connectors.tiers.pages import Pooled, new_buffer
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

    __slots__ = ("_pool", "buf", "owner", "size")

    def __init__(self, pool: BufferPool, buf: Pooled, size: int, owner: str | None = None) -> None:
        self._pool: BufferPool | None = pool
        self.buf = buf
        self.size = size
        self.owner = owner

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
            pool._give_back(self.buf, self.owner)


class BufferPool:
    def __init__(self, max_bytes: int, owner_max_bytes: int | None = None) -> None:
        self.max_bytes = max_bytes
        #: what one owner (engine) may hold at once
        self.owner_max_bytes = min(max_bytes, owner_max_bytes or max_bytes)
        self._idle: dict[int, deque[Pooled]] = {}
        self._idle_bytes = 0
        self._in_use = 0
        self._waiters: deque[tuple[tuple[int, ...], asyncio.Future[None]]] = deque()
        self._owned: Counter[str] = Counter()
        #: requests waiting for their owner's own buffers to come back (not in the line)
        self._owner_waiters: dict[str, list[asyncio.Future[None]]] = {}

    @property
    def in_use_bytes(self) -> int:
        return self._in_use

    @property
    def idle_bytes(self) -> int:
        return self._idle_bytes

    def owned_bytes(self, owner: str) -> int:
        return self._owned.get(owner, 0)

    async def acquire(self, n: int, owner: str | None = None) -> Lease:
        """A buffer of at least ``n`` bytes (its ``view`` is exactly ``n``); waits for room."""
        return (await self.acquire_many((n,), owner))[0]

    async def acquire_many(self, sizes: Sequence[int], owner: str | None = None) -> list[Lease]:
        """Buffers for every size at once, or none: waits until all of them fit together.

        What one request (a PUT or GET frame of several items) holds together is taken in one
        step, so no connection ever holds part of the pool while waiting for more (two
        connections doing that could wait for each other for ever). Waiters are served in
        order. A request of an ``owner`` holding its share already waits apart, until its own
        buffers come back, and then takes its place in line."""
        classes = tuple([size_class(n) for n in sizes])
        total = sum(classes)
        limit = self.max_bytes if owner is None else self.owner_max_bytes
        if total > limit:
            raise ProtocolError(f"{sum(sizes)} bytes in one request do not fit the buffer pool")
        if not classes:
            return []
        # (``.get``: a missing owner costs a Python ``Counter.__missing__`` call otherwise)
        owned = self._owned
        while True:
            if owner is not None and owned.get(owner, 0) + total > limit:
                await self._wait_owner(owner)
                continue
            await self._in_line(classes)
            if owner is not None and owned.get(owner, 0) + total > limit:
                self._wake()  # its own share filled meanwhile: the next in line goes first
                continue
            break
        leases = [self._take(cls, n, owner) for cls, n in zip(classes, sizes, strict=True)]
        if owner is not None:
            owned[owner] = owned.get(owner, 0) + total
        if self._waiters:
            self._wake()
        return leases

    async def _wait_owner(self, owner: str) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiting = self._owner_waiters.setdefault(owner, [])
        waiting.append(fut)
        try:
            await fut
        finally:
            if fut in waiting:
                waiting.remove(fut)
            if not waiting:
                self._owner_waiters.pop(owner, None)

    async def _in_line(self, classes: tuple[int, ...]) -> None:
        """Wait behind earlier waiters until buffers of ``classes`` fit."""
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

    def _fits(self, classes: Sequence[int]) -> bool:
        """Whether buffers of these classes can be taken now (idle ones first; idle buffers
        of other sizes are dropped to make room)."""
        reuse: dict[int, int] = {}
        fresh = 0
        for cls in classes:
            used = reuse.get(cls, 0)
            if used < len(self._idle.get(cls, ())):
                reuse[cls] = used + 1
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

    def _take(self, cls: int, n: int, owner: str | None = None) -> Lease:
        bufs = self._idle.get(cls)
        if bufs:
            buf = bufs.pop()
            self._idle_bytes -= cls
        else:
            buf = new_buffer(cls)  # its pages faulted in at once
        self._in_use += cls
        return Lease(self, buf, n, owner)

    def _give_back(self, buf: Pooled, owner: str | None = None) -> None:
        cls = len(buf)
        self._in_use -= cls
        if owner is not None:
            left = self._owned.get(owner, 0) - cls
            if left > 0:
                self._owned[owner] = left
            else:
                del self._owned[owner]
            for fut in self._owner_waiters.get(owner, ()):
                if not fut.done():
                    fut.set_result(None)
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

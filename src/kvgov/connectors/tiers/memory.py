"""The memory tier: a bytes-bounded LRU of sealed chunks, with buffers recycled by size.

KV chunks are mostly one size (one model, one chunk length), so the buffer of an evicted or
deleted entry is kept in a small pool keyed by its exact length and handed to the next put of
that length: in steady state a put copies into a recycled buffer instead of allocating (and
page-faulting) a fresh 32 MiB one. A fresh one is an anonymous mapping with its pages faulted
in at once, without the GIL (:func:`~kvgov.connectors.tiers.pages.new_buffer`). Live entries
plus pooled and reserved buffers never exceed ``max_bytes`` (but for the one case
:meth:`MemoryTier.reserve` describes); the pool gives its buffers up before any live entry is
evicted.

While the tier is filling there is nothing to recycle, and faulting a fresh buffer's pages in
costs ~0.3 ms per MiB. A buffer :meth:`MemoryTier.reserve` maps fresh is handed out at once,
its pages not yet there, and the tier's own thread faults them in meanwhile (no GIL held),
while the put's bytes are still arriving; the seal that writes a page before that thread got
to it faults that page itself.

Every operation runs synchronously on the event loop (a copy at memory speed, no awaits in the
middle), so operations on one key never interleave.

:meth:`MemoryTier.borrow` hands out a read-only view of a stored buffer (no copy) under a read
guard: until the guard is released, that buffer is never recycled, so a delete, overwrite or
eviction meanwhile drops the entry but leaves the borrowed bytes as they were (a buffer dropped
while borrowed is not counted in ``max_bytes`` any more; it is freed, not pooled).

:meth:`MemoryTier.reserve` sets a buffer aside for one put (counted in ``max_bytes``), which
the caller fills, from any thread, and then stores with :meth:`MemoryTier.put_reserved`: the
data plane seals a put from its receive buffer straight into the tier's buffer, so a governed
put costs the encryption pass and no copy after it.
"""

from __future__ import annotations

import logging
import mmap
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvgov.connectors.tiers.base import (
    BytesLike,
    DestinationTooSmallError,
    EntryInfo,
    EvictListener,
    Reserved,
    TierStats,
    as_bytes_view,
    check_key,
    copy_into,
    notify_evict,
)
from kvgov.connectors.tiers.pages import Pooled, map_buffer, new_buffer, populate
from kvgov.errors import TierError

log = logging.getLogger(__name__)

#: values shorter than this are plain ``bytes`` copies; only large buffers are worth pooling
POOL_MIN_BYTES = 64 * 1024


#: a buffer the tier owns: small values are ``bytes``; large ones writable, pooled buffers
Buffer = bytes | bytearray | mmap.mmap


@dataclass(slots=True)
class _Entry:
    buf: Buffer
    expires_at: float | None


class Reservation:
    """A buffer set aside by :meth:`MemoryTier.reserve`: write :attr:`view`, then
    :meth:`MemoryTier.put_reserved` it or :meth:`cancel` it."""

    __slots__ = ("_buf", "_tier", "view")

    def __init__(self, tier: MemoryTier, buf: Pooled) -> None:
        self._tier: MemoryTier | None = tier
        self._buf: Pooled | None = buf
        self.view = memoryview(buf)

    def take(self, tier: MemoryTier) -> Pooled:
        """The buffer, now owned by ``tier`` (which must be the one that reserved it)."""
        if self._buf is None or self._tier is not tier:
            raise TierError(f"tier {tier.name}: this reservation is not (or no longer) its own")
        buf, self._buf, self._tier = self._buf, None, None
        return buf

    def cancel(self) -> None:
        tier, buf = self._tier, self._buf
        self._tier = self._buf = None
        if tier is not None and buf is not None:
            tier._unreserve(buf)


class Borrowed:
    """A read-only view of a stored value; :meth:`release` (once) ends the read guard."""

    __slots__ = ("_ident", "_pins", "view")

    def __init__(self, view: memoryview, pins: dict[int, int], ident: int) -> None:
        self.view = view
        self._pins: dict[int, int] | None = pins
        self._ident = ident

    def release(self) -> None:
        pins, self._pins = self._pins, None
        if pins is None:
            return
        left = pins[self._ident] - 1
        if left:
            pins[self._ident] = left
        else:
            del pins[self._ident]

    def __enter__(self) -> Borrowed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class MemoryTier:
    """A :class:`~kvgov.connectors.tiers.base.Tier` in process memory."""

    def __init__(
        self,
        max_bytes: int,
        *,
        name: str = "memory",
        on_evict: EvictListener | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if max_bytes <= 0:
            raise TierError(f"tier {name}: max_bytes must be positive, not {max_bytes}")
        self._name = name
        self._max = max_bytes
        self._on_evict = on_evict
        self._clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._live_bytes = 0
        self._pool: dict[int, list[Pooled]] = {}
        self._pooled_bytes = 0
        self._reserved_bytes = 0
        self._hits = self._misses = self._evictions = self._expirations = 0
        self._closed = False
        self._pins: dict[int, int] = {}  # id(buffer) -> borrows not yet released
        self._populator: ThreadPoolExecutor | None = None

    @property
    def name(self) -> str:
        return self._name

    @property
    def pooled_bytes(self) -> int:
        """Bytes held by recycled buffers waiting for a put of their size."""
        return self._pooled_bytes

    @property
    def reserved_bytes(self) -> int:
        """Bytes set aside for puts in progress (:meth:`reserve`)."""
        return self._reserved_bytes

    def _used(self) -> int:
        return self._live_bytes + self._pooled_bytes + self._reserved_bytes

    @property
    def used_bytes(self) -> int:
        """Live, pooled and reserved bytes: what ``max_bytes`` bounds."""
        return self._used()

    @property
    def capacity_bytes(self) -> int:
        return self._max

    # -- reservations (the Reserving capability) ---------------------------------------------

    def reserve(self, size: int) -> Reservation | None:
        """A buffer of exactly ``size`` bytes for one put (a recycled one when there is one;
        least recently used entries are evicted to make room). None for a small value (below
        :data:`POOL_MIN_BYTES`: not worth it), one larger than the tier, or when the room is
        all reserved by other puts in progress.

        A plain :meth:`put` made while the room is all reserved is still stored (a put never
        fails for want of room): the tier then exceeds ``max_bytes`` by at most that one
        value (each such put evicts the previous one first), until the reservations are
        stored or cancelled, which evict back within the bound. Only a tier smaller than the
        data plane's buffer pool can get there: every reservation belongs to a put in
        progress, which holds at least as many bytes of the pool."""
        self._check_open()
        if size < POOL_MIN_BYTES or size > self._max:
            return None
        buf = self._take_pooled(size)
        if buf is None:
            self._make_room(size)
            buf = self._take_pooled(size)
        if buf is None:
            if self._used() + size > self._max:
                return None
            buf = self._fresh(size)
        self._reserved_bytes += size
        return Reservation(self, buf)

    async def put_reserved(
        self, key: str, reserved: Reserved, *, expires_at: float | None = None
    ) -> None:
        self._check_open()
        check_key(self._name, key)
        if not isinstance(reserved, Reservation):
            raise TierError(f"tier {self._name}: not a reservation of a memory tier")
        buf = reserved.take(self)
        size = len(buf)
        self._reserved_bytes -= size
        self._remove(key)
        if expires_at is not None and expires_at <= self._clock():
            self._recycle(buf)
            return
        self._entries[key] = _Entry(buf, expires_at)
        self._live_bytes += size
        self._restore_bound(keep=key)

    def _fresh(self, size: int) -> Pooled:
        """A fresh buffer for a reservation, its pages being faulted in by the tier's thread
        while the caller starts writing it (:mod:`~kvgov.connectors.tiers.pages`)."""
        buf = map_buffer(size)
        if isinstance(buf, mmap.mmap):
            if self._populator is None:
                self._populator = ThreadPoolExecutor(
                    1, thread_name_prefix=f"kvgov-{self._name}-pages"
                )
            self._populator.submit(populate, buf)
        return buf

    def _unreserve(self, buf: Pooled) -> None:
        if self._closed:
            return
        self._reserved_bytes -= len(buf)
        self._recycle(buf)
        self._restore_bound()

    def _restore_bound(self, keep: str | None = None) -> None:
        """Back within ``max_bytes`` after a put that found the room all reserved (see
        :meth:`reserve`): free pooled buffers, then evict least recently used entries other
        than ``keep``."""
        if self._used() <= self._max:
            return
        for pool_size in list(self._pool):
            self._pooled_bytes -= pool_size * len(self._pool.pop(pool_size))
        victims = (k for k in list(self._entries) if k != keep)
        while self._used() > self._max:
            victim = next(victims, None)
            if victim is None:
                return
            entry = self._entries.pop(victim)
            self._live_bytes -= len(entry.buf)
            self._evictions += 1
            self._notify_evict(victim, len(entry.buf))

    # -- the Tier protocol -------------------------------------------------------------------

    async def put(self, key: str, data: BytesLike, *, expires_at: float | None = None) -> None:
        self._check_open()
        check_key(self._name, key)
        src = as_bytes_view(data)
        size = src.nbytes
        if size > self._max:
            raise TierError(
                f"tier {self._name}: a {size}-byte value exceeds the tier's {self._max} bytes",
                hint="raise tiers.memory_max_bytes or keep chunks this large in a slower tier",
            )
        self._remove(key)  # an overwrite recycles the old buffer, often for this very put
        if expires_at is not None and expires_at <= self._clock():
            return
        stored: Buffer
        if size < POOL_MIN_BYTES:
            self._make_room(size)
            stored = bytes(src)
        else:
            stored = self._buffer_for(size)
            copy_into(memoryview(stored), src)  # one memcpy, without the GIL when large
        self._entries[key] = _Entry(stored, expires_at)
        self._live_bytes += size

    async def get_into(self, key: str, dst: memoryview) -> int | None:
        entry = self._lookup(key, count=True)
        if entry is None:
            return None
        size = len(entry.buf)
        if size > dst.nbytes:
            raise DestinationTooSmallError(self._name, size, dst.nbytes)
        copy_into(dst, memoryview(entry.buf))
        return size

    def borrow(self, key: str) -> Borrowed | None:
        """The stored value as a read-only view under a read guard (release it when done),
        or None; counts a hit (a miss is left to the ``get_into`` that usually follows)."""
        entry = self._lookup(key, count=False)
        if entry is None:
            return None
        self._hits += 1
        ident = id(entry.buf)
        self._pins[ident] = self._pins.get(ident, 0) + 1
        return Borrowed(memoryview(entry.buf).toreadonly(), self._pins, ident)

    async def get(self, key: str) -> bytes | None:
        entry = self._lookup(key, count=True)
        return None if entry is None else bytes(entry.buf)

    async def size_of(self, key: str) -> int | None:
        entry = self._lookup(key, count=False)
        return None if entry is None else len(entry.buf)

    async def info(self, key: str) -> EntryInfo | None:
        entry = self._lookup(key, count=False)
        return None if entry is None else EntryInfo(len(entry.buf), entry.expires_at)

    async def contains(self, key: str) -> bool:
        return self._lookup(key, count=False) is not None

    async def delete(self, key: str) -> bool:
        self._check_open()
        entry = self._entries.get(key)
        live = entry is not None and not self._expired(entry, self._clock())
        self._remove(key)
        return live

    async def iter_keys(self) -> AsyncIterator[str]:
        now = self._clock()
        for key, entry in list(self._entries.items()):
            if not self._expired(entry, now):
                yield key

    async def sweep(self, now: float) -> list[str]:
        self._check_open()
        gone = [k for k, e in self._entries.items() if self._expired(e, now)]
        for key in gone:
            self._remove(key)
        self._expirations += len(gone)
        return gone

    async def stats(self) -> TierStats:
        return TierStats(
            name=self._name,
            entries=len(self._entries),
            bytes=self._live_bytes,
            hits=self._hits,
            misses=self._misses,
            evictions=self._evictions,
            expirations=self._expirations,
            capacity_bytes=self._max,
        )

    async def close(self) -> None:
        if self._populator is not None:
            self._populator.shutdown(wait=False, cancel_futures=True)
        self._entries.clear()
        self._pool.clear()
        self._live_bytes = self._pooled_bytes = self._reserved_bytes = 0
        self._closed = True

    # -- internals ---------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TierError(f"tier {self._name} is closed")

    @staticmethod
    def _expired(entry: _Entry, now: float) -> bool:
        return entry.expires_at is not None and entry.expires_at <= now

    def _lookup(self, key: str, *, count: bool) -> _Entry | None:
        """The live entry (now most recently used), removing it if it expired."""
        self._check_open()
        entry = self._entries.get(key)
        if entry is not None and self._expired(entry, self._clock()):
            self._remove(key)
            self._expirations += 1
            entry = None
        if entry is None:
            if count:
                self._misses += 1
            return None
        self._entries.move_to_end(key)
        if count:
            self._hits += 1
        return entry

    def _remove(self, key: str) -> _Entry | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._live_bytes -= len(entry.buf)
            self._recycle(entry.buf)
        return entry

    def _recycle(self, buf: Buffer) -> None:
        size = len(buf)
        if isinstance(buf, bytes) or size < POOL_MIN_BYTES or id(buf) in self._pins:
            return
        if self._used() + size > self._max:
            return  # no room to keep it: let it go
        self._pool.setdefault(size, []).append(buf)
        self._pooled_bytes += size

    def _take_pooled(self, size: int) -> Pooled | None:
        bufs = self._pool.get(size)
        if not bufs:
            return None
        buf = bufs.pop()
        if not bufs:
            del self._pool[size]
        self._pooled_bytes -= size
        return buf

    def _buffer_for(self, size: int) -> Pooled:
        """A buffer of exactly ``size`` bytes: a pooled one, an evicted one, or a new one."""
        buf = self._take_pooled(size)
        if buf is not None:
            return buf
        self._make_room(size)
        pooled = self._take_pooled(size)
        return pooled if pooled is not None else new_buffer(size)

    def _make_room(self, size: int) -> None:
        """Free pooled buffers, then evict least recently used entries, until ``size`` fits.

        An evicted buffer of exactly ``size`` bytes is parked in the pool for the caller.
        """
        for pool_size in list(self._pool):
            if self._used() + size <= self._max:
                return
            self._pooled_bytes -= pool_size * len(self._pool.pop(pool_size))
        while self._entries and self._used() + size > self._max:
            victim, entry = self._entries.popitem(last=False)
            self._live_bytes -= len(entry.buf)
            self._evictions += 1
            self._notify_evict(victim, len(entry.buf))
            if (
                len(entry.buf) == size
                and not isinstance(entry.buf, bytes)
                and id(entry.buf) not in self._pins
            ):
                self._pool.setdefault(size, []).append(entry.buf)
                self._pooled_bytes += size
                return

    def _notify_evict(self, key: str, size: int) -> None:
        notify_evict(log, self._on_evict, self._name, key, size)

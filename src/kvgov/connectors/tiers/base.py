"""The tier interface: where the sidecar keeps sealed chunks (ciphertext), under opaque keys.

A tier maps an opaque string key (the data plane passes a keyed digest of the cache key, never
the raw key) to a byte string with an optional absolute expiry (``time.time()`` seconds).

Contract every backend keeps (``tests/contract/test_tiers.py`` checks it):

- ``put`` copies what it keeps: the caller's buffer may be reused as soon as ``put`` returns.
  A put replaces any previous value and expiry of that key. A put whose ``expires_at`` is
  already past stores nothing (and removes an older value).
- ``get_into`` writes the value into ``dst`` and returns its length, or ``None`` on a miss.
  A destination shorter than the value raises :class:`DestinationTooSmallError` (its
  ``needed`` says how many bytes to provide) and writes nothing the caller may rely on.
- Expired entries are misses everywhere (``get``, ``get_into``, ``contains``, ``size_of``,
  ``iter_keys``) and are removed when noticed; ``sweep(now)`` removes the expired entries it can
  find and returns their keys.
- Backend failures raise :class:`kvgov.errors.TierError`; a miss is never an error.
- A cancelled call returns only after the backend has stopped touching the caller's buffer.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvgov.errors import TierError

#: what ``put`` accepts; memoryviews must be C-contiguous bytes (format ``B``)
BytesLike = bytes | bytearray | memoryview

#: ``on_evict(tier_name, key, nbytes)``: a tier dropped a live entry to make room
EvictListener = Callable[[str, str, int], None]


class DestinationTooSmallError(TierError):
    """``get_into`` was given a destination shorter than the stored value."""

    code = "tier_destination_too_small"

    def __init__(self, tier: str, needed: int, given: int) -> None:
        super().__init__(
            f"tier {tier}: destination holds {given} bytes, the value needs {needed}",
            hint="ask size_of() first and pass a destination at least that long",
        )
        self.needed = needed
        self.given = given


@dataclass(frozen=True, slots=True)
class EntryInfo:
    """Size and expiry of one stored value."""

    size: int
    #: absolute expiry in ``time.time()`` seconds, or None for no expiry
    expires_at: float | None


@dataclass(frozen=True, slots=True)
class TierStats:
    """Counters of one tier. ``hits``/``misses``/``evictions`` count since this instance started."""

    name: str
    entries: int
    bytes: int
    hits: int
    misses: int
    evictions: int
    expirations: int
    #: the most bytes the tier holds, where it has a bound of its own
    capacity_bytes: int | None = None


class Tier(Protocol):
    """One storage backend. Every method is safe to call concurrently from one event loop."""

    @property
    def name(self) -> str:
        """Stable tier name used in policy (allowed tiers), ledger events and metrics."""
        ...

    async def put(self, key: str, data: BytesLike, *, expires_at: float | None = None) -> None:
        """Store a copy of ``data`` under ``key`` (replacing any previous value)."""
        ...

    async def get_into(self, key: str, dst: memoryview) -> int | None:
        """Copy the value into ``dst[:n]`` and return ``n``; ``None`` on a miss or expiry."""
        ...

    async def get(self, key: str) -> bytes | None:
        """The value as new ``bytes`` (a convenience: the data path uses ``get_into``)."""
        ...

    async def size_of(self, key: str) -> int | None:
        """Length of the value, or ``None`` on a miss."""
        ...

    async def info(self, key: str) -> EntryInfo | None:
        """Length and expiry of the value, or ``None`` on a miss."""
        ...

    async def contains(self, key: str) -> bool: ...

    async def delete(self, key: str) -> bool:
        """Remove the value; ``True`` if there was a live one."""
        ...

    def iter_keys(self) -> AsyncIterator[str]:
        """Every live key (a snapshot; entries put while iterating may or may not appear)."""
        ...

    async def sweep(self, now: float) -> list[str]:
        """Remove entries whose expiry is at or before ``now``; return their keys."""
        ...

    async def stats(self) -> TierStats: ...

    async def close(self) -> None:
        """Release connections and files; the tier is unusable afterwards."""
        ...


@runtime_checkable
class Measured(Protocol):
    """An optional tier capability: what it holds against a bound of its own, read without
    awaiting (the ``kvgov_tier_bytes`` gauges sample it at scrape time, from any thread)."""

    @property
    def used_bytes(self) -> int:
        """The bytes the tier's bound counts now."""
        ...

    @property
    def capacity_bytes(self) -> int | None:
        """The bound (None: none)."""
        ...


class BorrowedValue(Protocol):
    """A read-only view of a stored value under a read guard (see :class:`Borrowing`)."""

    view: memoryview

    def release(self) -> None:
        """End the guard (idempotent); the view must not be used afterwards."""
        ...


class Borrowing(Protocol):
    """An optional tier capability: read a value in place, without copying it."""

    def borrow(self, key: str) -> BorrowedValue | None:
        """The live value under a read guard (a delete, overwrite or eviction meanwhile
        leaves the borrowed bytes unchanged), or None on a miss."""
        ...


class Reserved(Protocol):
    """A buffer a tier set aside for one value (see :class:`Reserving`)."""

    #: the value's bytes, writable (from any thread) until it is stored or cancelled
    view: memoryview

    def cancel(self) -> None:
        """Give the buffer back unstored (idempotent; a no-op once stored). Whoever writes
        into :attr:`view` from another thread must have stopped first."""
        ...


class Reserving(Protocol):
    """An optional tier capability: the caller writes a value straight into the tier's own
    buffer (the data plane seals into it), which is then stored without a copy."""

    def reserve(self, size: int) -> Reserved | None:
        """A writable buffer of exactly ``size`` bytes, counted against the tier's capacity
        until it is stored or cancelled; None when the tier will not set one aside (the
        caller then uses ``put``)."""
        ...

    async def put_reserved(
        self, key: str, reserved: Reserved, *, expires_at: float | None = None
    ) -> None:
        """Store the reserved buffer (its whole length) under ``key``, as ``put`` would store
        a copy; the buffer is the tier's from here (the caller must not touch it again)."""
        ...


def notify_evict(
    log: logging.Logger, listener: EvictListener | None, tier: str, key: str, size: int
) -> None:
    """Tell ``listener`` (a tier's ``on_evict``) that ``tier`` dropped ``key`` (``size``
    bytes) to make room; a listener's error is logged on ``log`` (the tier's), never raised
    into the put that made the room."""
    log.debug("tier.evict", extra={"tier": tier, "nbytes": size})
    if listener is None:
        return
    try:
        listener(tier, key, size)
    except Exception:
        log.exception("tier.evict_listener_failed", extra={"tier": tier})


def check_key(tier: str, key: str) -> None:
    """Refuse keys no backend can store faithfully (empty, over 1024 bytes, control chars)."""
    if not key or len(key) > 1024 or not key.isprintable():
        raise TierError(
            f"tier {tier}: invalid key (length {len(key)})",
            hint="tier keys are digests: non-empty printable strings up to 1024 characters",
        )


#: copies at least this large go through :func:`copy_into`'s GIL-free path
NOGIL_COPY_BYTES = 256 * 1024


def copy_into(dst: memoryview, src: memoryview) -> None:
    """``dst[: len(src)] = src``; a large copy runs without the GIL (a ctypes call releases
    it), so the sidecar's other threads (ledger writer, crypto) keep running meanwhile,
    where a memoryview slice assignment would hold the GIL for the whole copy (~0.1 ms per MiB
    when the pages are warm, several times that when they are not)."""
    n = src.nbytes
    if n >= NOGIL_COPY_BYTES and not dst.readonly and not src.readonly and dst.nbytes >= n:
        target = (ctypes.c_char * n).from_buffer(dst)
        source = (ctypes.c_char * n).from_buffer(src)
        ctypes.memmove(target, source, n)
        del target, source  # release the buffer exports at once
        return
    dst[:n] = src


def as_bytes_view(data: BytesLike) -> memoryview:
    """A flat byte view of ``data`` without copying."""
    view = memoryview(data)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view

"""The tier chain: tiers in lookup order (fastest first), written through, read with promotion.

- **put** writes to every configured tier whose name is in ``allowed`` (the policy decision for
  this chunk) and removes the key from the other tiers, so an entry lives exactly where the
  policy allows it. If a write fails, the key is removed from every tier and the error raised:
  a half-written entry is never left for a later read.
- **get_into** looks the key up in order; a hit in a slower tier is copied ("promoted") into
  the faster tiers named in ``allowed``, with the same expiry.
- **reserve** / **put_reserved**: the value is written straight into the fastest tier's own
  buffer, which that tier then keeps (no copy); slower allowed tiers copy from it first.
- **borrow** lends the value in place from the fastest tier when it can (no copy).
- **delete** removes the key from every tier and says which held it; **where** says which
  tiers hold it now (used to verify a purge); **sweep** removes expired entries everywhere.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import cast

from kvgov.connectors.tiers.base import (
    BorrowedValue,
    Borrowing,
    BytesLike,
    EntryInfo,
    Reserved,
    Reserving,
    Tier,
    TierStats,
)
from kvgov.errors import TierError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ChainHit:
    """Where a lookup found the value, how long it is, and where it was promoted to."""

    tier: str
    nbytes: int
    promoted: tuple[str, ...] = ()


class TierChain:
    """Tiers in lookup order. Every operation is safe to call concurrently on one loop."""

    def __init__(self, tiers: Sequence[Tier]) -> None:
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise TierError(f"tier names must be unique in a chain: {names}")
        self._tiers = tuple(tiers)
        #: a tier's name is fixed at construction: the tuple is built once, not per put
        self._names = tuple(names)
        self._name_set = frozenset(names)

    @property
    def names(self) -> tuple[str, ...]:
        return self._names

    def holds_any(self, allowed: Collection[str]) -> bool:
        """Whether any tier of the chain is named in ``allowed``."""
        return not self._name_set.isdisjoint(allowed)

    @property
    def tiers(self) -> tuple[Tier, ...]:
        return self._tiers

    def tier(self, name: str) -> Tier:
        for t in self._tiers:
            if t.name == name:
                return t
        raise KeyError(name)

    async def put(
        self,
        key: str,
        data: BytesLike,
        *,
        allowed: Collection[str],
        expires_at: float | None = None,
    ) -> tuple[str, ...]:
        """Write through to the allowed tiers; return the names written (in chain order).

        Allowed names that are not configured are ignored; an empty result means no tier may
        hold this chunk. The caller's buffer is free again when this returns.
        """
        targets = [t for t in self._tiers if t.name in allowed]
        others = [t for t in self._tiers if t.name not in allowed]
        await self._write_through(key, data, targets, others, expires_at)
        return tuple(t.name for t in targets)

    def reserve(self, size: int, *, allowed: Collection[str]) -> Reserved | None:
        """A buffer of the fastest tier to write a value of ``size`` bytes into, when that tier
        may hold it (``allowed``) and can set one aside (:class:`Reserving`); else None."""
        first = self._tiers[0] if self._tiers else None
        if first is None or first.name not in allowed or not hasattr(first, "reserve"):
            return None
        reserving: Reserving = first  # type: ignore[assignment]  # (no runtime cast() call)
        return reserving.reserve(size)

    async def put_reserved(
        self,
        key: str,
        reserved: Reserved,
        *,
        allowed: Collection[str],
        expires_at: float | None = None,
    ) -> tuple[str, ...]:
        """:meth:`put` of a value written into the fastest tier's reservation (from
        :meth:`reserve` with the same ``allowed``): the slower allowed tiers copy it first,
        then the fastest tier keeps the buffer itself. On failure the reservation is cancelled
        and the key removed everywhere, as for :meth:`put`."""
        first, rest = self._tiers[0], self._tiers[1:]
        targets = [t for t in rest if t.name in allowed]
        others = [t for t in rest if t.name not in allowed]
        try:
            # before the fastest tier owns the buffer: from then on it may recycle it
            await self._write_through(key, reserved.view, targets, others, expires_at)
            try:
                reserving: Reserving = first  # type: ignore[assignment]  # (as in reserve)
                await reserving.put_reserved(key, reserved, expires_at=expires_at)
            except Exception as exc:
                await self._delete_everywhere(key)
                raise TierError(
                    f"write-through failed on tier {first.name}; the key was removed from every"
                    " tier"
                ) from exc
        finally:
            reserved.cancel()  # a no-op once stored
        return (first.name, *(t.name for t in targets))

    async def _write_through(
        self,
        key: str,
        data: BytesLike,
        targets: Sequence[Tier],
        others: Sequence[Tier],
        expires_at: float | None,
    ) -> None:
        """Put ``data`` into ``targets`` and delete ``key`` from ``others``; if anything fails,
        remove ``key`` from every tier and raise."""
        results: list[object]
        if len(targets) + len(others) == 1:
            # one tier: await it in place (a gather makes a task, so at least one more pass of
            # the event loop before the put is done; a memory tier never suspends at all)
            op = (
                targets[0].put(key, data, expires_at=expires_at)
                if targets
                else others[0].delete(key)
            )
            try:
                results = [await op]
            except BaseException as exc:  # noqa: BLE001 - handled below, as gather would return it
                results = [exc]
        elif targets or others:
            results = await asyncio.gather(
                *(t.put(key, data, expires_at=expires_at) for t in targets),
                *(t.delete(key) for t in others),
                return_exceptions=True,
            )
        else:
            return
        failures = [
            (t.name, r)
            for t, r in zip([*targets, *others], results, strict=True)
            if isinstance(r, BaseException)
        ]
        if failures:
            await self._delete_everywhere(key)
            name, first = failures[0]
            if isinstance(first, asyncio.CancelledError):
                raise first
            raise TierError(
                f"write-through failed on tier {name}; the key was removed from every tier"
            ) from first

    async def info(self, key: str) -> tuple[str, EntryInfo] | None:
        """The first tier holding ``key`` and the value's size and expiry there."""
        for t in self._tiers:
            found = await t.info(key)
            if found is not None:
                return t.name, found
        return None

    async def size_of(self, key: str) -> int | None:
        found = await self.info(key)
        return None if found is None else found[1].size

    async def get_into(
        self, key: str, dst: memoryview, *, allowed: Collection[str]
    ) -> ChainHit | None:
        """Read the value into ``dst`` from the first tier that has it, promoting it to the
        faster tiers named in ``allowed``. ``DestinationTooSmallError`` if ``dst`` is short."""
        for i, t in enumerate(self._tiers):
            nbytes = await t.get_into(key, dst)
            if nbytes is None:
                continue
            promoted = await self._promote(key, dst[:nbytes], t, self._tiers[:i], allowed)
            return ChainHit(t.name, nbytes, promoted)
        return None

    def borrow(self, key: str) -> BorrowedValue | None:
        """The value in place from the fastest tier, if that tier can lend it and holds it
        (nothing to promote); None otherwise: then ``get_into`` reads it."""
        first = self._tiers[0] if self._tiers else None
        if first is None or not hasattr(first, "borrow"):
            return None
        return cast("Borrowing", first).borrow(key)

    async def get(self, key: str, *, allowed: Collection[str]) -> bytes | None:
        """The value as ``bytes`` (a convenience: the data path uses ``get_into``)."""
        for i, t in enumerate(self._tiers):
            value = await t.get(key)
            if value is None:
                continue
            await self._promote(key, memoryview(value), t, self._tiers[:i], allowed)
            return value
        return None

    async def contains(self, key: str) -> bool:
        for t in self._tiers:
            if await t.contains(key):
                return True
        return False

    async def where(self, key: str) -> list[str]:
        """Names of the tiers holding a live value for ``key`` (in chain order)."""
        found = await asyncio.gather(*(t.contains(key) for t in self._tiers))
        return [t.name for t, present in zip(self._tiers, found, strict=True) if present]

    async def delete(self, key: str) -> list[str]:
        """Remove ``key`` from every tier; return the names of the tiers that held it.

        Every tier is attempted; if any failed, :class:`TierError` is raised afterwards."""
        results = await asyncio.gather(
            *(t.delete(key) for t in self._tiers), return_exceptions=True
        )
        for t, r in zip(self._tiers, results, strict=True):
            if isinstance(r, BaseException):
                raise TierError(f"delete failed on tier {t.name}") from r
        return [t.name for t, held in zip(self._tiers, results, strict=True) if held]

    async def sweep(self, now: float) -> list[str]:
        """Remove entries expired at ``now`` from every tier; return their keys (each once)."""
        seen: dict[str, None] = {}
        for t in self._tiers:
            for key in await t.sweep(now):
                seen.setdefault(key, None)
        return list(seen)

    async def stats(self) -> list[TierStats]:
        return [await t.stats() for t in self._tiers]

    async def close(self) -> None:
        """Close every tier (each is attempted even if another fails)."""
        results = await asyncio.gather(*(t.close() for t in self._tiers), return_exceptions=True)
        for t, r in zip(self._tiers, results, strict=True):
            if isinstance(r, BaseException):
                log.error("tier.close_failed", extra={"tier": t.name, "error": type(r).__name__})

    # -- internals ---------------------------------------------------------------------------

    async def _promote(
        self,
        key: str,
        value: memoryview,
        source: Tier,
        faster: Sequence[Tier],
        allowed: Collection[str],
    ) -> tuple[str, ...]:
        targets = [t for t in faster if t.name in allowed]
        if not targets:
            return ()
        info = await source.info(key)
        if info is None:
            return ()  # expired or deleted meanwhile: serve this read, keep no copy
        promoted = []
        for t in targets:
            try:
                await t.put(key, value, expires_at=info.expires_at)
            except TierError as exc:
                # a failed promotion costs only speed: the value stays in the slower tier
                log.warning(
                    "tier.promote_failed",
                    extra={"tier": t.name, "source": source.name, "error": exc.code},
                )
                continue
            promoted.append(t.name)
        return tuple(promoted)

    async def _delete_everywhere(self, key: str) -> None:
        results = await asyncio.gather(
            *(t.delete(key) for t in self._tiers), return_exceptions=True
        )
        for t, r in zip(self._tiers, results, strict=True):
            if isinstance(r, BaseException):
                log.error("tier.rollback_failed", extra={"tier": t.name, "error": type(r).__name__})

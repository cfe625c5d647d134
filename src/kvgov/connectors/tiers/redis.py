"""The Redis tier (the ``redis`` extra): values under ``<prefix><key>``, expiry by Redis itself.

``redis.asyncio`` with the hiredis parser; ``redis`` is imported only when a tier is built, so
the sidecar runs without the extra when no Redis tier is configured. Expiry is an absolute
``PXAT`` on the ``SET``, so Redis removes expired values on its own: ``sweep`` has nothing to
report and returns ``[]`` (the ledger's entry index remains the record of what expired).

Redis returns a value as one ``bytes`` object, so ``get_into`` copies it once into the caller's
buffer: this is the remote tier, bound by the network (see ``docs/performance.md``).

Several sidecars may share one Redis, so a value no entry this sidecar knows of may be another
sidecar's put whose ledger row is not committed yet (a put writes its tiers first). For the
start-up reconciliation (``kvgov.proxy.dataplane.upkeep``), :meth:`RedisTier.delete_idle`
deletes a value only if nothing wrote or read it for a while, checked and deleted atomically
(a Lua script: ``OBJECT IDLETIME``, then ``DEL``).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvgov.connectors.tiers.base import (
    BytesLike,
    DestinationTooSmallError,
    EntryInfo,
    TierStats,
    as_bytes_view,
    check_key,
)
from kvgov.errors import TierError

_T = TypeVar("_T")
_GLOB_SPECIAL = re.compile(r"([*?\[\]\\])")
_SCAN_BATCH = 1000

#: KEYS[1] a value, ARGV[1] the least idle time (seconds) of one to delete. Returns the size
#: deleted, or -1: idle time unknown (an LFU ``maxmemory-policy`` tracks none; an ACL may
#: refuse ``OBJECT``), -2: no such value, -3: touched too recently, -4: not a string (not the
#: tier's). ``OBJECT IDLETIME`` comes first: it does not touch the value, ``STRLEN`` would.
_DELETE_IDLE = """
local ok, idle = pcall(redis.call, 'OBJECT', 'IDLETIME', KEYS[1])
if not ok then return -1 end
if not idle then return -2 end
if idle < tonumber(ARGV[1]) then return -3 end
if redis.call('TYPE', KEYS[1]).ok ~= 'string' then return -4 end
local size = redis.call('STRLEN', KEYS[1])
redis.call('DEL', KEYS[1])
return size
"""


@dataclass
class IdleDeletion:
    """What :meth:`RedisTier.delete_idle` did: the values it deleted (key → size), and how many
    it kept because something touched them too recently (``young``) or because their idle time
    is unknown (``unknown``: nothing is deleted then)."""

    removed: dict[str, int] = field(default_factory=dict)
    young: int = 0
    unknown: int = 0


class RedisTier:
    """A :class:`~kvgov.connectors.tiers.base.Tier` in Redis. Build it with :meth:`connect`."""

    def __init__(
        self,
        client: Any,
        *,
        prefix: str,
        name: str = "redis",
        errors: tuple[type[BaseException], ...] = (OSError,),
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._client = client
        self._prefix = prefix
        self._pattern = _GLOB_SPECIAL.sub(r"\\\1", prefix) + "*"
        self._name = name
        self._errors = errors
        self._clock = clock
        self._hits = self._misses = 0
        self._closed = False

    @classmethod
    async def connect(
        cls, url: str, *, prefix: str, name: str = "redis", max_connections: int = 64
    ) -> RedisTier:
        """Connect (and ``PING``) a Redis at ``url``; a failure raises :class:`TierError`."""
        try:
            import redis.asyncio as aioredis
            from redis.exceptions import RedisError
        except ImportError as exc:
            raise TierError(
                f"tier {name}: the redis package is not installed",
                hint="install the redis extra: pip install 'kvgov[redis]'",
            ) from exc
        client = aioredis.Redis.from_url(url, max_connections=max_connections)
        tier = cls(client, prefix=prefix, name=name, errors=(RedisError, OSError))
        try:
            await tier._call(client.ping())
        except TierError:
            await client.aclose()
            raise
        return tier

    @property
    def name(self) -> str:
        return self._name

    @property
    def prefix(self) -> str:
        return self._prefix

    # -- the Tier protocol -------------------------------------------------------------------

    async def put(self, key: str, data: BytesLike, *, expires_at: float | None = None) -> None:
        check_key(self._name, key)
        rkey = self._rkey(key)
        if expires_at is None:
            await self._call(self._client.set(rkey, as_bytes_view(data)))
        elif math.isnan(expires_at) or expires_at <= self._clock():
            await self._call(self._client.delete(rkey))
        else:
            pxat = math.ceil(expires_at * 1000)
            await self._call(self._client.set(rkey, as_bytes_view(data), pxat=pxat))

    async def get_into(self, key: str, dst: memoryview) -> int | None:
        value = await self._fetch(key)
        if value is None:
            return None
        size = len(value)
        if size > dst.nbytes:
            raise DestinationTooSmallError(self._name, size, dst.nbytes)
        dst[:size] = value
        return size

    async def get(self, key: str) -> bytes | None:
        return await self._fetch(key)

    async def size_of(self, key: str) -> int | None:
        info = await self.info(key)
        return None if info is None else info.size

    async def info(self, key: str) -> EntryInfo | None:
        self._check_open()
        rkey = self._rkey(key)
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.execute_command("PEXPIRETIME", rkey)
            pipe.strlen(rkey)
            expire_ms, size = await self._call(pipe.execute())
        if expire_ms == -2:
            return None
        return EntryInfo(int(size), None if expire_ms == -1 else expire_ms / 1000.0)

    async def contains(self, key: str) -> bool:
        self._check_open()
        return bool(await self._call(self._client.exists(self._rkey(key))))

    async def delete(self, key: str) -> bool:
        self._check_open()
        return bool(await self._call(self._client.delete(self._rkey(key))))

    async def iter_keys(self) -> AsyncIterator[str]:
        self._check_open()
        cut = len(self._prefix.encode())
        cursor = 0
        while True:
            cursor, batch = await self._call(
                self._client.scan(cursor, match=self._pattern, count=_SCAN_BATCH)
            )
            for rkey in batch:
                try:
                    yield bytes(rkey)[cut:].decode()
                except UnicodeDecodeError:  # not a key the tier writes (those are text)
                    continue
            if cursor == 0:
                return

    async def sweep(self, now: float) -> list[str]:
        self._check_open()
        return []  # Redis removes expired values itself (PXAT)

    async def delete_idle(self, keys: Sequence[str], min_idle_s: int) -> IdleDeletion:
        """Delete each of ``keys`` whose value nothing wrote or read for ``min_idle_s`` seconds
        or more (Redis's ``OBJECT IDLETIME``, one-second resolution), each checked and deleted
        in one atomic step, so a put or a read between the two keeps it. A value whose idle
        time Redis cannot tell (an LFU ``maxmemory-policy``, an ACL refusing ``OBJECT``) is
        kept, and so is one that is not a string. One round trip (a pipeline)."""
        self._check_open()
        out = IdleDeletion()
        if not keys:
            return out
        for key in keys:
            check_key(self._name, key)
        async with self._client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.eval(_DELETE_IDLE, 1, self._rkey(key), max(0, int(min_idle_s)))
            results = await self._call(pipe.execute(raise_on_error=False))
        for key, result in zip(keys, results, strict=True):
            if isinstance(result, int) and result >= 0:
                out.removed[key] = result
            elif result == -3:
                out.young += 1
            elif result != -2:  # -1, -4, or the script refused (NOPERM, NOSCRIPT): kept
                out.unknown += 1
        return out

    async def stats(self) -> TierStats:
        """Counts every key under the prefix (a SCAN: for operators, not the data path)."""
        entries = nbytes = 0
        batch: list[str] = []
        async for key in self.iter_keys():
            batch.append(key)
            if len(batch) >= _SCAN_BATCH:
                nbytes += await self._sizes(batch)
                entries += len(batch)
                batch = []
        if batch:
            nbytes += await self._sizes(batch)
            entries += len(batch)
        return TierStats(
            name=self._name,
            entries=entries,
            bytes=nbytes,
            hits=self._hits,
            misses=self._misses,
            evictions=0,
            expirations=0,
        )

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            await self._client.aclose()

    # -- internals ---------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TierError(f"tier {self._name} is closed")

    def _rkey(self, key: str) -> str:
        return self._prefix + key

    async def _fetch(self, key: str) -> bytes | None:
        self._check_open()
        value: bytes | None = await self._call(self._client.get(self._rkey(key)))
        if value is None:
            self._misses += 1
        else:
            self._hits += 1
        return value

    async def _sizes(self, keys: list[str]) -> int:
        async with self._client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.strlen(self._rkey(key))
            return sum(int(n) for n in await self._call(pipe.execute()))

    async def _call(self, awaitable: Awaitable[_T]) -> _T:
        try:
            return await awaitable
        except self._errors as exc:
            raise TierError(f"tier {self._name}: redis failed: {type(exc).__name__}") from exc

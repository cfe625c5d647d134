"""An asyncio face on :class:`kvgov.wire.client.WireClient` (stdlib only).

An engine's event loop must never block on the sidecar: each call runs the blocking client in a
small dedicated thread pool (socket I/O releases the GIL), so the loop keeps serving and several
calls proceed in parallel over the client's connection pool.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvgov.wire.client import Allocator, WireClient
from kvgov.wire.messages import GetResult, PutAck, RequestContext, ServerInfo

T = TypeVar("T")


class AsyncWireClient:
    """The same operations as :class:`WireClient`, awaitable."""

    def __init__(self, client: WireClient, *, threads: int = 4) -> None:
        self.client = client
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvgov-wire")

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args))

    async def hello(self) -> ServerInfo:
        return await self._call(self.client.hello)

    async def ping(self) -> float:
        return await self._call(self.client.ping)

    async def exists(self, key: str, ctx: RequestContext | None = None) -> bool:
        return await self._call(self.client.exists, key, ctx)

    async def exists_many(
        self, keys: Sequence[str], ctx: RequestContext | None = None
    ) -> list[bool]:
        return await self._call(self.client.exists_many, keys, ctx)

    async def get_into(
        self, key: str, buffer: Any, ctx: RequestContext | None = None
    ) -> GetResult | None:
        return await self._call(self.client.get_into, key, buffer, ctx)

    async def get_many(
        self, keys: Sequence[str], ctx: RequestContext | None = None, alloc: Allocator | None = None
    ) -> list[tuple[GetResult | None, Any]]:
        return await self._call(self.client.get_many, keys, ctx, alloc)

    async def put(
        self,
        key: str,
        data: Any,
        ctx: RequestContext | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> PutAck:
        return await self._call(self.client.put, key, data, ctx, meta)

    async def put_many(
        self, items: Sequence[tuple[Any, ...]], ctx: RequestContext | None = None
    ) -> list[PutAck]:
        return await self._call(self.client.put_many, items, ctx)

    async def remove(self, key: str, ctx: RequestContext | None = None) -> bool:
        return await self._call(self.client.remove, key, ctx)

    async def remove_many(
        self, keys: Sequence[str], ctx: RequestContext | None = None
    ) -> list[bool]:
        return await self._call(self.client.remove_many, keys, ctx)

    def close(self) -> None:
        self.client.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

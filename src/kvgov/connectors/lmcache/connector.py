"""``KvgovConnector``: LMCache's remote tier, served by the kvgov sidecar.

Registered through LMCache's ``remote_storage_plugins`` (see ``docs/lmcache.md``), LMCache builds
it as ``KvgovConnector(loop=..., local_cpu_backend=..., config=...)`` and calls it from its
storage event loop (async methods) and from the engine thread (sync methods). It is thin: no
policy, no keys. Every operation becomes one kvgov wire frame carrying the key strings (tenant
and user scope are tags inside them) and the request context from ``request_configs``.

It fails closed and never breaks inference: any error, timeout or unreachable sidecar is a miss
(``exists`` False, ``get`` None) or a skipped put, and no exception reaches LMCache. After a
connection failure a backoff skips the sidecar for a while, so a dead sidecar costs nothing.
A control connection receives the sidecar's EVICT messages (key digests) and removes the
entries they name from the engine's local CPU and disk tiers.

A hit is loaded only into a buffer of the engine's own KV geometry (what LMCache's metadata for
this engine says: layers, hidden size, dtype, memory format, at most one chunk of tokens): a hit
whose stored shape, dtype or format describes anything else (another engine's, or a sidecar's
forgery) is refused as a miss before anything is allocated, logged and counted in
``refused_hits``. ``kvgov.timeout_s`` bounds each request to the sidecar as a whole.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from kvgov.connectors.lmcache import local_tiers
from kvgov.connectors.lmcache.backoff import Backoff
from kvgov.connectors.lmcache.identity import key_string, request_context
from kvgov.connectors.lmcache.settings import ConnectorSettings
from kvgov.wire import (
    ControlChannel,
    EvictRequest,
    GetResult,
    RequestContext,
    WireClient,
    WireConnectionError,
)
from kvgov.wire.client import WireTimeoutError

log = logging.getLogger("kvgov.connectors.lmcache")

T = TypeVar("T")

#: Where the tokens are in a chunk of each memory format, by the chunk shape's rank: the shapes
#: LMCache 0.5.6 itself gives each format's chunk (``lmcache/v1/...``, line numbers of 0.5.6):
#:
#: - ``KV_2LTD``, rank 4: ``[2, layers, tokens, hidden]``: ``LMCacheMetadata.get_shapes``
#:   (``metadata.py:87``), ``VLLMPagedMemGPUConnectorV2.get_shape`` (``gpu_connector/
#:   gpu_connectors.py:427``); the ``meta_shapes`` of every ``RemoteConnector``
#:   (``storage_backend/connector/base_connector.py:60``).
#: - ``KV_MLA_FMT``, rank 4: ``[1, layers, tokens, hidden]``: the same ``get_shapes`` and
#:   ``get_shape`` (kv size 1); a ``RemoteConnector``'s ``meta_fmt`` is this or ``KV_2LTD``
#:   (``base_connector.py:62``).
#: - ``KV_MLA_FMT``, rank 2 (layerwise): ``[tokens, hidden]`` and ``KV_T2D``, rank 3 (layerwise):
#:   ``[tokens, 2, hidden]``: ``VLLMPagedMemLayerwiseGPUConnector.get_shape``
#:   (``gpu_connectors.py:1448``, the formats at 1252 and 1384), ``SGLangLayerwiseGPUConnector``
#:   (1957, 1791).
#: - ``KV_2TD``, rank 3 (layerwise, blending): ``[2, tokens, hidden]``:
#:   ``VLLMBufferLayerwiseGPUConnector.get_shape`` (``gpu_connectors.py:1078``, format at 860).
#:
#: ``RemoteConnector.reshape_partial_chunk`` (``base_connector.py:86``) agrees for ``KV_2LTD``,
#: ``KV_MLA_FMT`` and ``KV_T2D`` (token dimension 2 at rank 4, else 0). ``MemoryFormat.token_dim``
#: (``memory_management.py:114``) is not used: it disagrees with those shapes for ``KV_T2D``
#: (says 1), ``KV_2TD`` (says 0) and a rank-2 ``KV_MLA_FMT`` (says 2), and answers 0 for a
#: format it does not know. Any other format or rank (``UNDEFINED``, ``BINARY*``, ``EC_TD``,
#: ``HS_TD``: not KV chunks) has no known token dimension: only the exact full chunk passes.
_TOKEN_DIMS: dict[tuple[MemoryFormat, int], int] = {
    (MemoryFormat.KV_2LTD, 4): 2,
    (MemoryFormat.KV_MLA_FMT, 4): 2,
    (MemoryFormat.KV_MLA_FMT, 2): 0,
    (MemoryFormat.KV_T2D, 3): 0,
    (MemoryFormat.KV_2TD, 3): 1,
}
#: guards ``refused_hits`` (refusals are rare: a lock costs nothing on the data path)
_STATS_LOCK = threading.Lock()


class KvgovConnector(RemoteConnector):  # type: ignore[misc]
    """A LMCache ``RemoteConnector`` that forwards to the kvgov sidecar."""

    #: hits refused because their stored geometry is not this engine's (each one a miss)
    refused_hits: int = 0

    def __init__(self, loop: Any, local_cpu_backend: Any, config: Any) -> None:
        metadata = getattr(local_cpu_backend, "metadata", None)
        #: the scheduler role passes a stub CPU backend with no metadata and no allocator
        self.worker = metadata is not None
        if self.worker:
            super().__init__(config, metadata)
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.settings = ConnectorSettings.from_extra_config(getattr(config, "extra_config", None))
        s = self.settings
        self.client = WireClient(
            s.endpoint,
            engine_id=s.engine_id,
            token=s.token,
            timeout=s.timeout_s,
            connect_timeout=s.connect_timeout_s,
            pool_size=s.pool_size,
            sidecar_uids=s.sidecar_uids,
        )
        #: blocking wire calls run here, so LMCache's event loop never waits on a socket
        self.pool = ThreadPoolExecutor(max_workers=s.pool_size, thread_name_prefix="kvgov-conn")
        #: frames of one batched put sent in parallel (a separate pool: no self-deadlock)
        self.fanout = ThreadPoolExecutor(max_workers=s.pool_size, thread_name_prefix="kvgov-put")
        self.backoff = Backoff(s.backoff_initial_s, s.backoff_max_s)
        #: operations submitted and not finished (LMCache does not track batched puts itself)
        self._inflight = 0
        self._idle = threading.Condition()
        self.control: ControlChannel | None = None
        if self.worker and s.control:
            self.control = self.client.control(
                on_evict=self.evict_local, reconnect_delay=s.control_reconnect_s
            )
        log.info(
            "lmcache.connector.created",
            extra={"engine_id": s.engine_id, "worker": self.worker, "control": s.control},
        )

    # -- fail closed ---------------------------------------------------------------------------

    def _guard(self, op: str, fn: Callable[[], T], *, default: T) -> T:
        if not self.backoff.allow():
            return default
        try:
            result = fn()
        except WireTimeoutError as exc:
            # the connection that timed out is closed (never reused mid-frame)
            self.backoff.failure()
            log.warning("lmcache.connector.timeout", extra={"op": op, "error": exc.code})
            return default
        except WireConnectionError as exc:
            self.backoff.failure()
            log.warning("lmcache.connector.unreachable", extra={"op": op, "error": exc.code})
            return default
        except Exception as exc:  # noqa: BLE001 - nothing may escape into LMCache
            log.warning("lmcache.connector.failed", extra={"op": op, "error": type(exc).__name__})
            return default
        self.backoff.success()
        return result

    async def _aguard(self, op: str, fn: Callable[[], T], *, default: T) -> T:
        if not self.backoff.allow():
            return default
        call = functools.partial(self._guard, op, fn, default=default)
        with self._idle:
            self._inflight += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, call)
        finally:
            with self._idle:
                self._inflight -= 1
                if not self._inflight:
                    self._idle.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no operation is in flight (puts included); False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._inflight, timeout_s)

    # -- helpers -------------------------------------------------------------------------------

    def _frames(
        self, keys: Sequence[Any], item_bytes: Sequence[int], *, max_bytes: int | None = None
    ) -> Iterator[list[int]]:
        """Index groups that share one request context and fit the frame/batch limits."""
        info = self.client.info
        max_items = info.max_batch if info else 4096
        max_bytes = min(
            max_bytes or self.settings.max_frame_bytes,
            self.settings.max_frame_bytes,
            info.max_frame_bytes if info else 1 << 62,
        )
        group: list[int] = []
        ctx: RequestContext | None = None
        size = 0
        for i, key in enumerate(keys):
            key_ctx = request_context(key)
            if group and (
                key_ctx != ctx or len(group) >= max_items or size + item_bytes[i] > max_bytes
            ):
                yield group
                group, size = [], 0
            if not group:
                ctx = key_ctx
            group.append(i)
            size += item_bytes[i]
        if group:
            yield group

    def _exists_prefix(self, keys: Sequence[Any]) -> int:
        if not keys:
            return 0
        count = 0
        for group in self._frames(keys, [0] * len(keys)):
            found = self.client.exists_many(
                [key_string(keys[i]) for i in group], request_context(keys[group[0]])
            )
            for hit in found:
                if not hit:
                    return count
                count += 1
        return count

    def _put_many(self, keys: Sequence[Any], objs: Sequence[MemoryObj]) -> int:
        """Send the chunks in frames of at most ``put_frame_bytes``, several frames at once on
        the client's connections, so the sidecar seals and stores them in parallel."""
        sizes = [int(obj.get_size()) for obj in objs]
        limit = self.settings.put_frame_bytes

        def send(group: list[int]) -> int:
            items = [(key_string(keys[i]), objs[i].byte_array, _entry_meta(objs[i])) for i in group]
            acks = self.client.put_many(items, request_context(keys[group[0]]))
            return sum(1 for ack in acks if ack.ok)

        groups = list(self._frames(keys, sizes, max_bytes=limit))
        if len(groups) == 1:
            return send(groups[0])
        return sum(self.fanout.map(send, groups))

    def _get_many(self, keys: Sequence[Any]) -> list[MemoryObj | None]:
        """Read hits straight into buffers allocated from LMCache's CPU backend."""
        out: list[MemoryObj | None] = [None] * len(keys)
        if not self.worker:
            return out
        full = int(self.full_chunk_size_bytes)
        for group in self._frames(keys, [full] * len(keys)):
            #: each hit's result and buffer, by the result's id (a hit the sidecar withdrew
            #: after announcing it comes back a miss: its buffer goes back)
            allocated: dict[int, tuple[GetResult, MemoryObj]] = {}

            def alloc(
                result: GetResult, allocated: dict[int, tuple[GetResult, MemoryObj]] = allocated
            ) -> Any:
                obj = self._allocate(result)
                if obj is None:
                    return None
                allocated[id(result)] = (result, obj)
                return obj.byte_array

            try:
                # no hit may exceed a chunk: a reply announcing more is a protocol error
                replies = self.client.get_many(
                    [key_string(keys[i]) for i in group],
                    request_context(keys[group[0]]),
                    alloc,
                    max_bytes=full * len(group),
                )
            except BaseException:
                for _, obj in allocated.values():
                    obj.ref_count_down()
                raise
            for i, (result, _buf) in zip(group, replies, strict=True):
                if result is not None:
                    out[i] = allocated.pop(id(result))[1]
            for _, obj in allocated.values():
                obj.ref_count_down()
        return out

    def _allocate(self, result: GetResult) -> MemoryObj | None:
        """A MemoryObj for the hit in the engine's own geometry, or None to skip the item (a
        hit of any other geometry is refused: a miss, logged and counted, nothing allocated)."""
        fmt = MemoryFormat(self.meta_fmt)
        geometry = _hit_geometry(
            result.meta,
            result.length,
            shapes=list(self.meta_shapes),
            dtypes=list(self.meta_dtypes),
            fmt=fmt,
            full_bytes=int(self.full_chunk_size_bytes),
        )
        if isinstance(geometry, str):
            with _STATS_LOCK:
                self.refused_hits = getattr(self, "refused_hits", 0) + 1
            log.warning(
                "lmcache.connector.foreign_hit",
                extra={"reason": geometry, "length": result.length, "meta": _brief(result.meta)},
            )
            return None
        shapes, dtypes = geometry
        obj: MemoryObj | None = self.local_cpu_backend.allocate(
            shapes, dtypes, fmt, busy_loop=False
        )
        return obj

    # -- RemoteConnector: single-key operations ------------------------------------------------

    async def exists(self, key: Any) -> bool:
        return await self._aguard("exists", lambda: self._exists_prefix([key]) == 1, default=False)

    def exists_sync(self, key: Any) -> bool:
        return self._guard("exists", lambda: self._exists_prefix([key]) == 1, default=False)

    async def get(self, key: Any) -> MemoryObj | None:
        result: list[MemoryObj | None] = await self._aguard(
            "get", lambda: self._get_many([key]), default=[None]
        )
        return result[0]

    async def put(self, key: Any, memory_obj: MemoryObj) -> None:
        # LMCache drops its reference when this returns: the bytes are sent before returning
        await self._aguard("put", lambda: self._put_many([key], [memory_obj]), default=0)

    async def close(self) -> None:
        self.close_sync()

    def close_sync(self) -> None:
        self.wait_idle(self.settings.timeout_s)
        if self.control is not None:
            self.control.close()
            self.control = None
        self.client.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.fanout.shutdown(wait=False, cancel_futures=True)

    def remove_sync(self, key: Any) -> bool:
        def remove() -> bool:
            return self.client.remove(key_string(key), request_context(key))

        return self._guard("remove", remove, default=False)

    def support_ping(self) -> bool:
        return True

    async def ping(self) -> int:
        """0 when the sidecar answers, 1 otherwise (LMCache's health check convention)."""
        ok = await self._aguard("ping", lambda: self.client.ping() >= 0, default=False)
        return 0 if ok else 1

    # -- RemoteConnector: batched operations --------------------------------------------------

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: list[Any]) -> list[MemoryObj | None]:
        default: list[MemoryObj | None] = [None] * len(keys)
        return await self._aguard("get", lambda: self._get_many(keys), default=default)

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: list[Any], memory_objs: list[MemoryObj]) -> None:
        await self._aguard("put", lambda: self._put_many(keys, memory_objs), default=0)

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[Any]) -> int:
        return self._guard("exists", lambda: self._exists_prefix(keys), default=0)

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(
        self, lookup_id: str, keys: list[Any], pin: bool = False
    ) -> int:
        return await self._aguard("exists", lambda: self._exists_prefix(keys), default=0)

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(self, lookup_id: str, keys: list[Any]) -> list[MemoryObj]:
        objs = await self.batched_get(keys)
        prefix: list[MemoryObj] = []
        for i, obj in enumerate(objs):
            if obj is None:
                for rest in objs[i + 1 :]:
                    if rest is not None:
                        rest.ref_count_down()
                break
            prefix.append(obj)
        return prefix

    # -- control: EVICT ------------------------------------------------------------------------

    def evict_local(self, request: EvictRequest) -> list[str]:
        """Remove the entries the sidecar's EVICT names (by key digest) from this engine's
        local tiers; the digests of those removed."""
        if not self.worker:
            return []
        return local_tiers.evict(self.local_cpu_backend, request)

    def __repr__(self) -> str:
        return f"<KvgovConnector {self.settings.endpoint} engine={self.settings.engine_id}>"

    # defined last: inside the class body this name shadows the builtin ``list``
    async def list(self) -> list[str]:
        # the wire protocol has no listing: an engine has no business enumerating other keys
        return []


def _hit_geometry(
    meta: Mapping[str, Any],
    length: int,
    *,
    shapes: list[torch.Size],
    dtypes: list[torch.dtype],
    fmt: MemoryFormat,
    full_bytes: int,
) -> tuple[torch.Size | list[torch.Size], torch.dtype | list[torch.dtype]] | str:
    """The shape(s) and dtype(s) to allocate for a hit of ``length`` bytes whose stored entry
    metadata is ``meta``, given the engine's own full-chunk ``shapes``/``dtypes``/``fmt``
    (LMCache's ``RemoteConnector`` attributes); or why the hit is refused.

    Only the engine's geometry passes: its memory format and dtype, and its shape in every
    dimension but the tokens (where they are depends on the format: ``_TOKEN_DIMS``), of which
    there are 1 to a chunk (the last chunk may be short); for a format of no known token
    dimension, exactly its full-chunk shape. A missing ``fmt``/``dtype``/``shape`` stands for
    the engine's own (a full chunk)."""
    stored_fmt = meta.get("fmt", fmt.value)
    if type(stored_fmt) is not int or stored_fmt != fmt.value:
        return "fmt"
    if len(shapes) != 1 or len(dtypes) != 1:
        # several KV layer groups: only a whole chunk, laid out as the engine's own
        if length != full_bytes:
            return "length"
        return list(shapes), list(dtypes)
    own_shape, own_dtype = shapes[0], dtypes[0]
    if meta.get("dtype", _dtype_name(own_dtype)) != _dtype_name(own_dtype):
        return "dtype"
    stored = meta.get("shape", list(own_shape))
    if (
        not isinstance(stored, list)
        or len(stored) != len(own_shape)
        or not all(type(d) is int for d in stored)
    ):
        return "shape"
    token_dim = _token_dim(fmt, len(own_shape))
    for i, (d, own) in enumerate(zip(stored, own_shape, strict=True)):
        if i != token_dim and d != own:
            return "shape"
    if token_dim is not None and not 0 < stored[token_dim] <= own_shape[token_dim]:
        return "tokens"
    shape = torch.Size(stored)
    if shape.numel() * own_dtype.itemsize != length:
        return "length"
    return shape, own_dtype


def _token_dim(fmt: MemoryFormat, rank: int) -> int | None:
    """The index of the tokens in a chunk of ``fmt`` whose shape has ``rank`` dimensions, or
    None where LMCache defines none (then only the exact full chunk is accepted)."""
    return _TOKEN_DIMS.get((fmt, rank))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _brief(meta: Mapping[str, Any]) -> str:
    """A hit's stored metadata for a log line (short; no KV bytes are ever logged)."""
    return repr({k: meta[k] for k in ("fmt", "dtype", "shape") if k in meta})[:200]


def _entry_meta(obj: MemoryObj) -> dict[str, Any]:
    """What the connector needs to allocate the destination of a later get."""
    meta = obj.meta
    return {
        "fmt": int(meta.fmt.value),
        "dtype": _dtype_name(meta.dtype),
        "shape": [int(d) for d in meta.shape],
    }

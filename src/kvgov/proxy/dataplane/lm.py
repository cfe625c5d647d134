"""The ``lm://`` compatibility listener: LMCache 0.5.6's own remote protocol
(``lmcache/v1/protocol.py``), governed by the same pipeline.

Requests are 186 bytes (``iiiiiiiii150s``: command, length, fmt, dtype, location, shape0..3,
key), replies 36 bytes (``iiiiiiiii``: code, length, fmt, dtype, shape0..3, location), native
byte order. PUT has no reply; GET, EXIST and HEALTH do. There is no handshake and no request
context: whoever connects speaks as the declared engine ``dataplane.lm_engine_id``, for the
declared ``dataplane.lm_tenants`` only, with no acting user (so never for user-scoped keys);
the policy admits that engine only where a tenant names it (``"*"`` does not). The listener
is off unless configured (``docs/operations.md``, "Running lm:// safely"). The fmt, dtype,
shape and location a PUT carried are checked (:mod:`kvgov.wire.itemmeta`: an odd one refuses
the PUT as ``bad_item_meta``, recorded), stored with the entry (the dtype by its name, as the
kvgov wire stores it) and returned by GET (the name mapped back to LMCache's int). A stored
value that fails its checks is a miss (``FAIL``), never a dropped connection.

A PUT is sealed and stored by the connection's storer task while the next request is read
(PUTs of a connection are stored in request order, a run of ready ones in one pass of the event
loop, and any other request first waits until they are stored, so it sees them); its ledger
event is group-committed in the background (at most ``MAX_UNSETTLED_PUTS`` per connection in
flight), and a put that cannot be recorded is removed again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections import deque
from collections.abc import Iterable
from typing import Any

from kvgov.errors import ConfigError, KvgovError
from kvgov.proxy.dataplane.conn import ConnectionClosed, StreamProtocol, refuse
from kvgov.proxy.dataplane.identity import Identity
from kvgov.proxy.dataplane.limits import ConnectionLimits, DenialBudget, Watchdog
from kvgov.proxy.dataplane.pipeline import DENIAL_BUDGET, Kept, Pipeline, PutPlan, StoredPut
from kvgov.types import Operation
from kvgov.wire.itemmeta import from_lm, to_lm
from kvgov.wire.messages import EMPTY_CONTEXT

REQUEST = struct.Struct("=iiiiiiiii150s")  # 186 bytes
REPLY = struct.Struct("=iiiiiiiii")  # 36 bytes
PUT, GET, EXIST, LIST, HEALTH = 1, 2, 3, 4, 5
OK, FAIL = 200, 400
#: stored PUTs per connection whose ledger events are still being committed
MAX_UNSETTLED_PUTS = 64

log = logging.getLogger("kvgov.dataplane.lm")


class LmServer:
    """The listener: every connection speaks as one declared engine identity, for the declared
    tenants only (``dataplane.lm_engine_id``, ``dataplane.lm_tenants``)."""

    def __init__(
        self,
        pipeline: Pipeline,
        *,
        engine_id: str,
        tenants: Iterable[str],
        limits: ConnectionLimits | None = None,
        frame_timeout_s: float = 30.0,
    ) -> None:
        if not engine_id:
            raise ConfigError("the lm:// listener needs dataplane.lm_engine_id")
        served = frozenset(tenants)
        if not served:
            raise ConfigError("the lm:// listener needs dataplane.lm_tenants")
        self.pipeline = pipeline
        self.identity = Identity(engine_id, f"lm:{engine_id}", unattributed=True, tenants=served)
        self.connections: set[LmConnection] = set()
        self._server: asyncio.Server | None = None
        self.port: int | None = None
        self.limits = (
            limits
            if limits is not None
            else ConnectionLimits(
                max_total=1024, per_peer=1024, per_engine=1024, metrics=pipeline.metrics
            )
        )
        #: a request's bytes (and a PUT's value) must arrive within this, a GET's reply be
        #: taken within it
        self.frame_timeout_s = frame_timeout_s
        self.watchdog = Watchdog(lambda: self.connections, Watchdog.tick_for(frame_timeout_s))

    async def start(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: LmConnection(self), host, port)
        self.port = self._server.sockets[0].getsockname()[1]
        self.watchdog.start()

    async def stop_accepting(self) -> None:
        if self._server is not None:
            self._server.close()

    async def drain(self, grace_s: float = 30.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while any(c.busy for c in self.connections) and loop.time() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        for conn in list(self.connections):
            conn.close()
        await self.watchdog.stop()
        if self._server is not None:
            await self._server.wait_closed()


class LmConnection(StreamProtocol):
    listener = "lm"

    def __init__(self, server: LmServer) -> None:
        super().__init__()
        self.server = server
        self._handling = False
        self._unsettled: set[asyncio.Task[None]] = set()
        #: received PUTs waiting to be stored, oldest first, and the task storing them (started
        #: when one arrives, gone when none is left)
        self._to_store: deque[PutPlan] = deque()
        self._storer: asyncio.Task[None] | None = None
        self.budget = DenialBudget(server.identity.principal)
        self._admitted = False

    @property
    def busy(self) -> bool:
        """In the middle of a request, or stored PUTs still wait for the ledger."""
        return self._handling or bool(self._to_store) or bool(self._unsettled)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        name = transport.get_extra_info("peername")
        peer = str(name[0]) if isinstance(name, tuple) and name else "?"
        limits = self.server.limits
        # every connection is the one declared engine: its cap is the engine cap
        if not limits.admit(self, peer):
            refuse(transport)
            return
        if not limits.admit_engine(self, self.server.identity.engine):
            limits.release(self)
            refuse(transport)
            return
        self._admitted = True
        self.server.connections.add(self)
        self.server.pipeline.metrics.connections.labels(self.listener).inc()
        super().connection_made(transport)

    def timed_out(self, phase: str) -> None:
        self.server.pipeline.metrics.timeouts.labels(self.listener, phase).inc()
        self.server.limits.summary.note(
            "dataplane.connection.timed_out", listener=self.listener, phase=phase
        )

    def connection_lost(self, exc: Exception | None) -> None:
        if self._admitted:
            self._admitted = False
            self.server.limits.release(self)
            self.server.pipeline.end_denials(self.budget)
        if self in self.server.connections:
            self.server.connections.discard(self)
            self.server.pipeline.metrics.connections.labels(self.listener).dec()
        super().connection_lost(exc)

    def reply(
        self,
        code: int,
        *,
        length: int = 0,
        fmt: int = 0,
        dtype: int = 0,
        shape: Any = (0, 0, 0, 0),
        location: int = 0,
    ) -> None:
        s = [int(x) for x in list(shape)[:4]] + [0] * (4 - len(list(shape)[:4]))
        self.write(REPLY.pack(code, length, fmt, dtype, s[0], s[1], s[2], s[3], location))

    async def handle(self) -> None:
        DENIAL_BUDGET.set(self.budget)  # this task's denials (and its storer's) count here
        head = memoryview(bytearray(REQUEST.size))
        metrics = self.server.pipeline.metrics
        frame_s = self.server.frame_timeout_s
        while True:
            self.arm_on_data(frame_s)  # idle between requests is allowed, not a partial one
            await self.read_into(head)
            self.disarm()
            command, length, fmt, dtype, location, s0, s1, s2, s3, raw = REQUEST.unpack(head)
            try:  # LMCache pads with spaces; C clients may pad with NULs
                key = raw.rstrip(b"\x00").decode().strip()
            except UnicodeDecodeError:
                key = ""
            if "\x00" in key:
                key = ""  # a malformed key: denied, never recorded verbatim
            if command not in (PUT, GET, EXIST, LIST, HEALTH) or length < 0:
                metrics.protocol_errors.labels(self.listener, "BAD_FRAME").inc()
                return  # not LMCache's protocol: close this connection only
            if command != PUT and self._storer is not None and not self._storer.done():
                await asyncio.wait([self._storer])  # it sees every earlier PUT
            self._handling = True
            started = asyncio.get_running_loop().time()
            op = {PUT: "put", GET: "get", EXIST: "exists"}.get(command, "health")
            try:
                if command == PUT:
                    meta = from_lm(fmt, dtype, location, (s0, s1, s2, s3))
                    await self._put(key, length, meta)
                elif command == GET:
                    await self._get(key)
                elif command == EXIST:
                    await self._exist(key)
                else:
                    self.reply(OK if command == HEALTH else FAIL)
            finally:
                self._handling = False
                metrics.latency.labels(op).observe(asyncio.get_running_loop().time() - started)

    async def _put(self, key: str, length: int, meta: dict[str, Any]) -> None:
        pipeline = self.server.pipeline
        if pipeline.lease_bound(length) > pipeline.pool.owner_max_bytes:
            # no frame limit in this protocol: a length no buffer can hold closes the
            # connection (reading and dropping up to 2 GiB would only feed the sender)
            pipeline.metrics.protocol_errors.labels(self.listener, "TOO_LARGE").inc()
            self.server.limits.summary.note("dataplane.lm.put_too_large", nbytes=length)
            raise ConnectionClosed
        if length == 0:  # an empty value: nothing to cache, nothing recorded
            pipeline.metrics.count_op("put", self.listener, "refused")
            return
        who, denied = pipeline.identify(self.server.identity, key, EMPTY_CONTEXT)
        plan = None
        frame_s = self.server.frame_timeout_s
        if denied is None and who is not None:
            got = await pipeline.plan_put(who, length, meta)  # may wait for the pool
            self.arm(frame_s)  # the value must arrive in time (a stalled one frees its buffer)
            if isinstance(got, Kept):  # live already: not rewritten
                pipeline.metrics.count_op("put", self.listener, "kept")
                await self.discard(length)
                self.disarm()
                return
            if isinstance(got, PutPlan):
                plan = got
            else:
                denied = got
        if plan is None:
            if denied is not None:
                await pipeline.deny(who, denied, Operation.PUT)
            pipeline.metrics.count_op("put", self.listener, "denied")
            self.arm(frame_s)
            await self.discard(length)
            self.disarm()
            return
        try:
            for i, window in enumerate(plan.windows):
                await self.read_into(window)
                plan.segment_done(i, pipeline.executor)
            self.disarm()
        except BaseException:
            await plan.discard()
            raise
        self._to_store.append(plan)
        if self._storer is None or self._storer.done():
            self._storer = asyncio.get_running_loop().create_task(self._store_puts())
        if len(self._unsettled) + len(self._to_store) >= MAX_UNSETTLED_PUTS:
            if self._to_store and self._storer is not None:
                await asyncio.wait([self._storer])
            if len(self._unsettled) >= MAX_UNSETTLED_PUTS:
                await asyncio.wait(list(self._unsettled), return_when=asyncio.FIRST_COMPLETED)

    async def _store_puts(self) -> None:
        """Seal-wait and store the queued PUTs in order; each then settles in its own task."""
        pipeline = self.server.pipeline
        while self._to_store:
            plan = self._to_store[0]
            try:
                with contextlib.suppress(Exception):  # store_put raises it again
                    await plan.sealed()
                stored: StoredPut = await pipeline.store_put(plan)
            except asyncio.CancelledError:
                for left in self._to_store:
                    await left.discard()
                self._to_store.clear()
                raise
            except Exception as exc:  # noqa: BLE001 - PUT has no reply: count it and go on
                log.warning("dataplane.put.failed", extra={"error": type(exc).__name__})
                pipeline.metrics.count_op("put", self.listener, "error")
                continue
            finally:
                if self._to_store and self._to_store[0] is plan:
                    self._to_store.popleft()
                plan.abort()  # idempotent; releases the buffer if the put never got stored
            task = asyncio.get_running_loop().create_task(self._settle(stored))
            self._unsettled.add(task)
            task.add_done_callback(self._unsettled.discard)

    async def _settle(self, stored: StoredPut) -> None:
        pipeline = self.server.pipeline
        try:
            await pipeline.settle_put(stored)
        except Exception as exc:  # noqa: BLE001 - already removed from the tiers
            log.warning("dataplane.put.unrecorded", extra={"error": type(exc).__name__})
            pipeline.metrics.count_op("put", self.listener, "error")
            return
        pipeline.metrics.count_op("put", self.listener, "ok")

    async def _get(self, key: str) -> None:
        pipeline = self.server.pipeline
        who, denied = pipeline.identify(self.server.identity, key, EMPTY_CONTEXT)
        plan = None
        if denied is not None:
            await pipeline.deny(who, denied, Operation.GET)
        elif who is not None:
            plan = await pipeline.get(who)
        pipeline.metrics.count_op("get", self.listener, "hit" if plan else "miss")
        if plan is None:
            self.reply(FAIL)
            return
        try:
            fmt, dtype, shape, location = to_lm(plan.item_meta)
            self.reply(OK, length=plan.length, fmt=fmt, dtype=dtype, shape=shape, location=location)
            self.arm(self.server.frame_timeout_s, "reply")  # the hit's buffer is held meanwhile
            try:
                await self.send_plan(
                    plan,
                    pipeline.executor,
                    pipeline.sender,
                    inline_bytes=pipeline.inline_crypto_bytes,
                )
            except KvgovError as exc:  # corrupt at rest: the promised bytes cannot come
                pipeline.metrics.count_op("get", self.listener, "error")
                await pipeline.drop_unreadable(plan.who, exc)
                raise ConnectionClosed from exc
            self.disarm()
        finally:
            plan.release()

    async def _exist(self, key: str) -> None:
        pipeline = self.server.pipeline
        who, denied = pipeline.identify(self.server.identity, key, EMPTY_CONTEXT)
        found = False
        if denied is not None:
            await pipeline.deny(who, denied, Operation.EXISTS)
        elif who is not None:
            found = await pipeline.exists(who)
        pipeline.metrics.count_op("exists", self.listener, "hit" if found else "miss")
        self.reply(OK if found else FAIL)

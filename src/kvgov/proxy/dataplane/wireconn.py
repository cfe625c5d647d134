"""One kvgov wire connection (``docs/protocol.md``) on the sidecar side.

One :class:`WireConnection` per socket: HELLO first (token or, on a Unix socket, peer
credentials), then requests, replies in order. A malformed or oversize frame gets an ERROR and
closes only that connection. Payload bytes are received straight into the pipeline's pooled
buffers and sealed segment by segment as they arrive; a connection that closes before a PUT
frame is complete stores nothing from that frame.

PUTs are pipelined: once a PUT frame's bytes have arrived, the connection reads the next frame
while a task finishes sealing its items, stores them (after the previous PUT's: request order)
and waits for the ledger's group commit of their events; the reply is sent once they are
durable, in request order (at most ``MAX_PIPELINED_PUTS`` frames in flight per connection).
Any other request first waits for the earlier PUT replies, so it sees every earlier put
acknowledged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvgov.errors import KvgovError
from kvgov.proxy.dataplane.buffers import Lease, size_class
from kvgov.proxy.dataplane.conn import ConnectionClosed, StreamProtocol, refuse, start_opening
from kvgov.proxy.dataplane.identity import Identity
from kvgov.proxy.dataplane.limits import DenialBudget
from kvgov.proxy.dataplane.pipeline import (
    DENIAL_BUDGET,
    Found,
    GetPlan,
    Kept,
    PutPlan,
    StoredPut,
)
from kvgov.types import Operation
from kvgov.wire.codec import (
    HEADER_SIZE,
    PROTOCOL_VERSION,
    ErrorCode,
    Flag,
    FrameType,
    WireError,
    decode_header,
    decode_meta,
    encode_frame,
    error_meta,
    key_list,
)
from kvgov.wire.messages import MAX_EVICT_DIGESTS, RequestContext, evict_meta, parse_put_items

if TYPE_CHECKING:
    from kvgov.proxy.dataplane.server import WireServer

log = logging.getLogger("kvgov.dataplane.server")

MAX_BATCH = 4096
#: items of a frame handled per turn of the event loop: a large frame yields to the other
#: connections between slices (fairness: another engine's PING is not held behind it)
SLICE = 64
#: PUT frames per connection whose replies wait for their ledger commit
MAX_PIPELINED_PUTS = 32


@dataclass(frozen=True, slots=True)
class EngineEvictResult:
    engine: str
    acked: bool
    removed: int = 0
    error: str | None = None


@dataclass(slots=True)
class _PutJob:
    """One PUT frame after its bytes arrived, on its way through the connection's storer
    (seal, then store, in frame order) and replier (ledger commit, then reply, in order)."""

    sid: int
    #: per item: its denial reply, or None where a plan was received
    results: list[dict[str, Any] | None]
    plans: list[PutPlan]
    started: float
    #: per plan: what storing it gave (filled by the storer)
    stored: list[StoredPut | BaseException] = field(default_factory=list)
    #: set once its reply was sent (or the connection gave up on it)
    replied: asyncio.Event = field(default_factory=asyncio.Event)


class WireConnection(StreamProtocol):
    listener = "kvgov"

    def __init__(self, server: WireServer, *, unix: bool) -> None:
        super().__init__()
        self.server = server
        self.unix = unix
        self.peer_uid: int | None = None
        self.identity: Identity | None = None
        self._handling = False
        #: PUT frames received and not yet replied to, oldest first (they finish in order)
        self._pending: deque[_PutJob] = deque()
        #: ... of which these still wait to be stored, and these for their commit and reply;
        #: one task drains each queue (started when work arrives, gone when it is empty), so
        #: a run of ready frames is stored or replied to in one pass of the event loop
        self._to_store: deque[_PutJob] = deque()
        self._to_reply: deque[_PutJob] = deque()
        self._storer: asyncio.Task[None] | None = None
        self._replier: asyncio.Task[None] | None = None
        #: settles of stored puts left behind when the connection gave up on their replies
        self._settling: set[asyncio.Future[None]] = set()
        self._next_id = 0
        self._acks: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.budget = DenialBudget(None)
        #: holds a slot in the server's connection limits (released when lost)
        self._admitted = False

    @property
    def busy(self) -> bool:
        """In the middle of a request, or PUT replies still wait for the ledger."""
        return self._handling or bool(self._pending)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self.unix:
            sock = transport.get_extra_info("socket")
            if sock is not None and hasattr(socket, "SO_PEERCRED"):
                creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
                self.peer_uid = struct.unpack("3i", creds)[1]
            peer = f"uid:{self.peer_uid}"
        else:
            name = transport.get_extra_info("peername")
            peer = str(name[0]) if isinstance(name, tuple) and name else "?"
        if not self.server.limits.admit(self, peer):
            refuse(transport)  # over a cap: its descriptor goes back at once
            return
        self._admitted = True
        self.server.connections.add(self)
        self.server.pipeline.metrics.connections.labels(self.listener).inc()
        super().connection_made(transport)
        self.arm(self.server.config.hello_timeout_s, "hello")

    def connection_lost(self, exc: Exception | None) -> None:
        if self._admitted:
            self._admitted = False
            self.server.limits.release(self)
            self.server.pipeline.end_denials(self.budget)
        if self in self.server.connections:
            self.server.connections.discard(self)
            self.server.controls.discard(self)
            self.server.pipeline.metrics.connections.labels(self.listener).dec()
        for fut in self._acks.values():
            if not fut.done():
                fut.set_exception(ConnectionClosed())
        super().connection_lost(exc)

    # -- framing -------------------------------------------------------------------------------

    def send(
        self,
        ftype: FrameType,
        sid: int,
        meta: Mapping[str, Any] | None,
        payload_len: int = 0,
        flags: Flag = Flag.REPLY,
    ) -> None:
        self.write(encode_frame(ftype, sid, meta, payload_len, flags))

    def send_error(self, sid: int, err: WireError) -> None:
        self.server.pipeline.metrics.protocol_errors.labels(self.listener, err.error.name).inc()
        self.send(FrameType.ERROR, sid, error_meta(err.error, err.message), flags=Flag.NONE)

    def timed_out(self, phase: str) -> None:
        self.server.pipeline.metrics.timeouts.labels(self.listener, phase).inc()
        self.server.limits.summary.note(
            "dataplane.connection.timed_out", listener=self.listener, phase=phase
        )

    async def handle(self) -> None:
        DENIAL_BUDGET.set(self.budget)  # this task's denials (and its storer's) count here
        cfg = self.server.config
        max_payload = cfg.max_frame_bytes
        frame_s = cfg.frame_timeout_s
        head = memoryview(bytearray(HEADER_SIZE))
        while True:
            if self.identity is not None:  # before HELLO its own deadline runs
                self.arm_on_data(frame_s)
            await self.read_into(head)
            try:
                header = decode_header(head, max_payload=max_payload)
                meta = decode_meta(await self.read_exact(header.meta_len))
            except WireError as exc:
                await self._replies_sent()
                self.send_error(0, exc)
                return  # fatal: close only this connection
            if self.identity is None and header.type is not FrameType.HELLO:
                self.send_error(
                    header.stream_id, WireError(ErrorCode.UNAUTHENTICATED, "HELLO first")
                )
                return
            put = header.type is FrameType.PUT and not self.server.draining
            payload_len = header.payload_len
            if not put:
                # the frame's payload arrives within its deadline (none is kept but a PUT's)
                await self.discard(payload_len)
                payload_len = 0
            if self.identity is not None:
                self.disarm()  # read; a PUT re-arms once its buffers are taken
            if not put:
                await self._replies_sent()
            self._handling = True
            started = time.perf_counter()
            try:
                if put:
                    await self._put(header.stream_id, meta, payload_len, started)
                else:
                    await self._dispatch(
                        header.type, header.stream_id, header.is_reply, meta, payload_len
                    )
                    self._observe(header.type, started)
            except WireError as exc:
                await self._replies_sent()
                self.send_error(header.stream_id, exc)
                if exc.fatal:
                    return
            finally:
                self._handling = False

    def _observe(self, ftype: FrameType, started: float) -> None:
        self.server.pipeline.metrics.latency.labels(ftype.name.lower()).observe(
            time.perf_counter() - started
        )

    async def _replies_sent(self) -> None:
        """Wait until every pipelined PUT reply has been sent (they finish in order)."""
        if self._pending:
            await self._pending[-1].replied.wait()

    async def _dispatch(
        self, ftype: FrameType, sid: int, is_reply: bool, meta: dict[str, Any], payload_len: int
    ) -> None:
        if ftype is FrameType.EVICT_ACK or (ftype is FrameType.PING and is_reply):
            await self.discard(payload_len)
            fut = self._acks.pop(sid, None)
            if fut is not None and not fut.done():
                fut.set_result(meta)
            return
        if ftype is not FrameType.PUT and payload_len:
            await self.discard(payload_len)
        if ftype is FrameType.HELLO:
            await self._hello(sid, meta)
        elif self.server.draining:
            if ftype is FrameType.PUT:
                await self.discard(payload_len)
            raise WireError(ErrorCode.BUSY, "sidecar is shutting down")
        elif ftype is FrameType.PING:
            self.send(FrameType.PING, sid, None)
        elif ftype is FrameType.PUT:
            await self._put(sid, meta, payload_len, time.perf_counter())
        elif ftype is FrameType.GET:
            await self._get(sid, meta)
        elif ftype in (FrameType.EXISTS, FrameType.REMOVE):
            await self._keys_op(ftype, sid, meta)
        else:
            raise WireError(ErrorCode.BAD_REQUEST, f"unexpected {ftype.name} frame")

    async def _hello(self, sid: int, meta: dict[str, Any]) -> None:
        if self.identity is not None:
            raise WireError(ErrorCode.BAD_REQUEST, "HELLO was already sent")
        version = meta.get("version", PROTOCOL_VERSION)
        if version != PROTOCOL_VERSION:
            raise WireError(ErrorCode.VERSION_MISMATCH, f"protocol {version} not supported")
        identity = self.server.authenticate(meta, self)
        if not self.server.limits.admit_engine(self, identity.engine):
            raise WireError(
                ErrorCode.UNAUTHENTICATED,
                "too many connections for this engine",
                hint="close idle connections or raise dataplane.max_connections_per_engine",
            )
        self.identity = identity
        self.budget.principal = identity.principal
        self.disarm()  # authenticated in time
        cfg = self.server.config
        control = meta.get("role") == "control"
        reply: dict[str, Any] = {
            "server": "kvgov",
            "version": cfg.version,
            "protocol": PROTOCOL_VERSION,
            "sidecar": cfg.sidecar_id,
            "engine": self.identity.engine,
            "max_frame_bytes": cfg.max_frame_bytes,
            "max_batch": cfg.max_frame_items,
        }
        if control and cfg.digester is not None:
            # only now, after authentication, and only where EVICT is received (never logged)
            reply["key_digest_key"] = cfg.digester.to_hex()
        self.send(FrameType.HELLO, sid, reply)
        if control:
            self.server.controls.add(self)
        log.info("dataplane.engine.connected", extra={"engine": self.identity.engine})

    # -- operations ----------------------------------------------------------------------------

    async def _put(self, sid: int, meta: dict[str, Any], payload_len: int, started: float) -> None:
        """Receive the items; :meth:`_finish_put` stores them and replies."""
        pipeline = self.server.pipeline
        try:
            items = parse_put_items(meta, payload_len, self.server.config.max_frame_items)
            ctx = RequestContext.from_meta(meta.get("ctx"))
        except WireError:
            await self.discard(payload_len)
            raise
        if self.identity is None:
            raise WireError(ErrorCode.UNAUTHENTICATED, "HELLO first")
        # an empty value takes no buffer (it is refused below)
        bounds = [pipeline.lease_bound(i.length, i.meta) if i.length else 0 for i in items]
        if sum(bounds) > pipeline.pool.owner_max_bytes:
            # its items' buffers are held together: waiting for that much room never ends
            await self.discard(payload_len)
            raise WireError(
                ErrorCode.BAD_REQUEST,
                "the PUT needs more buffer than the sidecar's pool holds",
                hint="send fewer or smaller items per frame",
            )
        # every item's buffer at once: never hold part of the pool while waiting for the rest
        self.disarm()  # waiting for the pool is backpressure, not a stalled sender
        owner = self.identity.engine  # one engine holds at most its share of the pool
        taken = iter(await pipeline.pool.acquire_many([b for b in bounds if b], owner))
        leases: list[Lease | None] = [next(taken) if b else None for b in bounds]
        # the payload must arrive in time: a stalled frame gives its buffers back
        self.arm(self.server.config.frame_timeout_s)
        results: list[dict[str, Any] | None] = []
        plans: list[PutPlan] = []
        try:
            for index, item in enumerate(items):
                if index % SLICE == SLICE - 1:
                    await asyncio.sleep(0)  # the other connections' turn
                lease, leases[index] = leases[index], None  # the plan owns it from here
                if item.length == 0:  # an empty value: nothing to cache, nothing recorded
                    if lease is not None:
                        lease.release()
                    results.append({"code": int(ErrorCode.BAD_REQUEST), "reason": "empty"})
                    pipeline.metrics.count_op("put", self.listener, "refused")
                    continue
                who, denied = pipeline.identify(self.identity, item.key, item.ctx or ctx)
                plan = None
                if denied is None and who is not None:
                    got = await pipeline.plan_put(who, item.length, item.meta, lease)
                    if isinstance(got, Kept):  # live already: acknowledged, not rewritten
                        await self.discard(item.length)
                        results.append({"code": 0})
                        pipeline.metrics.count_op("put", self.listener, "kept")
                        continue
                    if isinstance(got, PutPlan):
                        plan = got
                    else:
                        denied = got
                elif lease is not None:
                    lease.release()
                if plan is None:
                    if denied is not None:
                        await pipeline.deny(who, denied, Operation.PUT)
                    await self.discard(item.length)
                    reason = denied.reason if denied is not None else "denied"
                    code = ErrorCode.BAD_REQUEST if reason.startswith("bad_item_meta") else None
                    results.append({"code": int(code or ErrorCode.DENIED), "reason": reason})
                    continue
                plans.append(plan)
                for i, window in enumerate(plan.windows):
                    await self.read_into(window)
                    plan.segment_done(i, pipeline.executor)
                results.append(None)
            self.disarm()
        except BaseException:
            for left in leases:
                if left is not None:
                    left.release()
            for plan in plans:  # the frame did not complete: store nothing from it
                await plan.discard()
            raise
        # seal, store (in request order) and record in the background: the next frame is read
        # meanwhile
        job = _PutJob(sid, results, plans, started)
        self._pending.append(job)
        self._to_store.append(job)
        if self._storer is None or self._storer.done():
            self._storer = asyncio.get_running_loop().create_task(self._store_jobs())
        if len(self._pending) > MAX_PIPELINED_PUTS:
            await self._pending[0].replied.wait()

    async def _store_jobs(self) -> None:
        """Store the queued PUT frames, oldest first, then hand each to the replier."""
        try:
            while self._to_store:
                job = self._to_store[0]
                await self._store(job)
                self._to_store.popleft()
                self._to_reply.append(job)
                if self._replier is None or self._replier.done():
                    self._replier = asyncio.get_running_loop().create_task(self._reply_jobs())
        except BaseException as exc:
            await self._abandon(exc)
            raise

    async def _store(self, job: _PutJob) -> None:
        """Wait until the frame's items are sealed, then store each (failures per item)."""
        pipeline = self.server.pipeline
        stored = job.stored
        try:
            for plan in job.plans:
                with contextlib.suppress(Exception):  # store_put raises it again
                    await plan.sealed()
            for plan in job.plans:
                try:
                    stored.append(await pipeline.store_put(plan))
                except Exception as exc:  # noqa: BLE001 - reported per item in the reply
                    stored.append(exc)
        finally:
            for plan in job.plans[len(stored) :]:  # cancelled before storing these
                await plan.discard()

    async def _reply_jobs(self) -> None:
        """Reply to the stored PUT frames, oldest first, once their ledger events commit."""
        try:
            while self._to_reply:
                job = self._to_reply[0]
                await self._reply(job)
                self._to_reply.popleft()
                self._pending.popleft()
                job.replied.set()
        except BaseException as exc:
            await self._abandon(exc)
            raise

    async def _abandon(self, exc: BaseException) -> None:
        """The storer or replier failed: the reply order is lost, so close the connection (the
        client must reconnect); frames not yet stored store nothing."""
        if not isinstance(exc, asyncio.CancelledError):
            log.error("dataplane.put.reply_failed", exc_info=exc)
        self.close()
        for job in list(self._to_store):
            for plan in job.plans[len(job.stored) :]:
                await plan.discard()
        for job in self._pending:
            for item in job.stored:  # stored: still settle (an unrecorded put is removed)
                if not isinstance(item, BaseException):
                    settle = asyncio.ensure_future(self.server.pipeline.settle_put(item))
                    self._settling.add(settle)
                    settle.add_done_callback(self._settled)
            job.replied.set()
        self._pending.clear()
        self._to_store.clear()
        self._to_reply.clear()

    def _settled(self, task: asyncio.Future[None]) -> None:
        self._settling.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: settle_put logs what it could not record

    async def _reply(self, job: _PutJob) -> None:
        pipeline = self.server.pipeline
        outcomes: list[BaseException | None] = []
        for item in job.stored:
            if isinstance(item, BaseException):
                outcomes.append(item)
                continue
            try:
                await pipeline.settle_put(item)
                outcomes.append(None)
            except Exception as exc:  # noqa: BLE001 - reported per item in the reply
                outcomes.append(exc)
        it = iter(outcomes)
        replies = []
        for r in job.results:
            if r is not None:  # denied, or kept (counted when it was read)
                replies.append(r)
                if r["code"]:
                    pipeline.metrics.count_op("put", self.listener, "denied")
                continue
            outcome = next(it)
            if outcome is not None:
                log.warning("dataplane.put.failed", extra={"error": type(outcome).__name__})
                replies.append({"code": int(ErrorCode.INTERNAL), "reason": "store_failed"})
                pipeline.metrics.count_op("put", self.listener, "error")
            else:
                replies.append({"code": 0})
                pipeline.metrics.count_op("put", self.listener, "ok")
        self.send(FrameType.PUT, job.sid, {"results": replies})
        self._observe(FrameType.PUT, job.started)

    async def _get(self, sid: int, meta: dict[str, Any]) -> None:
        pipeline = self.server.pipeline
        keys = key_list(meta, max_items=self.server.config.max_frame_items)
        ctx = RequestContext.from_meta(meta.get("ctx"))
        if self.identity is None:
            raise WireError(ErrorCode.UNAUTHENTICATED, "HELLO first")
        # first every key's entry and size, then the hits' buffers all at once (never part of
        # the pool held while waiting for the rest), then read them
        finds: list[Found | None] = []
        for i, key in enumerate(keys):
            if i % SLICE == SLICE - 1:
                await asyncio.sleep(0)  # the other connections' turn
            who, denied = pipeline.identify(self.identity, key, ctx)
            found = None
            if denied is not None:
                await pipeline.deny(who, denied, Operation.GET)
            elif who is not None:
                found = await pipeline.find(who)
            finds.append(found)
        budget = self.server.config.max_frame_bytes
        room = pipeline.pool.owner_max_bytes
        taken: list[Found] = []
        for found in finds:
            # a hit beyond the frame limit or what the pool holds for one frame is a miss
            if found is not None and budget > 0 and size_class(found.size) <= room:
                taken.append(found)
                budget -= found.size
                room -= size_class(found.size)
        leases = dict(
            zip(
                map(id, taken),
                await pipeline.pool.acquire_many([f.size for f in taken], self.identity.engine),
                strict=True,
            )
        )
        plans: list[GetPlan | None] = []
        try:
            for found in finds:
                plan = None
                if found is not None:
                    plan = await pipeline.load(found, leases.pop(id(found), None))
                outcome = "hit" if plan is not None else "miss"
                pipeline.metrics.count_op("get", self.listener, outcome)
                plans.append(plan)
            items = [
                {"code": 0, "len": p.length, "meta": dict(p.item_meta)}
                if p is not None
                else {"code": int(ErrorCode.NOT_FOUND)}
                for p in plans
            ]
            total = sum(p.length for p in plans if p is not None)
            self.send(FrameType.GET, sid, {"items": items}, total)
            if total:  # the reader must take the hits in time (they hold buffers)
                self.arm(self.server.config.frame_timeout_s, "reply")
            # the pipeline opened and authenticated every hit before it was announced (a bad
            # one is a miss above); a plan that still carries a reader would be opened here,
            # one ahead of the hit being sent
            hits = [h for h in plans if h is not None]
            inline = pipeline.inline_crypto_bytes
            ahead = start_opening(hits[0], pipeline.executor, inline) if hits else None
            try:
                for i, hit in enumerate(hits):
                    current = ahead
                    ahead = (
                        start_opening(hits[i + 1], pipeline.executor, inline, ahead=True)
                        if i + 1 < len(hits)
                        else None
                    )
                    try:
                        await self.send_plan(
                            hit, pipeline.executor, pipeline.sender, current, inline_bytes=inline
                        )
                    except KvgovError as exc:  # corrupt at rest: the promised bytes cannot come
                        pipeline.metrics.count_op("get", self.listener, "error")
                        await pipeline.drop_unreadable(hit.who, exc)
                        raise ConnectionClosed from exc
            finally:
                if ahead is not None:
                    await ahead.settled()
            if total:
                self.disarm()
        finally:
            for lease in leases.values():
                lease.release()
            for p in plans:
                if p is not None:
                    p.release()

    async def _keys_op(self, ftype: FrameType, sid: int, meta: dict[str, Any]) -> None:
        pipeline = self.server.pipeline
        keys = key_list(meta, max_items=self.server.config.max_frame_items)
        ctx = RequestContext.from_meta(meta.get("ctx"))
        if self.identity is None:
            raise WireError(ErrorCode.UNAUTHENTICATED, "HELLO first")
        op = Operation.EXISTS if ftype is FrameType.EXISTS else Operation.REMOVE
        out: list[bool] = []
        for i, key in enumerate(keys):
            if i % SLICE == SLICE - 1:
                await asyncio.sleep(0)  # the other connections' turn
            who, denied = pipeline.identify(self.identity, key, ctx)
            if denied is not None or who is None:
                if denied is not None:
                    await pipeline.deny(who, denied, op)
                # answered and counted like a miss (the denial has its own counter)
                pipeline.metrics.count_op(op.value, self.listener, "miss")
                out.append(False)
                continue
            found = await (pipeline.exists(who) if op is Operation.EXISTS else pipeline.remove(who))
            pipeline.metrics.count_op(op.value, self.listener, "hit" if found else "miss")
            out.append(found)
        field_name = "found" if op is Operation.EXISTS else "removed"
        self.send(ftype, sid, {field_name: out})

    # -- server -> engine ----------------------------------------------------------------------

    async def evict(self, digests: Sequence[str], timeout_s: float) -> EngineEvictResult:
        """EVICT the entries with those key digests on this control connection, in frames of
        at most ``MAX_EVICT_DIGESTS``; each frame waits up to ``timeout_s`` for its ACK."""
        engine = self.identity.engine if self.identity else "?"
        step = MAX_EVICT_DIGESTS
        frames = [digests[i : i + step] for i in range(0, len(digests), step)] or [[]]
        removed = 0
        errors: list[str] = []
        for frame in frames:
            try:
                ack = await self._evict_frame(frame, timeout_s)
            except (TimeoutError, ConnectionClosed) as exc:
                return EngineEvictResult(engine, acked=False, error=type(exc).__name__)
            names = ack.get("removed")
            error = ack.get("error")
            removed += len(names) if isinstance(names, list) else 0
            if isinstance(error, str) and error not in errors:
                errors.append(error)
        return EngineEvictResult(
            engine, acked=True, removed=removed, error=", ".join(errors) or None
        )

    async def _evict_frame(self, digests: Sequence[str], timeout_s: float) -> dict[str, Any]:
        self._next_id = self._next_id + 1 if self._next_id < 0x7FFF_FFFF else 1
        sid = 0x8000_0000 | self._next_id  # server-initiated ids have the top bit set
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._acks[sid] = fut
        try:
            self.send(FrameType.EVICT, sid, evict_meta(digests), flags=Flag.NONE)
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self._acks.pop(sid, None)

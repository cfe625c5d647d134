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
import logging
import socket
import struct
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import SecretStr

from kvgov.errors import CorruptValueError
from kvgov.proxy.dataplane.buffers import Lease
from kvgov.proxy.dataplane.conn import ConnectionClosed, StreamProtocol, refuse
from kvgov.proxy.dataplane.identity import Identity
from kvgov.proxy.dataplane.limits import ConnectionLimits
from kvgov.proxy.dataplane.pipeline import SLICE, Ack, Door, Pipeline, PutSession
from kvgov.wire import handshake
from kvgov.wire.codec import (
    FEATURES,
    HEADER_SIZE,
    LATE_MISS,
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
from kvgov.wire.digest import KeyDigester
from kvgov.wire.messages import MAX_EVICT_DIGESTS, RequestContext, evict_meta, parse_put_items

log = logging.getLogger("kvgov.dataplane.server")

MAX_BATCH = 4096
#: PUT frames per connection whose replies wait for their ledger commit
MAX_PIPELINED_PUTS = 32
#: the metadata a frame may carry before HELLO authenticated the peer (a HELLO needs well
#: under 1 KiB): a peer with no token is not made to read and parse a MiB of JSON
PREAUTH_META_BYTES = 16 * 1024


@dataclass(slots=True)
class ServerConfig:
    sidecar_id: str
    version: str
    max_frame_bytes: int
    engine_tokens: Mapping[str, SecretStr] = field(default_factory=dict)
    #: accept any engine id without a token (development only)
    allow_anonymous: bool = True
    #: the key-digest key's digester, given to engines on their control connection's HELLO
    #: reply (after authentication) so they can match EVICT digests; None: EVICT cannot match
    digester: KeyDigester | None = field(default=None, repr=False)
    #: keys (EXISTS, GET, REMOVE) or items (PUT) one frame may carry (at most MAX_BATCH)
    max_frame_items: int = MAX_BATCH
    #: seconds from connect to a completed HELLO
    hello_timeout_s: float = 10.0
    #: seconds for a frame's bytes to arrive once it has begun (a PUT's: once its buffers are
    #: taken), and for a GET's hits to be taken by the reader
    frame_timeout_s: float = 30.0


class Hub(Protocol):
    """What a connection needs of the server that accepted it
    (:class:`~kvgov.proxy.dataplane.server.WireServer`): its settings, pipeline and caps, the
    sets of live and control connections, and engine authentication."""

    pipeline: Pipeline
    config: ServerConfig
    limits: ConnectionLimits
    connections: set[WireConnection]
    controls: set[WireConnection]
    draining: bool

    def authenticate(
        self, meta: Mapping[str, Any], conn: WireConnection
    ) -> Identity | Challenge: ...

    def token_current(self, tid: str, engine: str) -> bool:
        """Whether token ``tid`` still stands for ``engine`` (tokens may be revoked while a
        connection is open: :meth:`~kvgov.proxy.dataplane.server.WireServer.replace_tokens`)."""
        ...

    def control_opened(self, conn: WireConnection) -> None:
        """``conn`` is an authenticated control connection from now on (EVICT goes there)."""
        ...


@dataclass(frozen=True, slots=True)
class Challenge:
    """A HELLO that named an engine token (:mod:`kvgov.wire.handshake`): the sidecar's
    answer to it, and the proof the engine must send next."""

    #: the first HELLO's metadata (version, role, features)
    meta: Mapping[str, Any]
    #: the engine id the token stands for
    engine: str
    token: str = field(repr=False)
    #: what the transcript binds: the engine id the client claimed, its role, the token id
    claimed: str = ""
    role: str = ""
    tid: str = ""
    client_nonce: str = ""
    server_nonce: str = field(default_factory=handshake.new_nonce)

    def proof(self, side: str) -> str:
        return handshake.proof(
            self.token,
            side,
            role=self.role,
            engine=self.claimed,
            tid=self.tid,
            client_nonce=self.client_nonce,
            server_nonce=self.server_nonce,
        )


@dataclass(frozen=True, slots=True)
class EngineEvictResult:
    engine: str
    acked: bool
    removed: int = 0
    error: str | None = None


class _PutJob:
    """One PUT frame after its bytes arrived: its items' acks (resolved by the door once
    stored and recorded, in request order) and the reply they make."""

    __slots__ = ("_replied", "_waiter", "acks", "sid", "started")

    def __init__(self, sid: int, acks: list[asyncio.Future[Ack]], started: float) -> None:
        self.sid = sid
        self.acks = acks
        self.started = started
        #: its reply was sent (or the connection gave up on it)
        self._replied = False
        #: what :meth:`wait_replied` awaits, made only when someone waits (most replies are
        #: sent with nobody waiting: no event or future per frame then)
        self._waiter: asyncio.Future[None] | None = None

    def replied(self) -> None:
        """Its reply was sent, or the connection gave up on it: wake whoever waits."""
        self._replied = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait_replied(self) -> None:
        """Wait until :meth:`replied` (at once if it was)."""
        if self._replied:
            return
        waiter = self._waiter
        if waiter is None or waiter.done():  # (done: a cancelled wait cancelled it)
            waiter = self._waiter = asyncio.get_running_loop().create_future()
        await waiter


class WireConnection(StreamProtocol):
    listener = "kvgov"

    def __init__(self, server: Hub, *, unix: bool) -> None:
        super().__init__()
        self.server = server
        self.unix = unix
        self.peer_uid: int | None = None
        self.identity: Identity | None = None
        #: the id of the engine token this connection proved (None: no token)
        self.token_id: str | None = None
        #: the protocol features agreed in HELLO (``late_miss``: hits the memory tier lends
        #: are opened as they are sent, and one failing then is withdrawn in GET_END)
        self.features: frozenset[str] = frozenset()
        self._handling = False
        #: this connection's way into the pipeline
        self.door = Door(server.pipeline, self.listener)
        #: PUT frames received and not yet replied to, oldest first (they finish in order);
        #: one task replies to them (started when one arrives, gone when none is left)
        self._pending: deque[_PutJob] = deque()
        self._replier: asyncio.Task[None] | None = None
        self._next_id = 0
        self._acks: dict[int, asyncio.Future[dict[str, Any]]] = {}
        #: holds a slot in the server's connection limits (released when lost)
        self._admitted = False
        #: a token HELLO answered, waiting for the engine's proof (``_hello``)
        self._challenge: Challenge | None = None

    @property
    def busy(self) -> bool:
        """In the middle of a request, or PUT replies still wait for the ledger."""
        return self._handling or bool(self._pending)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self.unix:
            sock = transport.get_extra_info("socket")
            if sock is not None and hasattr(socket, "SO_PEERCRED"):
                creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
                self.peer_uid = struct.unpack("iII", creds)[1]  # pid, uid, gid (unsigned)
            peer = f"uid:{self.peer_uid}"
        else:
            name = transport.get_extra_info("peername")
            peer = str(name[0]) if isinstance(name, tuple) and name else "?"
        if not self.server.limits.admit(self, peer):
            refuse(transport)  # over a cap: its descriptor goes back at once
            return
        self._admitted = True
        self.server.connections.add(self)
        self.door.opened()
        super().connection_made(transport)
        self.arm(self.server.config.hello_timeout_s, "hello")

    def connection_lost(self, exc: Exception | None) -> None:
        if self._admitted:
            self._admitted = False
            self.server.limits.release(self)
            self.door.closed()
        if self in self.server.connections:
            self.server.connections.discard(self)
            self.server.controls.discard(self)
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
        self.door.protocol_error(err.error.name)
        self.send(FrameType.ERROR, sid, error_meta(err.error, err.message), flags=Flag.NONE)

    def timed_out(self, phase: str) -> None:
        self.door.timed_out(phase)
        self.server.limits.summary.note(
            "dataplane.connection.timed_out", listener=self.listener, phase=phase
        )

    async def handle(self) -> None:
        cfg = self.server.config
        max_payload = cfg.max_frame_bytes
        frame_s = cfg.frame_timeout_s
        head = memoryview(bytearray(HEADER_SIZE))
        while True:
            await self.replies_read(frame_s)
            if self.identity is not None:  # before HELLO its own deadline runs
                self.arm_on_data(frame_s)
            await self.read_into(head)
            try:
                header = decode_header(head, max_payload=max_payload)
                if self.identity is None and header.type is FrameType.HELLO:
                    # small, no payload, judged from the header: a peer with no token is
                    # not made to read and parse a MiB of JSON
                    decode_header(head, max_payload=0, max_meta=PREAUTH_META_BYTES)
            except WireError as exc:
                await self._replies_sent()
                self.send_error(0, exc)
                return  # fatal: close only this connection
            if self.identity is None and header.type is not FrameType.HELLO:
                self.send_error(
                    header.stream_id, WireError(ErrorCode.UNAUTHENTICATED, "HELLO first")
                )
                return  # refused from the header: nothing of the frame is read
            try:
                meta = decode_meta(await self.read_exact(header.meta_len))
            except WireError as exc:
                await self._replies_sent()
                self.send_error(0, exc)
                return  # fatal: close only this connection
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
            self.frames_this_turn += 1
            if self.frames_this_turn >= SLICE:
                # a pipelining peer's frames come from the scratch buffer with no pass of the
                # event loop: the other connections' turn, as between a large frame's slices
                # (review r18, finding 5)
                self.frames_this_turn = 0
                await asyncio.sleep(0)

    def _observe(self, ftype: FrameType, started: float) -> None:
        self.door.observe(_OP_NAMES[ftype], time.perf_counter() - started)

    async def _replies_sent(self) -> None:
        """Wait until every pipelined PUT reply has been sent (they finish in order)."""
        if self._pending:
            await self._pending[-1].wait_replied()

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
        challenge, self._challenge = self._challenge, None
        if challenge is not None:  # the second HELLO: the engine's proof of its token
            if not handshake.proven(challenge.proof("client"), meta.get("proof")):
                raise WireError(ErrorCode.UNAUTHENTICATED, "engine token refused")
            if not self.server.token_current(challenge.tid, challenge.engine):
                raise WireError(ErrorCode.UNAUTHENTICATED, "engine token refused")  # revoked
            self.token_id = challenge.tid
            meta = dict(challenge.meta)
            identity: Identity = Identity(challenge.engine, f"engine:{challenge.engine}")
        else:
            version = meta.get("version", PROTOCOL_VERSION)
            if version != PROTOCOL_VERSION:
                raise WireError(ErrorCode.VERSION_MISMATCH, f"protocol {version} not supported")
            if not isinstance(meta.get("features", []), list):
                raise WireError(ErrorCode.BAD_REQUEST, "features must be a list")
            got = self.server.authenticate(meta, self)
            if isinstance(got, Challenge):
                # the sidecar proves it holds the token first; the engine answers with its
                # own proof in a second HELLO, within the same hello deadline
                self._challenge = got
                self.send(
                    FrameType.HELLO,
                    sid,
                    {"nonce": got.server_nonce, "proof": got.proof("server")},
                )
                return
            identity = got
        offered = meta.get("features", [])
        if not self.server.limits.admit_engine(self, identity.engine):
            raise WireError(
                ErrorCode.UNAUTHENTICATED,
                "too many connections for this engine",
                hint="close idle connections or raise dataplane.max_connections_per_engine",
            )
        self.identity = identity
        self.features = FEATURES.intersection(f for f in offered if isinstance(f, str))
        self.door.budget.principal = identity.principal
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
            "features": sorted(self.features),
        }
        if control and cfg.digester is not None:
            # only now, after authentication, and only where EVICT is received (never logged)
            reply["key_digest_key"] = cfg.digester.to_hex()
        self.send(FrameType.HELLO, sid, reply)
        if control:
            self.server.control_opened(self)
        log.info("dataplane.engine.connected", extra={"engine": self.identity.engine})

    # -- operations ----------------------------------------------------------------------------

    async def _put(self, sid: int, meta: dict[str, Any], payload_len: int, started: float) -> None:
        """Receive the items into their sessions and commit them; the replier answers once
        the door acks them (the next frame is read meanwhile)."""
        door = self.door
        try:
            items = parse_put_items(meta, payload_len, self.server.config.max_frame_items)
            ctx = RequestContext.from_meta(meta.get("ctx"))
        except WireError:
            await self.discard(payload_len)
            raise
        if self.identity is None:
            raise WireError(ErrorCode.UNAUTHENTICATED, "HELLO first")
        identity = self.identity
        # an empty value takes no buffer (it is refused)
        bounds = [door.lease_bound(i.length) if i.length else 0 for i in items]
        if sum(bounds) > door.pool_share:
            # its items' buffers are held together: waiting for that much room never ends
            await self.discard(payload_len)
            raise WireError(
                ErrorCode.BAD_REQUEST,
                "the PUT needs more buffer than the sidecar's pool holds",
                hint="send fewer or smaller items per frame",
            )
        # every item's buffer at once: never hold part of the pool while waiting for the rest
        self.disarm()  # waiting for the pool is backpressure, not a stalled sender
        taken = iter(await door.leases([b for b in bounds if b], identity.engine))
        leases: list[Lease | None] = [next(taken) if b else None for b in bounds]
        # the payload must arrive in time: a stalled frame gives its buffers back
        self.arm(self.server.config.frame_timeout_s)
        sessions: list[PutSession] = []
        try:
            for index, item in enumerate(items):
                if index % SLICE == SLICE - 1:
                    await asyncio.sleep(0)  # the other connections' turn
                lease, leases[index] = leases[index], None  # the session owns it from here
                session = await door.put(
                    identity,
                    item.key,
                    item.ctx or ctx,
                    length=item.length,
                    item_meta=item.meta,
                    lease=lease,
                )
                sessions.append(session)
                for i, window in enumerate(session.windows):
                    await self.read_into(window)
                    session.received(i)
                if session.skip:
                    await self.discard(session.skip)
            self.disarm()
        except BaseException:
            for left in leases:
                if left is not None:
                    left.release()
            for session in sessions:  # the frame did not complete: store nothing from it
                await session.abandon()
            raise
        job = _PutJob(sid, [s.commit() for s in sessions], started)
        # the client streams (it says more frames follow before it reads this reply): the
        # journal may hold this frame's sync briefly for the next ones, until every reply is sent
        door.streaming(more=meta.get("more") is True)
        self._pending.append(job)
        if self._replier is None or self._replier.done():
            self._replier = asyncio.get_running_loop().create_task(self._reply_jobs())
        if len(self._pending) > MAX_PIPELINED_PUTS:
            await self._pending[0].wait_replied()

    async def _reply_jobs(self) -> None:
        """Reply to the PUT frames, oldest first, once the door acked their items."""
        try:
            while self._pending:
                job = self._pending[0]
                replies = [
                    _put_reply(ack.result() if ack.done() else await ack) for ack in job.acks
                ]
                self.send(FrameType.PUT, job.sid, {"results": replies})
                self._observe(FrameType.PUT, job.started)
                self._pending.popleft()
                job.replied()
                if not self._pending:  # every reply sent: no frame of a stream is waiting
                    self.door.streaming(more=False)
        except BaseException as exc:
            # the reply order is lost: close the connection (the client must reconnect); the
            # door still stores and records (or removes) what it was given
            if not isinstance(exc, asyncio.CancelledError):
                log.error("dataplane.put.reply_failed", exc_info=exc)
            self.close()
            for job in self._pending:
                job.replied()
            self._pending.clear()
            raise

    async def _get(self, sid: int, meta: dict[str, Any]) -> None:
        door = self.door
        keys = key_list(meta, max_items=self.server.config.max_frame_items)
        ctx = RequestContext.from_meta(meta.get("ctx"))
        if self.identity is None:
            raise WireError(ErrorCode.UNAUTHENTICATED, "HELLO first")
        plans = await door.get_many(
            self.identity,
            keys,
            ctx,
            self.server.config.max_frame_bytes,
            stream=LATE_MISS in self.features,
        )
        try:
            items = [
                {"code": 0, "len": p.length, "meta": dict(p.item_meta)}
                if p is not None
                else {"code": int(ErrorCode.NOT_FOUND)}
                for p in plans
            ]
            total = sum(p.length for p in plans if p is not None)
            reply: dict[str, Any] = {"items": items}
            tail = any(p is not None and p.opener is not None for p in plans)
            if tail:
                reply["tail"] = True  # a GET_END frame follows the payload
            self.send(FrameType.GET, sid, reply, total)
            if total:  # the reader must take the hits in time (they hold buffers)
                self.arm(self.server.config.frame_timeout_s, "reply")
            # a hit read from a tier was authenticated before it was announced (a bad one is a
            # miss above); one the memory tier lends (``late_miss``) only its first segment,
            # the rest as they are sent: one failing then is withdrawn, zeros standing in for
            # its rest, and GET_END says so
            missed: list[int] = []
            for i, hit in enumerate(plans):
                if hit is None:
                    continue
                try:
                    await self.send_plan(hit, door.sender, inline_bytes=door.inline_bytes, pad=True)
                except CorruptValueError as exc:
                    missed.append(i)
                    await door.unsent(hit, exc)
                    continue
                await door.sent(hit)
            if total:
                self.disarm()
            if tail:
                self.send(FrameType.GET_END, sid, {"missed": missed})
        finally:
            for p in plans:
                if p is not None:
                    p.release()

    async def _keys_op(self, ftype: FrameType, sid: int, meta: dict[str, Any]) -> None:
        keys = key_list(meta, max_items=self.server.config.max_frame_items)
        ctx = RequestContext.from_meta(meta.get("ctx"))
        if self.identity is None:
            raise WireError(ErrorCode.UNAUTHENTICATED, "HELLO first")
        ask = self.door.exists if ftype is FrameType.EXISTS else self.door.remove
        out: list[bool] = []
        for i, key in enumerate(keys):
            if i % SLICE == SLICE - 1:
                await asyncio.sleep(0)  # the other connections' turn
            out.append(await ask(self.identity, key, ctx))
        field_name = "found" if ftype is FrameType.EXISTS else "removed"
        self.send(ftype, sid, {field_name: out})

    # -- server -> engine ----------------------------------------------------------------------

    async def evict(
        self, digests: Sequence[str], timeout_s: float, *, job: str | None = None
    ) -> EngineEvictResult:
        """EVICT the entries with those key digests on this control connection, in frames of
        at most ``MAX_EVICT_DIGESTS``; each frame waits up to ``timeout_s`` for its ACK
        (``job``: the purge job, named in the frames)."""
        engine = self.identity.engine if self.identity else "?"
        step = MAX_EVICT_DIGESTS
        frames = [digests[i : i + step] for i in range(0, len(digests), step)] or [[]]
        removed = 0
        errors: list[str] = []
        for frame in frames:
            try:
                ack = await self._evict_frame(frame, timeout_s, job)
            except (TimeoutError, ConnectionClosed) as exc:
                return EngineEvictResult(engine, acked=False, error=type(exc).__name__)
            names = ack.get("removed")
            error = ack.get("error")
            if isinstance(names, list):
                # only names this frame asked for count: an engine's own ACK could name any
                # number, and the count goes into a receipt and a chained event (review r12)
                removed += len(set(frame).intersection(n for n in names if isinstance(n, str)))
            if isinstance(error, str) and error not in errors:
                errors.append(error)
        return EngineEvictResult(
            engine, acked=True, removed=removed, error=", ".join(errors) or None
        )

    async def _evict_frame(
        self, digests: Sequence[str], timeout_s: float, job: str | None = None
    ) -> dict[str, Any]:
        self._next_id = self._next_id + 1 if self._next_id < 0x7FFF_FFFF else 1
        sid = 0x8000_0000 | self._next_id  # server-initiated ids have the top bit set
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._acks[sid] = fut
        try:
            self.send(FrameType.EVICT, sid, evict_meta(digests, job=job), flags=Flag.NONE)
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self._acks.pop(sid, None)


#: each frame type's name in the latency metric (``.name`` is a Python-level property)
_OP_NAMES: dict[FrameType, str] = {t: t.name.lower() for t in FrameType}

#: the reply of every stored item (shared: only ever encoded)
_STORED: dict[str, Any] = {"code": 0}


def _put_reply(ack: Ack) -> dict[str, Any]:
    """A PUT item's result on the wire (``docs/protocol.md``)."""
    if ack.stored:
        return _STORED
    if ack.outcome == "error":
        return {"code": int(ErrorCode.INTERNAL), "reason": ack.reason or "store_failed"}
    reason = ack.reason or "denied"
    bad = ack.outcome == "refused" or reason.startswith("bad_item_meta")
    return {"code": int(ErrorCode.BAD_REQUEST if bad else ErrorCode.DENIED), "reason": reason}

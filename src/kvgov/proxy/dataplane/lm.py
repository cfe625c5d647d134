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
kvgov wire stores it) and returned by GET (the name mapped back to LMCache's int). A value
read from a tier that fails its checks is a miss (``FAIL``), not a dropped connection: it is
authenticated whole before it is announced. A value the memory tier lends (sealed by this
process into its own memory) has its first segment authenticated before it is announced and
each next one opened while the one before is written
(:class:`~kvgov.proxy.dataplane.plans.GetPlan`): LMCache asks one chunk at a time and waits for
it, so the decrypt no longer comes before the first byte. Up to :data:`STREAM_LOOP_MAX_BYTES`
the event loop writes it and the crypto pool opens the next segment meanwhile; a larger one is
written by a sender thread while one crypto-pool job opens the segments ahead of it, in turn
with the writes (whatever ``dataplane.inline_crypto_bytes`` says). Should a segment fail then
(a fault: nothing outside the process writes that memory), nothing of it is sent and the
connection is closed, which LMCache's client reads as a miss.

A PUT is sealed and stored by its door's storer task (:mod:`kvgov.proxy.dataplane.pipeline`)
while the next request is read (PUTs of a connection are stored in request order, a run of
ready ones in one pass of the event loop, and any other request first waits until they are
stored, so it sees them); its ledger event is group-committed in the background (at most
``MAX_UNSETTLED_PUTS`` per connection in flight), and a put that cannot be recorded is removed
again.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Iterable
from typing import Any

from kvgov.errors import ConfigError, CorruptValueError
from kvgov.proxy.dataplane.conn import ConnectionClosed, StreamProtocol, refuse
from kvgov.proxy.dataplane.identity import Identity
from kvgov.proxy.dataplane.limits import ConnectionLimits, Watchdog
from kvgov.proxy.dataplane.pipeline import SLICE, Door, Pipeline
from kvgov.wire.itemmeta import from_lm, to_lm
from kvgov.wire.messages import EMPTY_CONTEXT as EMPTY

REQUEST = struct.Struct("=iiiiiiiii150s")  # 186 bytes
REPLY = struct.Struct("=iiiiiiiii")  # 36 bytes
PUT, GET, EXIST, LIST, HEALTH = 1, 2, 3, 4, 5
OK, FAIL = 200, 400
#: stored PUTs per connection whose ledger events are still being committed
MAX_UNSETTLED_PUTS = 64
#: a hit opened as it is sent larger than this is written by a sender thread, which waits on
#: the socket with the GIL released, while a crypto thread opens the segments ahead of it,
#: instead of by the event loop (a loop pass per socketful, a hand-off to the crypto pool per
#: segment); measured in ``docs/operations.md``, "Threads"
STREAM_LOOP_MAX_BYTES = 4 << 20

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
        limits: ConnectionLimits,
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
        self.limits = limits
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
        #: this connection's way into the pipeline
        self.door = Door(server.pipeline, self.listener, server.identity.principal)
        self._admitted = False

    @property
    def busy(self) -> bool:
        """In the middle of a request, or PUTs still wait to be stored or recorded."""
        return self._handling or self.door.busy

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
        self.door.opened()
        super().connection_made(transport)

    def timed_out(self, phase: str) -> None:
        self.door.timed_out(phase)
        self.server.limits.summary.note(
            "dataplane.connection.timed_out", listener=self.listener, phase=phase
        )

    def connection_lost(self, exc: Exception | None) -> None:
        if self._admitted:
            self._admitted = False
            self.server.limits.release(self)
            self.door.closed()
        self.server.connections.discard(self)
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
        head = memoryview(bytearray(REQUEST.size))
        door = self.door
        frame_s = self.server.frame_timeout_s
        loop = asyncio.get_running_loop()
        while True:
            await self.replies_read(frame_s)
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
                door.protocol_error("BAD_FRAME")
                return  # not LMCache's protocol: close this connection only
            if command != PUT:
                await door.stored()  # it sees every earlier PUT
            self._handling = True
            started = loop.time()
            op = {PUT: "put", GET: "get", EXIST: "exists"}.get(command, "health")
            try:
                if command == PUT:
                    meta = from_lm(fmt, dtype, location, (s0, s1, s2, s3))
                    await self._put(key, length, meta)
                elif command == GET:
                    await self._get(key)
                elif command == EXIST:
                    self.reply(OK if await door.exists(self.server.identity, key, EMPTY) else FAIL)
                else:
                    self.reply(OK if command == HEALTH else FAIL)
            finally:
                self._handling = False
                door.observe(op, loop.time() - started)
            self.frames_this_turn += 1
            if self.frames_this_turn >= SLICE:
                # buffered requests are read with no pass of the event loop: the other
                # connections' turn every SLICE of them (review r18, finding 5)
                self.frames_this_turn = 0
                await asyncio.sleep(0)

    async def _put(self, key: str, length: int, meta: dict[str, Any]) -> None:
        door = self.door
        if door.lease_bound(length) > door.pool_share:
            # no frame limit in this protocol: a length no buffer can hold closes the
            # connection (reading and dropping up to 2 GiB would only feed the sender)
            door.protocol_error("TOO_LARGE")
            self.server.limits.summary.note("dataplane.lm.put_too_large", nbytes=length)
            raise ConnectionClosed
        # may wait for the pool
        session = await door.put(self.server.identity, key, EMPTY, length=length, item_meta=meta)
        self.arm(self.server.frame_timeout_s)  # the value must arrive in time
        try:
            for i, window in enumerate(session.windows):
                await self.read_into(window)
                session.received(i)
            if session.skip:
                await self.discard(session.skip)
            self.disarm()
        except BaseException:
            await session.abandon()
            raise
        session.commit()  # PUT has no reply: the door stores, records and counts it
        if door.unsettled >= MAX_UNSETTLED_PUTS:
            await door.settled_below(MAX_UNSETTLED_PUTS)

    async def _get(self, key: str) -> None:
        door = self.door
        plan = await door.get(self.server.identity, key, EMPTY, stream=True)
        if plan is None:
            self.reply(FAIL)
            return
        try:
            fmt, dtype, shape, location = to_lm(plan.item_meta)
            self.reply(OK, length=plan.length, fmt=fmt, dtype=dtype, shape=shape, location=location)
            self.arm(self.server.frame_timeout_s, "reply")  # the hit's buffer is held meanwhile
            try:
                inline = door.inline_bytes
                if plan.opener is not None:
                    inline = min(inline, STREAM_LOOP_MAX_BYTES)
                await self.send_plan(
                    plan, door.sender, crypto=door.crypto, inline_bytes=inline, ahead=door.crypto
                )
            except CorruptValueError as exc:  # a segment opened as it was sent: see the top
                self.close()
                await door.unsent(plan, exc)
                raise ConnectionClosed from exc
            self.disarm()
            await door.sent(plan)
        finally:
            plan.release()

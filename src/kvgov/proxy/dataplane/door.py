"""What a listener uses of the pipeline: one :class:`Door` per connection.

A listener is a codec: it decodes requests, asks its door, and encodes what the door answers.
The door owns the rest, once, for both the kvgov wire and ``lm://``:

* a put is a :class:`PutSession` (:meth:`Door.put`): the listener receives each segment into
  ``windows`` and calls ``received(i)`` (the segment is sealed meanwhile), or reads and drops
  ``skip`` bytes (a denied, refused or :class:`~kvgov.proxy.dataplane.plans.Kept` put); then
  ``commit()`` returns a future of its :class:`Ack`. Committed puts are stored in commit
  order by the door's storer task; each ack resolves once its ``kv:put`` is durable (an
  unrecordable put is removed from every tier again and acks ``error``);
* a get (:meth:`Door.get`, :meth:`Door.get_many`) returns the hits to send, each authenticated
  already; the listener sends one and tells the door: :meth:`Door.sent` (the ``kv:get`` is
  recorded then) or :meth:`Door.failed` (the value is dropped);
* exists and remove answer a bool;
* denials are counted and recorded by the pipeline (against this door's
  :class:`~kvgov.proxy.dataplane.limits.DenialBudget`), operations counted by outcome here;
* the connection's own counters: :meth:`opened`, :meth:`closed`, :meth:`timed_out`,
  :meth:`protocol_error`, :meth:`observe`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvgov.proxy.dataplane.buffers import Lease, size_class
from kvgov.proxy.dataplane.identity import Identity
from kvgov.proxy.dataplane.limits import DenialBudget
from kvgov.proxy.dataplane.plans import Found, GetPlan, Kept, PutPlan, StoredPut
from kvgov.wire.messages import RequestContext

if TYPE_CHECKING:
    from kvgov.proxy.dataplane.pipeline import Pipeline

__all__ = ["SLICE", "Ack", "Door", "GetPlan", "PutSession"]

log = logging.getLogger("kvgov.dataplane")

#: keys or items of a frame handled per turn of the event loop: a large frame yields to the
#: other connections between slices (fairness: another engine's PING is not held behind it)
SLICE = 64


@dataclass(frozen=True, slots=True)
class Ack:
    """How a put ended: ``ok``, ``kept`` (live already, not rewritten), ``denied``,
    ``refused`` (an empty value) or ``error`` (not stored); ``reason`` for the requester."""

    outcome: str
    reason: str | None = None

    @property
    def stored(self) -> bool:
        """Acknowledged as cached (stored now, or live already)."""
        return self.outcome in ("ok", "kept")


ACK_OK = Ack("ok")
ACK_KEPT = Ack("kept")
ACK_EMPTY = Ack("refused", "empty")
ACK_FAILED = Ack("error", "store_failed")


class PutSession:
    """One put item between its request and its ack (:meth:`Door.put`)."""

    __slots__ = ("_door", "_plan", "ack", "skip", "windows")

    def __init__(self, door: Door, plan: PutPlan | None, ack: Ack | None, skip: int) -> None:
        self._door = door
        self._plan = plan
        #: the answer already known (denied, refused, kept): nothing is stored
        self.ack = ack
        #: bytes of the value to read and drop (a put that stores nothing)
        self.skip = skip
        #: where the value's segments go, in order (empty: read and drop ``skip`` bytes)
        self.windows: Sequence[memoryview] = plan.windows if plan is not None else ()

    def received(self, index: int) -> None:
        """Segment ``index`` has fully arrived in its window: seal it (meanwhile the next one
        is received)."""
        assert self._plan is not None  # only a session with windows receives
        self._plan.segment_done(index, self._door._executor)

    def commit(self) -> asyncio.Future[Ack]:
        """Every byte arrived: store it (after the puts committed before it on this door) and
        record it; the future resolves with the ack once the record is durable."""
        return self._door._commit(self)

    async def abandon(self) -> None:
        """The value did not arrive completely: store nothing from it."""
        plan, self._plan = self._plan, None
        if plan is not None:
            await plan.discard()


class Door:
    """One connection's way into the pipeline (see the module docstring)."""

    def __init__(self, pipeline: Pipeline, listener: str, principal: str | None = None) -> None:
        self._pipeline = pipeline
        self.listener = listener
        self.budget = DenialBudget(principal)
        self._executor: Executor = pipeline.executor
        metrics = pipeline.metrics
        self._metrics = metrics
        self._count: Callable[[str, str], None] = lambda op, outcome: metrics.count_op(
            op, listener, outcome
        )
        #: committed puts waiting to be stored, oldest first, and the task storing them
        self._to_store: deque[tuple[PutPlan, asyncio.Future[Ack]]] = deque()
        self._storer: asyncio.Task[None] | None = None
        #: acks of stored puts whose records are not durable yet
        self._unsettled: set[asyncio.Future[Ack]] = set()
        #: unstore tasks of puts whose records failed
        self._unstoring: set[asyncio.Task[None]] = set()

    # -- what the listener needs to receive and send -------------------------------------------

    @property
    def sender(self) -> Executor:
        """Threads that write large hits to their sockets."""
        return self._pipeline.sender

    @property
    def inline_bytes(self) -> int:
        """Hits up to this size are opened and written on the event loop."""
        return self._pipeline.inline_crypto_bytes

    @property
    def pool_share(self) -> int:
        """The most pooled buffer one engine (one frame) may hold at once."""
        return self._pipeline.pool.owner_max_bytes

    def lease_bound(self, length: int) -> int:
        """The pooled buffer a put of ``length`` bytes takes at most."""
        return self._pipeline.lease_bound(length)

    async def leases(self, sizes: Sequence[int], owner: str) -> list[Lease]:
        """Buffers for a frame's items, taken all at once (never part of them while waiting
        for the rest)."""
        return await self._pipeline.pool.acquire_many(list(sizes), owner)

    @property
    def busy(self) -> bool:
        """Puts committed and not yet stored, or stored and not yet recorded."""
        return bool(self._to_store) or bool(self._unsettled)

    @property
    def unsettled(self) -> int:
        """Puts committed whose acks are not resolved yet."""
        return len(self._to_store) + len(self._unsettled)

    async def stored(self) -> None:
        """Wait until every committed put is stored (a later request sees them)."""
        storer = self._storer
        if storer is not None and not storer.done():
            await asyncio.wait([storer])

    async def settled_below(self, limit: int) -> None:
        """Wait until fewer than ``limit`` committed puts wait for their acks."""
        while self.unsettled >= limit:
            if self._to_store:
                await self.stored()
                continue
            await asyncio.wait(list(self._unsettled), return_when=asyncio.FIRST_COMPLETED)

    # -- put -----------------------------------------------------------------------------------

    async def put(
        self,
        identity: Identity,
        key: str,
        ctx: RequestContext,
        *,
        length: int,
        item_meta: Mapping[str, Any],
        lease: Lease | None = None,
    ) -> PutSession:
        """Admit and plan one put item (``lease``: its buffer, taken in advance; the session
        owns it from here)."""
        if length == 0:  # an empty value: nothing to cache, nothing recorded
            if lease is not None:
                lease.release()
            return PutSession(self, None, ACK_EMPTY, 0)
        got = await self._pipeline.put(
            identity, key, ctx, length=length, item_meta=item_meta, lease=lease, budget=self.budget
        )
        if isinstance(got, PutPlan):
            return PutSession(self, got, None, 0)
        if isinstance(got, Kept):  # live already: acknowledged, not rewritten
            return PutSession(self, None, ACK_KEPT, length)
        return PutSession(self, None, Ack("denied", got.reason), length)

    def _commit(self, session: PutSession) -> asyncio.Future[Ack]:
        fut: asyncio.Future[Ack] = asyncio.get_running_loop().create_future()
        plan, session._plan = session._plan, None
        if plan is None:
            ack = session.ack if session.ack is not None else ACK_FAILED
            self._count("put", ack.outcome)
            fut.set_result(ack)
            return fut
        self._to_store.append((plan, fut))
        if self._storer is None or self._storer.done():
            self._storer = asyncio.get_running_loop().create_task(self._store_all())
        return fut

    async def _store_all(self) -> None:
        """Store the committed puts, oldest first (a run of ready ones in one pass of the
        event loop); each then waits for its record without holding the next back."""
        pipeline = self._pipeline
        while self._to_store:
            plan, fut = self._to_store[0]
            try:
                with contextlib.suppress(Exception):  # store_put raises it again
                    await plan.sealed()
                stored = await pipeline.store_put(plan)
            except asyncio.CancelledError:
                for left, waiting in self._to_store:
                    await left.discard()
                    waiting.cancel()
                self._to_store.clear()
                raise
            except Exception as exc:  # noqa: BLE001 - reported per item in its ack
                log.warning("dataplane.put.failed", extra={"error": type(exc).__name__})
                self._acked(fut, ACK_FAILED)
                continue
            finally:
                if self._to_store and self._to_store[0][1] is fut:
                    self._to_store.popleft()
            self._settle(stored, fut)

    def _settle(self, stored: StoredPut, fut: asyncio.Future[Ack]) -> None:
        recorded = stored.recorded
        if recorded is None:
            self._acked(fut, ACK_OK)
            return
        self._unsettled.add(fut)
        if not isinstance(recorded, asyncio.Future):  # pragma: no cover - sinks give futures
            recorded = asyncio.ensure_future(recorded)

        def settled(done: asyncio.Future[Any]) -> None:
            self._unsettled.discard(fut)
            if not done.cancelled() and done.exception() is None:
                self._acked(fut, ACK_OK)
                return
            # unrecorded: nothing stays stored unrecorded (the ack waits for the removal)
            self._unsettled.add(fut)
            task = asyncio.get_running_loop().create_task(self._unstore(stored, fut))
            self._unstoring.add(task)
            task.add_done_callback(self._unstoring.discard)

        recorded.add_done_callback(settled)

    async def _unstore(self, stored: StoredPut, fut: asyncio.Future[Ack]) -> None:
        try:
            await self._pipeline.unstore(stored)
        finally:
            self._unsettled.discard(fut)
            self._acked(fut, ACK_FAILED)

    def _acked(self, fut: asyncio.Future[Ack], ack: Ack) -> None:
        self._count("put", ack.outcome)
        if not fut.done():
            fut.set_result(ack)

    # -- get -----------------------------------------------------------------------------------

    async def get(self, identity: Identity, key: str, ctx: RequestContext) -> GetPlan | None:
        """One key's hit, authenticated and ready to send, or None (a miss or a denial)."""
        plan = await self._pipeline.get(identity, key, ctx, self.budget)
        if plan is None:
            self._count("get", "miss")
        return plan

    async def get_many(
        self, identity: Identity, keys: Sequence[str], ctx: RequestContext, max_bytes: int
    ) -> list[GetPlan | None]:
        """Each key's hit or None. Every key is admitted and found first, then the hits'
        buffers are taken all at once, then read; hits beyond ``max_bytes`` in all or what the
        pool holds for one engine are misses."""
        pipeline = self._pipeline
        finds: list[Found | None] = []
        for i, key in enumerate(keys):
            if i % SLICE == SLICE - 1:
                await asyncio.sleep(0)  # the other connections' turn
            finds.append(await pipeline.find(identity, key, ctx, self.budget))
        budget = max_bytes
        room = self.pool_share
        taken: list[Found] = []
        for found in finds:
            if found is not None and budget > 0 and size_class(found.size) <= room:
                taken.append(found)
                budget -= found.size
                room -= size_class(found.size)
        got = await self.leases([f.size for f in taken], identity.engine)
        leases = dict(zip(map(id, taken), got, strict=True))
        plans: list[GetPlan | None] = []
        try:
            for found in finds:
                plan = None
                if found is not None:
                    plan = await pipeline.load(found, leases.pop(id(found), None))
                if plan is None:
                    self._count("get", "miss")
                plans.append(plan)
        except BaseException:
            for plan in plans:
                if plan is not None:
                    plan.release()
            raise
        finally:
            for lease in leases.values():
                lease.release()
        return plans

    async def sent(self, plan: GetPlan) -> None:
        """The hit's bytes were handed to the socket: record and count it."""
        self._count("get", "hit")
        await self._pipeline.served(plan)

    # -- exists / remove -----------------------------------------------------------------------

    async def exists(self, identity: Identity, key: str, ctx: RequestContext) -> bool:
        found = await self._pipeline.exists(identity, key, ctx, self.budget)
        self._count("exists", "hit" if found else "miss")
        return found

    async def remove(self, identity: Identity, key: str, ctx: RequestContext) -> bool:
        removed = await self._pipeline.remove(identity, key, ctx, self.budget)
        self._count("remove", "hit" if removed else "miss")
        return removed

    # -- the connection's own counters ---------------------------------------------------------

    def opened(self) -> None:
        self._metrics.connections.labels(self.listener).inc()

    def closed(self) -> None:
        """The connection is gone: record what its denial budget still holds."""
        self._metrics.connections.labels(self.listener).dec()
        self._pipeline.end_denials(self.budget)

    def timed_out(self, phase: str) -> None:
        self._metrics.timeouts.labels(self.listener, phase).inc()

    def protocol_error(self, code: str) -> None:
        self._metrics.protocol_errors.labels(self.listener, code).inc()

    def observe(self, op: str, seconds: float) -> None:
        self._metrics.latency.labels(op).observe(seconds)

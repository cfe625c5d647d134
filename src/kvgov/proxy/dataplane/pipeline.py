"""The governed pipeline every KV operation goes through, whatever listener it came from.

A listener is a codec: it decodes requests, asks its connection's :class:`Door` and encodes
what the door answers. Everything else a governed operation does is here, once, for both the
kvgov wire and ``lm://``, and reads top to bottom; the pieces it calls (``admission.py``,
``plans.py``, the tiers, the entry index, ``records.py``) never call back into it.

A put, in order:

1. admit: :meth:`Door.put` -> :meth:`Pipeline.put` -> :meth:`Pipeline.admit`
   (:mod:`~kvgov.proxy.dataplane.admission`: identity, i.e. key tags vs engine and request
   context, users pseudonymised; then the policy, its cached fast path first). A denial is
   counted and recorded there, once (``kv:entry:denied``), and stores nothing.
2. plan, before the bytes arrive (:meth:`Pipeline._plan_put`): item metadata kvgov does not
   store (:func:`~kvgov.wire.itemmeta.check_item_meta`) is refused (``bad_item_meta``); a key
   that is live or being stored is :class:`Kept` (acknowledged, its bytes read and dropped,
   ``kv:put:kept``); the policy's tiers; the buffers and windows
   (:func:`~kvgov.proxy.dataplane.plans.lay_out`). The door hands back a :class:`PutSession`.
3. receive/seal: the listener receives each segment into ``session.windows`` and calls
   ``received(i)``: the plan (:mod:`~kvgov.proxy.dataplane.plans`) seals it in place while
   the next one is on the wire (a put that stores nothing has ``skip`` bytes to drop).
4. commit: ``session.commit()`` queues it on its door, whose storer task
   (:meth:`Door._store_all`) stores committed puts in commit order:
5. store: :meth:`Pipeline.store_put` writes the tiers the policy allows, with its TTL, and
   makes the entry visible in the index;
6. record: its ``kv:put`` (:mod:`~kvgov.proxy.dataplane.records`) is queued for the ledger
   writer;
7. settle/ack: :meth:`Door._settle` resolves the ack once that event is durable. A put whose
   event cannot be recorded is removed from every tier again (:meth:`Pipeline.unstore`) and
   acks ``error``: nothing stays stored unrecorded.

A get, in order: admit (:meth:`Door.get`, :meth:`Door.get_many` -> :meth:`Pipeline.find` ->
:meth:`Pipeline.admit`; a denied get is a miss) -> find (the entry index: live, unexpired and
readable by this requester, judged again by what was recorded at put; a miss is recorded) ->
load (:meth:`Pipeline.load`: the value read from a tier, its envelope
(:mod:`kvgov.keys.sealformat`: length and item metadata, bound into the sealed chunk's AAD) and
every segment authenticated and opened into the hit's buffer before the hit is announced, or,
asked to ``stream`` a value the memory tier lends, the first: :class:`GetPlan`) ->
sent (the listener hands it to the socket and tells :meth:`Door.sent`) -> served
(:meth:`Pipeline.served`: the ``kv:get`` is recorded then, not before). A value edited,
truncated, extended, flipped or moved at rest is a miss, never bytes on the wire: it is dropped
from the index and every tier, recorded (``kv:delete``, reason ``unreadable:<code>``) and
counted (``kvgov_dataplane_unreadable_total``) (:meth:`Pipeline.drop_unreadable`). Exists and
remove: :meth:`Door.exists` / :meth:`Door.remove` -> admit -> the readable entry -> recorded.

The door counts operations by outcome and its connection's own counters (:meth:`Door.opened`,
:meth:`Door.closed`, :meth:`Door.timed_out`, :meth:`Door.protocol_error`,
:meth:`Door.observe`); denials are recorded against its
:class:`~kvgov.proxy.dataplane.limits.DenialBudget`, one event each up to the
:class:`~kvgov.proxy.dataplane.limits.DenialGate`'s caps, then summarised (admission.py). A
tier's capacity eviction is a ``kv:evict`` event (:meth:`Pipeline.tier_evicted`). The policy,
the sealer (the keyring) and the event sink are always there; a benchmark measuring "governance
off" passes the named null ones (:mod:`kvgov.proxy.dataplane.unsafe`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from kvgov.connectors.tiers.chain import TierChain
from kvgov.errors import CorruptValueError, ItemMetaError, KvgovError
from kvgov.keys import sealformat
from kvgov.keys.keyring import Keyring
from kvgov.ledger.events import EventSink
from kvgov.ledger.pseudonym import Pseudonymizer
from kvgov.policy.interfaces import Decision, PolicyEngine
from kvgov.proxy.dataplane.admission import Admission, Allowed
from kvgov.proxy.dataplane.buffers import BufferPool, Lease, size_class
from kvgov.proxy.dataplane.fences import ERASURE_IN_PROGRESS, ErasureFencedError, Fence, in_scope
from kvgov.proxy.dataplane.identity import Denied, Identity, Who
from kvgov.proxy.dataplane.index import EntryIndex, EntryMeta
from kvgov.proxy.dataplane.limits import DenialBudget, DenialGate
from kvgov.proxy.dataplane.metrics import DataPlaneMetrics
from kvgov.proxy.dataplane.plans import (
    INLINE_CRYPTO_BYTES,
    Found,
    GetPlan,
    Kept,
    PutPlan,
    StoredPut,
    lay_out,
    open_value,
    segments_per_job,
)
from kvgov.proxy.dataplane.records import Recorder, entry_gone, op_event, put_event
from kvgov.proxy.dataplane.sealers import Sealer
from kvgov.proxy.dataplane.unsafe import NullEventSink
from kvgov.proxy.dataplane.upkeep import evicted
from kvgov.types import EntryState, EventKind, Operation, Outcome, Scope
from kvgov.wire.itemmeta import check_item_meta
from kvgov.wire.messages import RequestContext

__all__ = [
    "SLICE",
    "Ack",
    "Allowed",
    "Denied",
    "Door",
    "Found",
    "GetPlan",
    "Kept",
    "Pipeline",
    "PutPlan",
    "PutSession",
    "StoredPut",
]

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
#: a put in flight when an erasure of its scope began (:mod:`~kvgov.proxy.dataplane.fences`)
ACK_FENCED = Ack("error", ERASURE_IN_PROGRESS)


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
        self._metrics = pipeline.metrics
        #: ``ops{op,listener,outcome}.inc`` by (op, outcome), bound on first use
        self._incs: dict[tuple[str, str], Callable[[], None]] = {}
        #: committed puts waiting to be stored, oldest first, and the task storing them
        self._to_store: deque[tuple[PutPlan, asyncio.Future[Ack]]] = deque()
        self._storer: asyncio.Task[None] | None = None
        #: acks of stored puts whose records are not durable yet
        self._unsettled: set[asyncio.Future[Ack]] = set()
        #: unstore tasks of puts whose records failed
        self._unstoring: set[asyncio.Task[None]] = set()
        #: the client streams PUT frames (:meth:`streaming`)
        self._streaming = False

    # -- what the listener needs to receive and send -------------------------------------------

    @property
    def sender(self) -> Executor:
        """Threads that write large hits to their sockets."""
        return self._pipeline.sender

    @property
    def crypto(self) -> Executor:
        """Threads that seal and open segments (a hit opened as it is sent: its next one)."""
        return self._pipeline.executor

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

    # -- put: 1-2 admit and plan, 4 commit, 5-6 store and record in order, 7 settle/ack ---------

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
                stored = await pipeline.store_put(plan, hold=self._streaming)
            except asyncio.CancelledError:
                for left, waiting in self._to_store:
                    await left.discard()
                    waiting.cancel()
                self._to_store.clear()
                raise
            except ErasureFencedError:  # nothing stored; recorded as a denial by store_put
                self._acked(fut, ACK_FENCED)
                continue
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

    # -- get: admit and find, load (Pipeline), sent -> served ----------------------------------

    async def get(
        self, identity: Identity, key: str, ctx: RequestContext, *, stream: bool = False
    ) -> GetPlan | None:
        """One key's hit, ready to send, or None (a miss or a denial). ``stream``: one the
        memory tier lends may be opened as it is sent (:class:`GetPlan`; :meth:`unsent` if a
        segment fails its checks then)."""
        plan = await self._pipeline.get(identity, key, ctx, self.budget, stream=stream)
        if plan is None:
            self._count("get", "miss")
        return plan

    async def get_many(
        self,
        identity: Identity,
        keys: Sequence[str],
        ctx: RequestContext,
        max_bytes: int,
        *,
        stream: bool = False,
    ) -> list[GetPlan | None]:
        """Each key's hit or None (``stream``: as for :meth:`get`). Every key is admitted and
        found first, then the hits' buffers are taken all at once, then read; hits beyond
        ``max_bytes`` in all or what the pool holds for one engine are misses."""
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
                    lease = leases.pop(id(found), None)
                    plan = await pipeline.load(found, lease, stream=stream)
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

    async def unsent(self, plan: GetPlan, error: CorruptValueError) -> None:
        """A segment of a hit opened as it is sent failed its checks after the hit was
        announced (nothing of it was sent; the listener withdrew the hit, or closed the
        connection where its protocol cannot): drop the value, record that and the get as a
        miss."""
        self._count("get", "miss")
        await self._pipeline.unsent(plan, error)

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

    def streaming(self, *, more: bool) -> None:
        """Whether the client sends more PUT frames before it waits for this one's reply (it
        said so on its latest frame, and that frame's reply is not sent yet): the records of
        the puts it stores meanwhile may wait up to ``ledger.journal_sync_interval_ms`` for
        the next ones to share a journal sync (this door's own acks only)."""
        self._streaming = more

    def closed(self) -> None:
        """The connection is gone: record what its denial budget still holds."""
        self.streaming(more=False)
        self._metrics.connections.labels(self.listener).dec()
        self._pipeline.admission.end_denials(self.budget)

    def timed_out(self, phase: str) -> None:
        self._metrics.timeouts.labels(self.listener, phase).inc()

    def protocol_error(self, code: str) -> None:
        self._metrics.protocol_errors.labels(self.listener, code).inc()

    def observe(self, op: str, seconds: float) -> None:
        self._metrics.latency_of(op).observe(seconds)

    def _count(self, op: str, outcome: str) -> None:
        """``ops{op,listener,outcome} += 1`` (the labelled child's ``inc`` bound once per
        door)."""
        inc = self._incs.get((op, outcome))
        if inc is None:
            inc = self._incs[op, outcome] = self._metrics.op_counter(op, self.listener, outcome).inc
        inc()


class Pipeline:
    """The steps of every operation, shared by every connection (see the module docstring);
    the helpers it calls (admission, plans, records) never call back into it."""

    def __init__(
        self,
        *,
        tiers: TierChain,
        pseudonymizer: Pseudonymizer,
        pool: BufferPool,
        executor: Executor,
        metrics: DataPlaneMetrics,
        sender: Executor | None = None,
        index: EntryIndex | None = None,
        policy: PolicyEngine,
        sealer: Sealer,
        sink: EventSink,
        segment_size: int = 1 << 20,
        inline_crypto_bytes: int = INLINE_CRYPTO_BYTES,
        default_tenant: str | None = None,
        clock: Callable[[], float] = time.time,
        denial_gate: DenialGate | None = None,
    ) -> None:
        self.tiers = tiers
        self.pool = pool
        self.executor = executor
        #: threads that write large replies (None: the crypto ``executor`` does)
        self.sender = sender if sender is not None else executor
        self.metrics = metrics
        self.index = index if index is not None else EntryIndex()
        #: what values are sealed with (sealers.py; the benchmarks' PlaintextSealer: nothing)
        self.sealer = sealer
        #: how events reach the sink (records.py)
        self.recorder = Recorder(sink)
        #: identity, policy and the record of every denial (admission.py)
        self.admission = Admission(
            pseudonymizer=pseudonymizer,
            policy=policy,
            metrics=metrics,
            recorder=self.recorder,
            default_tenant=default_tenant,
            denial_gate=denial_gate,
        )
        #: every operation's first step: ``Allowed | Denied`` (a denial counted and recorded)
        self.admit = self.admission.admit
        self.segment_size = segment_size
        #: chunks up to this size are sealed and opened on the event loop
        self.inline_crypto_bytes = inline_crypto_bytes
        self.clock = clock
        #: counter children looked up once (``labels()`` costs microseconds per call)
        self._put_bytes = metrics.op_bytes.labels("put")
        self._get_bytes = metrics.op_bytes.labels("get")
        #: puts planned and not yet stored or dropped, by digest (a second put of one is kept)
        self._storing: dict[str, PutPlan] = {}
        #: erasures under way, by purge job id (:meth:`fence`); empty but while a purge runs
        self._fences: dict[str, Fence] = {}

    @property
    def keyring(self) -> Keyring | None:
        """The keyring, for the sidecar's key upkeep (None: values are not sealed)."""
        return self.sealer.keyring

    @property
    def sink(self) -> EventSink:
        """Where events go."""
        return self.recorder.sink

    @sink.setter
    def sink(self, sink: EventSink) -> None:
        self.recorder.sink = sink

    @property
    def policy(self) -> PolicyEngine:
        return self.admission.policy

    @property
    def pseudonymizer(self) -> Pseudonymizer:
        return self.admission.pseudonymizer

    @property
    def governed(self) -> bool:
        """No null collaborator stands in (policy, sealer, event sink)."""
        return (
            self.sealer.sealed
            and not isinstance(self.sink, NullEventSink)
            and self.policy.revision.policy != "unsafe-allow-all"
        )

    # -- put: 1-2 admit and plan (put), 5-6 store and record (store_put) ------------------------

    async def may_act_for(self, engine: str, tenant: str) -> bool:
        """Whether the policy lets ``engine`` act for ``tenant`` at all: whom an EVICT for
        ``tenant`` may reach (:meth:`Admission.may_act_for`)."""
        return await self.admission.may_act_for(engine, tenant)

    def lease_bound(self, length: int, item_meta: Mapping[str, Any] | None = None) -> int:
        """An upper bound on the pooled buffer a put of ``length`` bytes takes (its envelope
        head at its longest: item metadata is refused beyond that)."""
        del item_meta  # bounded by sealformat.MAX_HEAD_SIZE whatever it holds
        try:
            body = self.sealer.body_size(length, self.segment_size)
        except ValueError:  # beyond what one sealed chunk can hold
            return 1 << 62
        return size_class(body + sealformat.MAX_HEAD_SIZE)

    async def put(
        self,
        identity: Identity,
        raw_key: str,
        ctx: RequestContext,
        *,
        length: int,
        item_meta: Mapping[str, Any],
        lease: Lease | None = None,
        budget: DenialBudget | None = None,
    ) -> PutPlan | Denied | Kept:
        """A put's first step: admit it, then lay out where its bytes go. ``lease``: a buffer
        taken for it in advance (at least :meth:`lease_bound`; the plan owns it from here,
        denied or not). A denial is counted and recorded here."""
        try:
            admitted = await self.admit(identity, raw_key, ctx, Operation.PUT, budget)
            if isinstance(admitted, Denied):
                if lease is not None:
                    lease.release()
                return admitted
            planned = await self._plan_put(
                admitted.who, admitted.decision, length, item_meta, lease
            )
        except BaseException:
            if lease is not None:
                lease.release()
            raise
        if isinstance(planned, Denied):
            await self.admission.deny(admitted.who, planned, Operation.PUT, budget)
        return planned

    async def _plan_put(
        self,
        who: Who,
        decision: Decision,
        length: int,
        raw_meta: Mapping[str, Any],
        given: Lease | None,
    ) -> PutPlan | Denied | Kept:
        try:  # what every later get hands the engine: only a form it can read is stored
            item_meta = check_item_meta(raw_meta)
        except ItemMetaError as exc:
            if given is not None:
                given.release()
            return Denied(f"bad_item_meta: {exc.message}", who.identity, who.ctx, decision)
        if self._fences and self._fenced(who):  # its erasure is under way: not cached now
            if given is not None:
                given.release()
            return Denied(ERASURE_IN_PROGRESS, who.identity, who.ctx, decision)
        kept = self._kept(who, decision)
        if kept is not None:
            if given is not None:
                given.release()
            return kept
        allowed = decision.tiers
        if not self.tiers.holds_any(allowed):
            if given is not None:
                given.release()
            return Denied("no_allowed_tier", who.identity, who.ctx, decision)
        scope_user = who.key_user if decision.scope is Scope.USER else None
        sealer = self.sealer
        head = sealformat.encode_head(item_meta, length, sealed=sealer.sealed)
        body_len = sealer.body_size(length, self.segment_size)
        if given is None:
            lease = await self.pool.acquire(len(head) + body_len, who.identity.engine)
            # the loop ran while it waited: an erasure of its scope may have begun, or another
            # put of its key been planned (one plan per key is ever being stored: :meth:`fence`)
            stop = self._unplanned(who, decision)
            if stop is not None:
                lease.release()
                return stop
        else:
            lease = given.resize(len(head) + body_len)
        # the fastest tier's own buffer, when it can set one aside: sealed into, then kept
        reserved = self.tiers.reserve(len(head) + body_len, allowed=allowed)
        try:
            make, windows = lay_out(
                who,
                head,
                length,
                lease,
                reserved,
                sealer=sealer,
                segment_size=self.segment_size,
                scope_user=scope_user,
            )
        except BaseException:
            if reserved is not None:
                reserved.cancel()
            lease.release()
            raise
        per_job = segments_per_job(self.segment_size)
        plan = self._storing[who.digest] = PutPlan(
            who,
            lease,
            length,
            item_meta,
            decision,
            make,
            len(head),
            windows,
            per_job,
            reserved=reserved,
            inline_bytes=self.inline_crypto_bytes,
            on_done=self._planned_done,
        )
        return plan

    def _planned_done(self, digest: str) -> None:
        self._storing.pop(digest, None)

    def _unplanned(self, who: Who, decision: Decision) -> Denied | Kept | None:
        """What stops a put before it is planned (the checks :meth:`_plan_put` makes first)."""
        if self._fences and self._fenced(who):
            return Denied(ERASURE_IN_PROGRESS, who.identity, who.ctx, decision)
        return self._kept(who, decision)

    def _kept(self, who: Who, decision: Decision | None) -> Kept | None:
        """A put of a key that is live, or being stored by another put, is acknowledged
        without rewriting it: cached bytes are immutable while live (a key is a function of
        its token prefix, so an honest second writer has the same bytes, and a dishonest one
        must not replace them). Recorded as ``kv:put:kept``."""
        entry = self.index.get(who.digest)
        if entry is not None and entry.expired(self.clock()):
            entry = None  # the sweeper's to drop; the new put replaces it
        if entry is None and who.digest not in self._storing:
            return None
        reason = "live" if entry is not None else "being_stored"
        event = op_event(
            EventKind.KV_PUT_KEPT,
            who,
            outcome=Outcome.OK,
            reason=reason,
            decision_id=decision.decision_id if decision else None,
            policy_revision=decision.policy_revision if decision else None,
        )
        self.recorder.note(event)
        return Kept(who, reason)

    async def store_put(self, plan: PutPlan, *, hold: bool = False) -> StoredPut:
        """Finish sealing, write the tiers, make the entry visible and queue its ``kv:put``
        event (``hold``: the client streams more puts right behind it, whose records may
        share its journal sync). Raises (having stored nothing) on failure; releases the
        plan's buffer."""
        who, decision = plan.who, plan.decision
        try:
            writer = await plan.sealed()
            if plan.fenced:  # an erasure of its scope began while it arrived: not written
                raise await self._fenced_out(plan, written=False)
            now = self.clock()
            ttl = decision.ttl_s
            expires_at = now + ttl if ttl is not None else None  # 0: refused by the policy
            allowed = decision.tiers
            total = plan.body_offset + writer.sealed_len
            reserved, plan.reserved = plan.reserved, None
            # from here until it is indexed, a tier's eviction of its key is this put's copy
            # (a tier protects a key only while its own write runs, and a write-through of
            # several tiers wakes this a pass of the loop after the last one: another put can
            # make room in between): noted on the plan (:meth:`tier_evicted`), recorded below
            plan.evicted = []
            if reserved is None:
                written = await self.tiers.put(
                    who.digest, plan.lease.view[:total], allowed=allowed, expires_at=expires_at
                )
            else:  # the writer wrote the body into the tier's own buffer
                written = await self.tiers.put_reserved(
                    who.digest, reserved, allowed=allowed, expires_at=expires_at
                )
            if plan.fenced:  # ... or while it was written: taken out again, never visible
                raise await self._fenced_out(plan, written=True)
        finally:
            plan.abort()
        scope = decision.scope
        key = writer.key
        sensitivity = decision.sensitivity or who.ctx.sensitivity
        entry = EntryMeta(
            tenant=who.tenant,
            owner=who.actor,
            scope_user=who.key_user if scope is Scope.USER else None,
            scope=scope,
            sensitivity=sensitivity,
            model=who.key.model,
            size=plan.length,
            tiers=written,
            key_id=key.key_id if key else None,
            key_version=key.version if key else None,
            expires_at=expires_at,
        )
        self.index.set(who.digest, entry)
        stored = StoredPut(who.digest, entry)
        try:
            stored.recorded = await self.recorder.queue(
                put_event(op_event, who, decision, entry, written), hold=hold
            )
        except BaseException:
            await self.unstore(stored)
            raise
        for tier in plan.evicted or ():  # after its kv:put, which they amend (kv:evict)
            self._evicted(tier, who.digest)
        self._put_bytes.inc(plan.length)
        return stored

    async def _fenced_out(self, plan: PutPlan, *, written: bool) -> ErasureFencedError:
        """A put in flight when an erasure of its scope began (:meth:`fence`): remove what it
        wrote (it is still being stored, so no other put of its key has written since) and
        record the refusal; the caller raises what this returns, and the ack is ``error``."""
        who = plan.who
        log.warning("dataplane.put.fenced", extra={"key_digest": who.digest})
        if written:
            await self.tiers.delete(who.digest)
        denied = Denied(ERASURE_IN_PROGRESS, who.identity, who.ctx, plan.decision)
        await self.admission.deny(who, denied, Operation.PUT, None)
        return ErasureFencedError("a purge of this put's scope began while it was in flight")

    async def unstore(self, stored: StoredPut) -> None:
        """Take an unrecorded put out of the index and every tier, whatever its entry lists
        now, unless a newer put of its key replaced it (or is being stored): the tiers then
        hold the newer put's bytes. Its entry is known by identity, which a tier's eviction of
        one copy keeps (:func:`~kvgov.proxy.dataplane.upkeep.evicted` updates it in place).
        An entry evicted from every tier has left the index; what may be left of it (a copy
        promoted into a tier its entry never listed) is deleted all the same."""
        log.warning("dataplane.put.unrecorded", extra={"key_digest": stored.digest})
        digest = stored.digest
        current = self.index.get(digest)
        if current is stored.entry:
            self.index.pop(digest)
        elif current is not None or digest in self._storing:
            return  # replaced: another put's entry, and its bytes
        await self.tiers.delete(digest)

    # -- erasure fences (fences.py): a purge's tier step raises one before it reads its scope --

    def fence(self, job_id: str, fence: Fence) -> int:
        """Raise ``fence`` for purge job ``job_id`` (again: replaced). Puts of its scope in
        flight now are marked and never made visible (:meth:`store_put`); puts of it admitted
        while it stands are denied (:meth:`_plan_put`). Returns how many in flight it caught.
        Synchronous on the event loop: a put is either still being stored here (marked) or
        already in the index (:meth:`fenced_entries` finds it), never between the two."""
        self._fences[job_id] = fence
        caught = 0
        for plan in self._storing.values():
            who = plan.who
            if fence.covers(who.tenant, who.actor, who.key_user):
                plan.fenced = True
                caught += 1
        return caught

    def lift(self, job_ids: Sequence[str]) -> None:
        """The purge jobs are finished: their puts are cached again."""
        for job_id in job_ids:
            self._fences.pop(job_id, None)

    @property
    def fenced_jobs(self) -> list[str]:
        """The purge jobs whose fences stand here."""
        return list(self._fences)

    def fenced_entries(self, fence: Fence) -> list[str]:
        """Digests of the entries this index holds in ``fence``'s scope (whatever the database
        shows: their records may not have reached it, or a row may have been edited)."""
        return in_scope(self.index.items(), fence)

    def _fenced(self, who: Who) -> bool:
        """Whether an erasure under way covers a put by ``who`` (a lapsed fence is dropped)."""
        now = self.clock()
        for job_id, fence in list(self._fences.items()):
            if fence.until <= now:
                del self._fences[job_id]
            elif fence.covers(who.tenant, who.actor, who.key_user):
                return True
        return False

    # -- get / exists / remove -----------------------------------------------------------------

    async def get(
        self,
        identity: Identity,
        raw_key: str,
        ctx: RequestContext,
        budget: DenialBudget | None = None,
        *,
        stream: bool = False,
    ) -> GetPlan | None:
        """A hit ready to stream (:meth:`find`, a buffer, :meth:`load`), or None: a miss."""
        found = await self.find(identity, raw_key, ctx, budget)
        if found is None:
            return None
        if size_class(found.size) > self.pool.owner_max_bytes:
            return await self.load(found, None)  # waiting for that much could wait for ever
        lease = await self.pool.acquire(found.size, identity.engine)
        return await self.load(found, lease, stream=stream)

    async def find(
        self,
        identity: Identity,
        raw_key: str,
        ctx: RequestContext,
        budget: DenialBudget | None = None,
    ) -> Found | None:
        """A get's first step: admitted, the readable entry and its stored size, or None (a
        denial or a miss, now recorded). :meth:`load` with a buffer of ``size`` bytes goes on."""
        admitted = await self.admit(identity, raw_key, ctx, Operation.GET, budget)
        if isinstance(admitted, Denied):
            return None
        who = admitted.who
        entry, decision = await self._readable(who, admitted.decision, Operation.GET, budget)
        size = await self.tiers.size_of(who.digest) if entry is not None else None
        if entry is None or size is None:
            await self._record_get(who, None, decision)
            return None
        return Found(who, entry, decision, size)

    async def load(
        self, found: Found, lease: Lease | None, *, stream: bool = False
    ) -> GetPlan | None:
        """A get's second step: read the value into ``lease`` (which the plan then owns; None:
        a miss) and authenticate every segment, or, with ``stream``, for a value the memory
        tier lends, the first (:class:`GetPlan`: the rest are opened as they are sent). A miss
        is recorded here; a hit once it was handed to the socket (:meth:`served`)."""
        plan, reason = (
            await self._load(found.who, found.entry, found.decision, lease, stream)
            if lease is not None
            else (None, None)
        )
        if plan is None:
            await self._record_get(found.who, None, found.decision, reason)
        return plan

    async def _readable(
        self, who: Who, asked: Decision | None, op: Operation, budget: DenialBudget | None
    ) -> tuple[EntryMeta | None, Decision | None]:
        """The entry if it is live, unexpired and readable by ``who`` (judged again by what was
        recorded at put: :meth:`Admission.readable`, which records denials)."""
        entry = self.index.get(who.digest)
        if entry is None:
            return None, asked
        if entry.expired(self.clock()):
            return None, asked  # a miss; the sweeper deletes it and records that
        decision = await self.admission.readable(who, entry, op, budget)
        if decision is None:
            return None, None
        return entry, decision

    async def _load(
        self,
        who: Who,
        entry: EntryMeta,
        decision: Decision | None,
        lease: Lease,
        stream: bool = False,
    ) -> tuple[GetPlan | None, str | None]:
        """The plan, its bytes opened and checked, or None and why the stored value could
        not be served (None: not there). A value that fails its checks is dropped here."""
        src = self.tiers.borrow(who.digest)  # read in place: no copy into the lease
        tier = self.tiers.names[0] if src is not None else None
        try:
            if src is not None:
                value = src.view
            else:
                hit = await self.tiers.get_into(who.digest, lease.view, allowed=entry.tiers)
                if hit is None:
                    lease.release()
                    return None, None
                tier = hit.tier
                value = lease.view[: hit.nbytes]
            envelope, windows, opener = await open_value(
                value,
                self.sealer,
                who,
                lease,
                in_place=src is None,
                executor=self.executor,
                inline_bytes=self.inline_crypto_bytes,
                stream=stream,
                sealed_with=entry.sealed_with,
            )
            plan = GetPlan(
                who, lease, envelope.plain_len, envelope.meta, windows, decision, opener, tier
            )
            if src is not None:
                if opener is None:
                    src.release()
                else:  # still read from as the hit is sent
                    plan.borrowed = src
            return plan, None
        except CorruptValueError as exc:
            if src is not None:
                src.release()
            lease.release()
            await self.drop_unreadable(who, exc, tier)
            return None, exc.code
        except KvgovError as exc:
            if src is not None:
                src.release()
            lease.release()
            log.warning("dataplane.get.unreadable", extra={"error": exc.code})
            return None, exc.code
        except BaseException:
            if src is not None:
                src.release()
            lease.release()
            raise

    async def drop_unreadable(self, who: Who, error: KvgovError, tier: str | None = None) -> None:
        """A stored value failed its checks (its envelope, length or metadata was edited, its
        ciphertext corrupted or tampered with at rest, it was moved from another key or
        tenant, it is in a format this kvgov does not read) or its key was shredded while it
        was being sent: it can never be served, so remove it from the index and every tier
        (the copies are of one put; KV cache is recomputable), record why (``kv:delete``,
        reason ``unreadable:<code>``, the tier that held it) and count it. A put of the same
        key racing this is removed too; one that another get dropped already is not counted
        again."""
        log.warning(
            "dataplane.get.unreadable",
            extra={"key_digest": who.digest, "error": error.code, "tier": tier},
        )
        entry = self.index.pop(who.digest)
        held = await self.tiers.delete(who.digest)
        if entry is None and not held:
            return
        self.metrics.unreadable.labels(error.code).inc()
        event = op_event(
            EventKind.KV_DELETE,
            who,
            outcome=Outcome.ERROR,
            reason=f"unreadable:{error.code}",
            tier=tier,
        )
        try:
            await self.recorder.record(entry_gone(event, EntryState.DELETED), durable=True)
        except KvgovError as exc:
            log.error("dataplane.event.unrecorded", extra={"error": exc.code})

    async def unsent(self, plan: GetPlan, error: CorruptValueError) -> None:
        """A hit that failed its checks after it was announced (:meth:`Door.unsent`): dropped
        like any unreadable value, its get recorded as a miss."""
        await self.drop_unreadable(plan.who, error, plan.tier)
        await self._record_get(plan.who, None, plan.decision, error.code)

    async def served(self, plan: GetPlan) -> None:
        """A get's last step: its bytes were authenticated and handed to the socket; record
        the ``kv:get`` that served them."""
        self._get_bytes.inc(plan.length)
        await self._record_get(plan.who, plan, plan.decision)

    async def _record_get(
        self,
        who: Who,
        plan: GetPlan | None,
        decision: Decision | None,
        reason: str | None = None,
    ) -> None:
        await self.recorder.record(
            op_event(
                EventKind.KV_GET if plan is not None else EventKind.KV_MISS,
                who,
                outcome=Outcome.HIT if plan is not None else Outcome.MISS,
                nbytes=plan.length if plan is not None else None,
                decision_id=decision.decision_id if decision else None,
                policy_revision=decision.policy_revision if decision else None,
                reason=reason if plan is None else None,
            ),
            durable=False,
        )

    async def exists(
        self,
        identity: Identity,
        raw_key: str,
        ctx: RequestContext,
        budget: DenialBudget | None = None,
    ) -> bool:
        """Whether the key is stored and readable by the requester (a denial is a miss)."""
        admitted = await self.admit(identity, raw_key, ctx, Operation.EXISTS, budget)
        if isinstance(admitted, Denied):
            return False
        who = admitted.who
        entry, decision = await self._readable(who, admitted.decision, Operation.EXISTS, budget)
        found = entry is not None and await self.tiers.contains(who.digest)
        await self.recorder.record(
            op_event(
                EventKind.KV_EXISTS,
                who,
                outcome=Outcome.HIT if found else Outcome.MISS,
                decision_id=decision.decision_id if decision else None,
                policy_revision=decision.policy_revision if decision else None,
            ),
            durable=False,
        )
        return found

    async def remove(
        self,
        identity: Identity,
        raw_key: str,
        ctx: RequestContext,
        budget: DenialBudget | None = None,
    ) -> bool:
        """Remove the key if the requester may (a denial removes nothing)."""
        admitted = await self.admit(identity, raw_key, ctx, Operation.REMOVE, budget)
        if isinstance(admitted, Denied):
            return False
        who = admitted.who
        entry, _ = await self._readable(who, admitted.decision, Operation.REMOVE, budget)
        if entry is None:
            return False
        removed = await self.tiers.delete(who.digest)
        self.index.pop(who.digest)
        await self.recorder.record(
            entry_gone(op_event(EventKind.KV_DELETE, who, outcome=Outcome.OK), EntryState.DELETED),
            durable=True,
        )
        return bool(removed)

    # -- upkeep --------------------------------------------------------------------------------

    def tier_evicted(self, tier: str, digest: str, nbytes: int) -> None:
        """A tier dropped ``digest`` to make room (its ``on_evict`` hook, called on the loop):
        update the index and record ``kv:evict`` with the entry-index change. A put still
        being written (not indexed yet) has it noted instead, and recorded once it is
        (:meth:`store_put`): else its ``kv:put`` would list a tier that no longer holds it,
        with no ``kv:evict`` saying so."""
        plan = self._storing.get(digest)
        if plan is not None and plan.evicted is not None:
            plan.evicted.append(tier)
            return
        self._evicted(tier, digest)

    def _evicted(self, tier: str, digest: str) -> None:
        event = evicted(self.index, tier, digest)
        if event is not None:
            self.recorder.note(event, "dataplane.evict.unrecorded")

    async def recorded(self, timeout_s: float = 10.0) -> None:
        """Wait (at most ``timeout_s``) for the events being recorded in the background
        (denial summaries of closed connections, ...): before the ledger writer closes."""
        await self.recorder.recorded(timeout_s)

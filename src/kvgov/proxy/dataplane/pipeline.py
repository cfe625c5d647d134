"""The governed pipeline every KV operation goes through, whatever listener it came from.

decode (done by the listener) -> identity (key tags, request context, engine; users
pseudonymised) -> policy (cached fast path first) -> seal/open (segment by segment, into pooled
buffers) -> tier store (the policy's tiers and TTL) -> ledger event. Listeners reach it only
through a per-connection :class:`~kvgov.proxy.dataplane.door.Door`.

:meth:`Pipeline.admit` is identity and policy: ``Allowed | Denied``, a denial counted and
recorded here, once. A put (:meth:`Pipeline.put`) is admitted and planned before its bytes
arrive (a put of a key that is live or being stored is :class:`Kept`: acknowledged, its bytes
discarded): the listener receives each segment straight into the plan's buffer, which seals it
in place while the next segment is on the wire. :meth:`Pipeline.store_put` then writes the
tiers, makes the entry visible and queues its ``kv:put`` event; the door acks once that event
is durable. A put whose event cannot be recorded is removed from every tier again
(:meth:`Pipeline.unstore`): nothing stays stored unrecorded. A denied put stores nothing; a
denied get is a miss; every denial is a ``kv:entry:denied`` event. A put item whose metadata is
not one kvgov stores (:func:`~kvgov.wire.itemmeta.check_item_meta`) is refused the same way
(``bad_item_meta``). A get is :meth:`Pipeline.find` (a miss is recorded), :meth:`Pipeline.load`
and, once its bytes were handed to the socket, :meth:`Pipeline.served` (the ``kv:get``).

What a tier returns is checked before a hit is announced (:meth:`Pipeline.load`): the value's
envelope (:mod:`kvgov.keys.sealformat`: length and item metadata, bound into the sealed chunk's
AAD) and every segment are authenticated and opened into the hit's buffer first, so a value
edited, truncated, extended, flipped or moved at rest is a miss, never bytes on the wire; it is
dropped from the index and every tier, recorded (``kv:delete``, reason ``unreadable:<code>``)
and counted (``kvgov_dataplane_unreadable_total``). A tier's capacity eviction is a
``kv:evict`` event (:meth:`Pipeline.tier_evicted`). Denials are recorded one event each up to the
:class:`~kvgov.proxy.dataplane.limits.DenialGate`'s caps (per connection: the door's budget;
and per second); beyond them one summary event per connection and second says how many
were suppressed. The policy, the sealer (the keyring) and the event sink are always there; a
benchmark measuring "governance off" passes the named null ones
(:mod:`kvgov.proxy.dataplane.unsafe`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Executor, Future
from dataclasses import dataclass, replace
from typing import Any

from kvgov.connectors.tiers.base import copy_into
from kvgov.connectors.tiers.chain import TierChain
from kvgov.errors import (
    CorruptValueError,
    ItemMetaError,
    KvgovError,
    LedgerBackpressureError,
    ProtocolError,
)
from kvgov.keys import sealformat
from kvgov.keys.keyring import Keyring
from kvgov.keys.sealed import SealedHeader, SealReader, SealWriter, sealed_size, segment_count
from kvgov.ledger.events import Event, EventSink, LazyEventSink, QueuedEventSink
from kvgov.ledger.pseudonym import Pseudonymizer
from kvgov.policy.interfaces import Decision, PolicyEngine
from kvgov.proxy.dataplane.buffers import BufferPool, Lease, size_class
from kvgov.proxy.dataplane.identity import Denied, Identity, Who, build_input, resolve
from kvgov.proxy.dataplane.index import EntryIndex, EntryMeta
from kvgov.proxy.dataplane.limits import DenialBudget, DenialGate, Suppressed
from kvgov.proxy.dataplane.metrics import DataPlaneMetrics
from kvgov.proxy.dataplane.plans import (
    INLINE_CRYPTO_BYTES,
    Found,
    GetPlan,
    Kept,
    PutPlan,
    StoredPut,
    open_segments,
    segments_per_job,
)
from kvgov.proxy.dataplane.records import entry_gone, evict_event, put_event
from kvgov.proxy.dataplane.unsafe import NullEventSink, PlaintextSealer
from kvgov.types import EntryState, EventKind, Operation, Outcome, Scope
from kvgov.wire.itemmeta import check_item_meta
from kvgov.wire.messages import RequestContext

__all__ = ["Allowed", "Denied", "Found", "GetPlan", "Kept", "Pipeline", "PutPlan", "StoredPut"]

log = logging.getLogger("kvgov.dataplane")

#: a hit at least this large, opened on the event loop, is opened half there and half in the
#: crypto pool at once (see :meth:`Pipeline._open_all`)
SPLIT_OPEN_BYTES = 8 << 20


@dataclass(frozen=True, slots=True)
class Allowed:
    """An operation identity and policy admitted (:meth:`Pipeline.admit`)."""

    who: Who
    decision: Decision


class Pipeline:
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
        keyring: Keyring | PlaintextSealer,
        sink: EventSink,
        segment_size: int = 1 << 20,
        inline_crypto_bytes: int = INLINE_CRYPTO_BYTES,
        default_tenant: str | None = None,
        clock: Callable[[], float] = time.time,
        denial_gate: DenialGate | None = None,
    ) -> None:
        self.tiers = tiers
        self.pseudonymizer = pseudonymizer
        self.pool = pool
        self.executor = executor
        #: threads that write large replies (None: the crypto ``executor`` does)
        self.sender = sender if sender is not None else executor
        self.metrics = metrics
        self.index = index if index is not None else EntryIndex()
        self.policy = policy
        #: the keys values are sealed with (None only with the benchmarks' PlaintextSealer)
        self._keys: Keyring | None = keyring if isinstance(keyring, Keyring) else None
        self.sink = sink
        self.segment_size = segment_size
        #: chunks up to this size are sealed and opened on the event loop
        self.inline_crypto_bytes = inline_crypto_bytes
        self.default_tenant = default_tenant or None
        self.clock = clock
        #: caps on denials recorded one event each (None: every denial is recorded)
        self.denial_gate = denial_gate
        self._background: set[asyncio.Task[None]] = set()
        #: counter children looked up once (``labels()`` costs microseconds per call)
        self._put_bytes = metrics.op_bytes.labels("put")
        self._get_bytes = metrics.op_bytes.labels("get")
        #: digests of puts planned and not yet stored or dropped (a second put of one is kept)
        self._storing: set[str] = set()

    @property
    def keyring(self) -> Keyring | None:
        """The keyring, for the sidecar's key upkeep (None: values are not sealed)."""
        return self._keys

    @property
    def sink(self) -> EventSink:
        """Where events go."""
        return self._sink

    @sink.setter
    def sink(self, sink: EventSink) -> None:
        self._sink = sink
        # the sink when it can hold events back (an isinstance check against a runtime
        # Protocol walks its attributes: once here, not per event)
        self._lazy_sink = sink if isinstance(sink, LazyEventSink) else None
        self._queued_sink = sink if isinstance(sink, QueuedEventSink) else None

    # -- policy & ledger -----------------------------------------------------------------------

    @property
    def governed(self) -> bool:
        """No null collaborator stands in (policy, sealer, event sink)."""
        return (
            self._keys is not None
            and not isinstance(self._sink, NullEventSink)
            and self.policy.revision.policy != "unsafe-allow-all"
        )

    async def _decide(self, who: Who, op: Operation, entry: EntryMeta | None) -> Decision:
        inp = build_input(who, op, entry)
        decision = self.policy.decide_cached(inp)
        if decision is None:  # the policy engine records what it decides (CachingPolicyEngine)
            decision = await self.policy.decide(inp)
        return decision

    def _event(self, kind: EventKind, who: Who, **fields: Any) -> Event:
        return Event(
            kind=kind,
            tenant=who.tenant,
            actor=who.actor,
            request_id=who.ctx.request_id,
            key_digest=who.digest,
            principal=who.identity.principal,
            **fields,
        )

    async def _record(self, event: Event, *, durable: bool) -> None:
        if durable:
            await self.sink.append(event)
            return
        try:
            self._submit_lazy(event)
        except KvgovError:  # queue full: wait for room rather than drop the record
            await self.sink.append(event)

    def _submit_lazy(self, event: Event) -> None:
        """Queue an event nothing waits on (a sink that can may hold it back briefly to commit
        it with others; see ``ledger.lazy_max_delay_ms``)."""
        if self._lazy_sink is not None:
            self._lazy_sink.submit_lazy(event)
        else:
            self.sink.submit(event)

    async def deny(
        self, who: Who | None, denied: Denied, op: Operation, budget: DenialBudget | None
    ) -> None:
        """Count the denial and record it (one event, or held for ``budget``'s summary)."""
        reason = denied.metric_reason
        self.metrics.denials.labels(op.value, reason).inc()
        gate = self.denial_gate
        if gate is not None:
            if gate.flush_needed:
                self.record_suppressed(gate.due())
            if not gate.admit(budget, op.value, reason):
                self.metrics.denials_suppressed.labels(op.value).inc()
                return
        if who is None:
            event = Event(
                kind=EventKind.KV_DENIED,
                principal=denied.identity.principal,
                request_id=denied.ctx.request_id,
                outcome=Outcome.DENY,
                reason=denied.reason,
                attrs={"operation": op.value},
            )
        else:
            d = denied.decision
            event = self._event(
                EventKind.KV_DENIED,
                who,
                outcome=Outcome.DENY,
                reason=denied.reason,
                decision_id=d.decision_id if d else None,
                policy_revision=d.policy_revision if d else None,
                attrs={"operation": op.value},
            )
        try:
            await self._record(event, durable=op is Operation.PUT)
        except KvgovError as exc:  # still denied (nothing was stored); the connection lives on
            log.error("dataplane.denial.unrecorded", extra={"error": exc.code})

    def end_denials(self, budget: DenialBudget) -> None:
        """A connection closed: record the summary of what its budget still holds."""
        if self.denial_gate is not None:
            self.record_suppressed(self.denial_gate.due(final=(budget,)))

    def record_suppressed(self, summaries: list[Suppressed]) -> None:
        """One ``kv:denied`` event per summary (in the background: nothing waits on it)."""
        for s in summaries:
            self._record_soon(
                Event(
                    kind=EventKind.KV_DENIED,
                    principal=s.principal,
                    outcome=Outcome.DENY,
                    reason="suppressed",
                    attrs={
                        "suppressed": s.count,
                        "operations": dict(s.by_operation),
                        "reasons": dict(s.by_reason),
                    },
                )
            )

    async def admit(
        self,
        identity: Identity,
        raw_key: str,
        ctx: RequestContext,
        op: Operation,
        budget: DenialBudget | None = None,
    ) -> Allowed | Denied:
        """Who the operation is for (:func:`~kvgov.proxy.dataplane.identity.resolve`), then
        the policy's decision on the request. A denial is counted and recorded here, once."""
        who, denied = resolve(identity, raw_key, ctx, self.pseudonymizer, self.default_tenant)
        if denied is None and who is not None:
            decision = await self._decide(who, op, None)
            if decision.allowed:
                return Allowed(who, decision)
            denied = Denied(decision.reason or "denied", identity, ctx, decision)
        assert denied is not None  # resolve gives one or the other
        await self.deny(who, denied, op, budget)
        return denied

    # -- put -----------------------------------------------------------------------------------

    def lease_bound(self, length: int, item_meta: Mapping[str, Any] | None = None) -> int:
        """An upper bound on the pooled buffer a put of ``length`` bytes takes (its envelope
        head at its longest: item metadata is refused beyond that)."""
        del item_meta  # bounded by sealformat.MAX_HEAD_SIZE whatever it holds
        try:
            body = sealed_size(length, self.segment_size) if self._keys is not None else length
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
            await self.deny(admitted.who, planned, Operation.PUT, budget)
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
        kept = self._kept(who, decision)
        if kept is not None:
            if given is not None:
                given.release()
            return kept
        allowed = decision.tiers
        if not any(name in self.tiers.names for name in allowed):
            if given is not None:
                given.release()
            return Denied("no_allowed_tier", who.identity, who.ctx, decision)
        scope_user = who.key_user if decision.scope is Scope.USER else None
        keys = self._keys
        head = sealformat.encode_head(item_meta, length, sealed=keys is not None)
        body_len = sealed_size(length, self.segment_size) if keys is not None else length
        if given is None:
            lease = await self.pool.acquire(len(head) + body_len, who.identity.engine)
        else:
            lease = given.resize(len(head) + body_len)
        # the fastest tier's own buffer, when it can set one aside: sealed into, then kept
        reserved = self.tiers.reserve(len(head) + body_len, allowed=allowed)
        try:
            view = lease.view
            view[: len(head)] = head
            body = view[len(head) :]
            dst = body
            if reserved is not None:
                reserved.view[: len(head)] = head
                dst = reserved.view[len(head) :]
            make: Callable[[], SealWriter] | None = None
            windows: list[memoryview] = []
            if keys is not None:
                keyring = keys

                def make_writer() -> SealWriter:
                    return keyring.sealer(
                        who.tenant,
                        who.digest.encode(),
                        length,
                        dst,
                        user=scope_user,
                        segment_size=self.segment_size,
                        context=head,
                    )

                make = make_writer
                geometry = SealedHeader("", 0, self.segment_size, length, b"", b"")
                for i in range(geometry.segments):
                    off, _ = geometry.sealed_span(i)
                    _, plen = geometry.plain_span(i)
                    windows.append(body[off : off + plen])
            else:
                for i in range(segment_count(length, self.segment_size)):
                    start = i * self.segment_size
                    windows.append(body[start : min(length, start + self.segment_size)])
        except BaseException:
            if reserved is not None:
                reserved.cancel()
            lease.release()
            raise
        per_job = segments_per_job(self.segment_size)
        self._storing.add(who.digest)
        return PutPlan(
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
            on_done=self._storing.discard,
        )

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
        event = self._event(
            EventKind.KV_PUT_KEPT,
            who,
            outcome=Outcome.OK,
            reason=reason,
            decision_id=decision.decision_id if decision else None,
            policy_revision=decision.policy_revision if decision else None,
        )
        try:
            self._submit_lazy(event)
        except LedgerBackpressureError:
            self._record_soon(event)
        except KvgovError as exc:
            log.error("dataplane.event.unrecorded", extra={"error": exc.code})
        return Kept(who, reason)

    async def store_put(self, plan: PutPlan) -> StoredPut:
        """Finish sealing, write the tiers, make the entry visible and queue its ``kv:put``
        event. Raises (having stored nothing) on failure; releases the plan's buffer."""
        who, decision = plan.who, plan.decision
        try:
            await plan.sealed()
            now = self.clock()
            ttl = decision.ttl_s
            expires_at = now + ttl if ttl else None
            allowed = decision.tiers
            total = plan.body_offset + (
                plan.writer.sealed_len if plan.writer is not None else plan.length
            )
            reserved, plan.reserved = plan.reserved, None
            if reserved is None:
                written = await self.tiers.put(
                    who.digest, plan.lease.view[:total], allowed=allowed, expires_at=expires_at
                )
            else:
                if plan.writer is None:  # not sealed: the tier's copy is made here
                    start = plan.body_offset
                    copy_into(reserved.view[start:total], plan.lease.view[start:total])
                written = await self.tiers.put_reserved(
                    who.digest, reserved, allowed=allowed, expires_at=expires_at
                )
        finally:
            plan.abort()
        scope = decision.scope
        key = plan.writer.key if plan.writer is not None else None
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
            stored.recorded = await self._queue(
                put_event(self._event, who, decision, entry, written)
            )
        except BaseException:
            await self.unstore(stored)
            raise
        self._put_bytes.inc(plan.length)
        return stored

    async def _queue(self, event: Event) -> Awaitable[Any]:
        """Queue ``event``; returns what resolves once it is durable. A full queue is
        backpressure: wait here (in order) until the event is written."""
        try:
            if self._queued_sink is not None:  # acknowledged once journaled
                return self._queued_sink.submit_queued(event)
            return self.sink.submit(event)
        except LedgerBackpressureError:
            done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            done.set_result(await self.sink.append(event))
            return done

    async def unstore(self, stored: StoredPut) -> None:
        """Take an unrecorded put out of the index and every tier (unless it was replaced)."""
        log.warning("dataplane.put.unrecorded", extra={"key_digest": stored.digest})
        if self.index.get(stored.digest) is stored.entry:
            self.index.pop(stored.digest)
            await self.tiers.delete(stored.digest)

    def tier_evicted(self, tier: str, digest: str, nbytes: int) -> None:
        """A tier dropped ``digest`` to make room (its ``on_evict`` hook, called on the loop):
        update the index and record ``kv:evict`` with the entry-index change."""
        entry = self.index.get(digest)
        if entry is None or tier not in entry.tiers:
            return
        remaining = tuple(t for t in entry.tiers if t != tier)
        if remaining:
            self.index.set(digest, replace(entry, tiers=remaining))
        else:
            self.index.pop(digest)
        event = evict_event(digest, entry, tier, remaining)
        try:
            self._submit_lazy(event)
        except LedgerBackpressureError:  # record it as soon as there is room
            self._record_soon(event)
        except KvgovError as exc:
            log.error("dataplane.evict.unrecorded", extra={"error": exc.code})

    async def _record_later(self, event: Event) -> None:
        try:
            await self._record(event, durable=True)
        except KvgovError as exc:
            log.error("dataplane.event.unrecorded", extra={"error": exc.code})

    # -- get / exists / remove -----------------------------------------------------------------

    async def _readable(
        self, who: Who, asked: Decision | None, op: Operation, budget: DenialBudget | None
    ) -> tuple[EntryMeta | None, Decision | None]:
        """The entry if it is live, unexpired and readable by ``who``; records denials.

        The policy decided on the request (:meth:`admit`) before anything looks at whether
        the key is stored: a probe it denies (another tenant's key, an engine the tenant does
        not name) is answered, recorded and counted the same whether the key is there or not.
        An entry that is there is then judged again by what was recorded at put (its
        sensitivity and scope user), which only a requester the first decision admitted can
        reach."""
        entry = self.index.get(who.digest)
        if entry is None:
            return None, asked
        if entry.expired(self.clock()):
            return None, asked  # a miss; the sweeper deletes it and records that
        if entry.tenant != who.tenant:
            await self.deny(who, Denied("tenant_mismatch", who.identity, who.ctx), op, budget)
            return None, None
        if entry.scope is Scope.USER and entry.scope_user != who.actor:
            await self.deny(who, Denied("not_scope_user", who.identity, who.ctx), op, budget)
            return None, None
        decision = await self._decide(who, op, entry)
        if decision is not None and not decision.allowed:
            denied = Denied(decision.reason or "denied", who.identity, who.ctx, decision)
            await self.deny(who, denied, op, budget)
            return None, None
        return entry, decision

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
        await self._record(
            self._event(
                EventKind.KV_EXISTS,
                who,
                outcome=Outcome.HIT if found else Outcome.MISS,
                decision_id=decision.decision_id if decision else None,
                policy_revision=decision.policy_revision if decision else None,
            ),
            durable=False,
        )
        return found

    async def get(
        self,
        identity: Identity,
        raw_key: str,
        ctx: RequestContext,
        budget: DenialBudget | None = None,
    ) -> GetPlan | None:
        """A hit ready to stream (:meth:`find`, a buffer, :meth:`load`), or None: a miss."""
        found = await self.find(identity, raw_key, ctx, budget)
        if found is None:
            return None
        if size_class(found.size) > self.pool.owner_max_bytes:
            return await self.load(found, None)  # waiting for that much could wait for ever
        return await self.load(found, await self.pool.acquire(found.size, identity.engine))

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

    async def load(self, found: Found, lease: Lease | None) -> GetPlan | None:
        """A get's second step: read the value into ``lease`` (which the plan then owns; None:
        a miss) and authenticate every segment. A miss is recorded here; a hit once it was
        handed to the socket (:meth:`served`)."""
        plan, reason = (
            await self._load(found.who, found.entry, found.decision, lease)
            if lease is not None
            else (None, None)
        )
        if plan is None:
            await self._record_get(found.who, None, found.decision, reason)
        return plan

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
        await self._record(
            self._event(
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

    async def recorded(self, timeout_s: float = 10.0) -> None:
        """Wait (at most ``timeout_s``) for the events being recorded in the background
        (denial summaries of closed connections, ...): before the ledger writer closes."""
        if self._background:
            await asyncio.wait(list(self._background), timeout=timeout_s)

    def _record_soon(self, event: Event) -> None:
        task = asyncio.get_running_loop().create_task(self._record_later(event))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _load(
        self, who: Who, entry: EntryMeta, decision: Decision | None, lease: Lease
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
            envelope = sealformat.parse(value)
            if not envelope.sealed and self._keys is None:
                windows = [envelope.plain_body()]
            else:
                if self._keys is None:
                    raise ProtocolError("a sealed value needs the keyring to open")
                reader = envelope.reader(
                    self._keys, tenant=who.tenant, cache_key=who.digest.encode()
                )
                header = reader.header
                windows = []
                for i in range(header.segments):
                    if src is not None:  # opened from the tier's buffer into the lease
                        start, plen = header.plain_span(i)
                        windows.append(lease.view[start : start + plen])
                    else:  # opened in place in the lease
                        off, _ = header.sealed_span(i)
                        _, plen = header.plain_span(i)
                        windows.append(envelope.body[off : off + plen])
                # every segment authenticated before the hit is announced: a bad one is a miss
                await self._open_all(reader, windows, header.plain_len)
            if src is not None:
                src.release()
            plan = GetPlan(who, lease, envelope.plain_len, envelope.meta, windows, decision)
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

    async def _open_all(self, reader: SealReader, windows: list[memoryview], length: int) -> None:
        """Open every segment into its window: here up to ``inline_crypto_bytes``, else in the
        crypto pool, a few segments per job, side by side. Raises the first failure once no
        job touches the windows any more (a cancelled caller waits for them too)."""
        indexed = list(enumerate(windows))
        if length <= self.inline_crypto_bytes:
            if length < SPLIT_OPEN_BYTES or len(indexed) < 2:
                open_segments(reader, indexed)
                return
            # a large value: the pool opens its second half while this thread opens the first
            # (AES-GCM releases the GIL: two cores, half the wait before the hit is announced)
            half = len(indexed) // 2
            jobs = [self.executor.submit(open_segments, reader, indexed[half:])]
            try:
                open_segments(reader, indexed[:half])
            except BaseException:
                await self._settle_jobs(jobs)
                raise
        else:
            step = segments_per_job(reader.header.segment_size)
            jobs = [
                self.executor.submit(open_segments, reader, indexed[i : i + step])
                for i in range(0, len(indexed), step)
            ]
        await self._settle_jobs(jobs)

    async def _settle_jobs(self, jobs: list[Future[None]]) -> None:
        """Wait for every job (a cancelled caller waits for those started too); raise the
        first failure."""
        waiting = [asyncio.wrap_future(job) for job in jobs]
        try:
            await asyncio.wait(waiting)
        except asyncio.CancelledError:
            for job in jobs:
                job.cancel()  # those not started yet
            while not all(job.done() for job in jobs):
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait([f for f in waiting if not f.done()])
            raise
        finally:
            for f in waiting:
                if f.done() and not f.cancelled():
                    f.exception()  # retrieved: raised below from the job itself
        for job in jobs:
            job.result()

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
        event = self._event(
            EventKind.KV_DELETE,
            who,
            outcome=Outcome.ERROR,
            reason=f"unreadable:{error.code}",
            tier=tier,
        )
        try:
            await self._record(entry_gone(event, EntryState.DELETED), durable=True)
        except KvgovError as exc:
            log.error("dataplane.event.unrecorded", extra={"error": exc.code})

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
        await self._record(
            entry_gone(
                self._event(EventKind.KV_DELETE, who, outcome=Outcome.OK), EntryState.DELETED
            ),
            durable=True,
        )
        return bool(removed)

    async def expired(self) -> list[tuple[str, str | None]]:
        """The entries past their TTL that this process knows of (its index, and what its tiers
        just dropped themselves), with their tenants: the retention sweeper deletes, verifies
        and records them through the one deletion path."""
        now = self.clock()
        digests = set(self.index.expired(now))
        digests.update(await self.tiers.sweep(now))
        out = []
        for digest in sorted(digests):
            entry = self.index.get(digest)
            out.append((digest, entry.tenant if entry is not None else None))
        return out

    async def sweep(self) -> int:
        """Without a ledger (benchmarks): drop what is past its TTL, unrecorded."""
        due = await self.expired()
        for digest, _ in due:
            self.index.pop(digest)
            await self.tiers.delete(digest)
        return len(due)

"""The governed pipeline every KV operation goes through, whatever listener it came from.

decode (done by the listener) -> identity (key tags, request context, engine; users
pseudonymised) -> policy (cached fast path first) -> seal/open (segment by segment, in a small
thread pool, into pooled buffers) -> tier store (the policy's tiers and TTL) -> ledger event.

A put is planned before its bytes arrive (:meth:`Pipeline.plan_put`; a put of a key that is live
or being stored is :class:`Kept`: acknowledged, its bytes discarded): the listener receives
each segment straight into the plan's buffer and calls :meth:`PutPlan.segment_done`, which seals
it in place while the next segment is on the wire. :meth:`Pipeline.store_put` then writes the
tiers, makes the entry visible and queues its ``kv:put`` event; :meth:`Pipeline.settle_put`
waits for that event's group commit (a listener acks only then, and keeps reading meanwhile).
A put whose event cannot be recorded is removed from every tier again: nothing stays stored
unrecorded. A denied put stores nothing; a denied get is a miss; every denial is a
``kv:entry:denied`` event. A tier's capacity eviction is a ``kv:evict`` event
(:meth:`Pipeline.tier_evicted`). With ``governance=False`` policy, encryption and the ledger are
skipped (benchmarks only).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Executor
from dataclasses import replace
from typing import Any

from kvgov.connectors.tiers.base import copy_into
from kvgov.connectors.tiers.chain import TierChain
from kvgov.errors import KvgovError, LedgerBackpressureError, ProtocolError
from kvgov.keys.keyring import Keyring
from kvgov.keys.sealed import SealedHeader, SealWriter, sealed_size, segment_count
from kvgov.ledger.events import Event, EventSink, LazyEventSink, QueuedEventSink
from kvgov.ledger.pseudonym import Pseudonymizer
from kvgov.policy.interfaces import Decision, PolicyEngine
from kvgov.proxy.dataplane.buffers import BufferPool, Lease, size_class
from kvgov.proxy.dataplane.identity import Denied, Identity, Who, build_input, resolve
from kvgov.proxy.dataplane.index import EntryIndex, EntryMeta, envelope_head, parse_envelope
from kvgov.proxy.dataplane.metrics import DataPlaneMetrics
from kvgov.proxy.dataplane.plans import (
    INLINE_CRYPTO_BYTES,
    Found,
    GetPlan,
    Kept,
    PutPlan,
    StoredPut,
    segments_per_job,
)
from kvgov.proxy.dataplane.records import entry_gone, evict_event, put_event
from kvgov.types import EntryState, EventKind, Operation, Outcome, Scope
from kvgov.wire.messages import RequestContext

__all__ = ["Found", "GetPlan", "Kept", "Pipeline", "PutPlan", "StoredPut"]

log = logging.getLogger("kvgov.dataplane")

#: room for an envelope head (magic, length, the item's small metadata as JSON)
ENVELOPE_SLACK = 4096


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
        governance: bool = True,
        policy: PolicyEngine | None = None,
        keyring: Keyring | None = None,
        sink: EventSink | None = None,
        segment_size: int = 1 << 20,
        inline_crypto_bytes: int = INLINE_CRYPTO_BYTES,
        default_tenant: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if governance and (policy is None or keyring is None or sink is None):
            raise KvgovError("a governed pipeline needs policy, keyring and ledger sink")
        self.tiers = tiers
        self.pseudonymizer = pseudonymizer
        self.pool = pool
        self.executor = executor
        #: threads that write large replies (None: the crypto ``executor`` does)
        self.sender = sender if sender is not None else executor
        self.metrics = metrics
        self.index = index if index is not None else EntryIndex()
        self.governance = governance
        self.policy = policy
        self.keyring = keyring
        self.sink = sink
        self.segment_size = segment_size
        #: chunks up to this size are sealed and opened on the event loop
        self.inline_crypto_bytes = inline_crypto_bytes
        self.default_tenant = default_tenant or None
        self.clock = clock
        self._background: set[asyncio.Task[None]] = set()
        #: digests of puts planned and not yet stored or dropped (a second put of one is kept)
        self._storing: set[str] = set()

    @property
    def sink(self) -> EventSink | None:
        """Where events go (None: nowhere, ungoverned)."""
        return self._sink

    @sink.setter
    def sink(self, sink: EventSink | None) -> None:
        self._sink = sink
        # the sink when it can hold events back (an isinstance check against a runtime
        # Protocol walks its attributes: once here, not per event)
        self._lazy_sink = sink if isinstance(sink, LazyEventSink) else None
        self._queued_sink = sink if isinstance(sink, QueuedEventSink) else None

    # -- policy & ledger -----------------------------------------------------------------------

    async def _decide(self, who: Who, op: Operation, entry: EntryMeta | None) -> Decision | None:
        if not self.governance or self.policy is None:
            return None
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
        if not self.governance or self.sink is None:
            return
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
        elif self.sink is not None:
            self.sink.submit(event)

    async def deny(self, who: Who | None, denied: Denied, op: Operation) -> None:
        self.metrics.denials.labels(op.value, denied.metric_reason).inc()
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

    def identify(
        self, identity: Identity, raw_key: str, ctx: RequestContext
    ) -> tuple[Who | None, Denied | None]:
        return resolve(identity, raw_key, ctx, self.pseudonymizer, self.default_tenant)

    # -- put -----------------------------------------------------------------------------------

    def lease_bound(self, length: int, item_meta: Mapping[str, Any] | None = None) -> int:
        """An upper bound on the pooled buffer a put of ``length`` bytes takes (exact for its
        envelope head when ``item_meta`` is given)."""
        try:
            body = sealed_size(length, self.segment_size) if self.governance else length
        except ValueError:  # beyond what one sealed chunk can hold
            return 1 << 62
        if item_meta is None:
            return size_class(body + ENVELOPE_SLACK)
        return size_class(body + len(envelope_head({**item_meta, "_n": length, "_sealed": False})))

    async def plan_put(
        self, who: Who, length: int, item_meta: Mapping[str, Any], lease: Lease | None = None
    ) -> PutPlan | Denied | Kept:
        """Decide, then lay out where the put's bytes go. ``lease``: a buffer taken for it in
        advance (at least :meth:`lease_bound`; the plan owns it from here, denied or not)."""
        try:
            return await self._plan_put(who, length, item_meta, lease)
        except BaseException:
            if lease is not None:
                lease.release()
            raise

    async def _plan_put(
        self, who: Who, length: int, item_meta: Mapping[str, Any], given: Lease | None
    ) -> PutPlan | Denied | Kept:
        decision = await self._decide(who, Operation.PUT, None)
        if decision is not None and not decision.allowed:
            if given is not None:
                given.release()
            return Denied(decision.reason or "denied", who.identity, who.ctx, decision)
        kept = self._kept(who, decision)
        if kept is not None:
            if given is not None:
                given.release()
            return kept
        allowed = decision.tiers if decision is not None else self.tiers.names
        if not any(name in self.tiers.names for name in allowed):
            if given is not None:
                given.release()
            return Denied("no_allowed_tier", who.identity, who.ctx, decision)
        scope_user = who.key_user if decision is not None and decision.scope is Scope.USER else None
        governed = decision is not None and self.keyring is not None
        head = envelope_head({**item_meta, "_n": length, "_sealed": governed})
        body_len = sealed_size(length, self.segment_size) if governed else length
        if given is None:
            lease = await self.pool.acquire(len(head) + body_len)
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
            if governed and self.keyring is not None:
                keyring = self.keyring

                def make_writer() -> SealWriter:
                    return keyring.sealer(
                        who.tenant,
                        who.digest.encode(),
                        length,
                        dst,
                        user=scope_user,
                        segment_size=self.segment_size,
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
        if self.governance:
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
            ttl = decision.ttl_s if decision is not None else None
            expires_at = now + ttl if ttl else None
            allowed = decision.tiers if decision is not None else self.tiers.names
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
        scope = decision.scope if decision is not None else None
        key = plan.writer.key if plan.writer is not None else None
        sensitivity = (decision.sensitivity if decision else None) or who.ctx.sensitivity
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
        if self.governance and decision is not None:
            try:
                stored.recorded = await self._queue(
                    put_event(self._event, who, decision, entry, written)
                )
            except BaseException:
                await self._unstore(stored)
                raise
        self.metrics.op_bytes.labels("put").inc(plan.length)
        return stored

    async def settle_put(self, stored: StoredPut) -> None:
        """Wait until the put's ledger event is durable. If it cannot be recorded, the value is
        removed from every tier (no stored-but-unrecorded data) and the error is raised."""
        if stored.recorded is None:
            return
        try:
            await asyncio.shield(stored.recorded)
        except asyncio.CancelledError:
            raise  # the event may still commit: leave the entry to its record
        except BaseException:
            await self._unstore(stored)
            raise

    async def _queue(self, event: Event) -> Awaitable[Any]:
        """Queue ``event``; returns what resolves once it is durable. A full queue is
        backpressure: wait here (in order) until the event is written."""
        if self.sink is None:
            raise KvgovError("no ledger sink")
        try:
            if self._queued_sink is not None:  # acknowledged once journaled
                return self._queued_sink.submit_queued(event)
            return self.sink.submit(event)
        except LedgerBackpressureError:
            done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            done.set_result(await self.sink.append(event))
            return done

    async def _unstore(self, stored: StoredPut) -> None:
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
        if not self.governance or self.sink is None:
            return
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

    async def _readable(self, who: Who, op: Operation) -> tuple[EntryMeta | None, Decision | None]:
        """The entry if it is live, unexpired and readable by ``who``; records denials.

        The policy decides on the request before anything looks at whether the key is
        stored: a probe it denies (another tenant's key, an engine the tenant does not name)
        is answered, recorded and counted the same whether the key is there or not. An entry
        that is there is then judged again by what was recorded at put (its sensitivity and
        scope user), which only a requester the first decision admitted can reach."""
        asked = await self._decide(who, op, None)
        if asked is not None and not asked.allowed:
            await self.deny(who, Denied(asked.reason or "denied", who.identity, who.ctx, asked), op)
            return None, None
        entry = self.index.get(who.digest)
        if entry is None:
            return None, asked
        if entry.expired(self.clock()):
            return None, asked  # a miss; the sweeper deletes it and records that
        if entry.tenant != who.tenant:
            await self.deny(who, Denied("tenant_mismatch", who.identity, who.ctx), op)
            return None, None
        if entry.scope is Scope.USER and entry.scope_user != who.actor:
            await self.deny(who, Denied("not_scope_user", who.identity, who.ctx), op)
            return None, None
        decision = await self._decide(who, op, entry)
        if decision is not None and not decision.allowed:
            denied = Denied(decision.reason or "denied", who.identity, who.ctx, decision)
            await self.deny(who, denied, op)
            return None, None
        return entry, decision

    async def exists(self, who: Who) -> bool:
        entry, decision = await self._readable(who, Operation.EXISTS)
        found = entry is not None and await self.tiers.contains(who.digest)
        if self.governance:
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

    async def get(self, who: Who, *, max_lease: int | None = None) -> GetPlan | None:
        """A hit ready to stream, or None. A value whose buffer would exceed ``max_lease``
        bytes (what the caller's frame may still hold of the pool) is a miss."""
        found = await self.find(who)
        if found is None:
            return None
        limit = self.pool.max_bytes if max_lease is None else min(max_lease, self.pool.max_bytes)
        if size_class(found.size) > limit:
            return await self.load(found, None)  # waiting for that much could wait for ever
        return await self.load(found, await self.pool.acquire(found.size))

    async def find(self, who: Who) -> Found | None:
        """A get's first step: the readable entry and its stored size, or None (a miss, now
        recorded). :meth:`load` with a buffer of ``size`` bytes finishes it."""
        entry, decision = await self._readable(who, Operation.GET)
        size = await self.tiers.size_of(who.digest) if entry is not None else None
        if entry is None or size is None:
            await self._record_get(who, None, decision)
            return None
        return Found(who, entry, decision, size)

    async def load(self, found: Found, lease: Lease | None) -> GetPlan | None:
        """A get's second step: read the value into ``lease`` (which the plan then owns; None:
        a miss) and record the hit or miss."""
        plan, reason = (
            await self._load(found.who, found.entry, lease) if lease is not None else (None, None)
        )
        await self._record_get(found.who, plan, found.decision, reason)
        if plan is not None:
            self.metrics.op_bytes.labels("get").inc(plan.length)
        return plan

    async def _record_get(
        self,
        who: Who,
        plan: GetPlan | None,
        decision: Decision | None,
        reason: str | None = None,
    ) -> None:
        if not self.governance:
            return
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

    def _record_soon(self, event: Event) -> None:
        task = asyncio.get_running_loop().create_task(self._record_later(event))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _load(
        self, who: Who, entry: EntryMeta, lease: Lease
    ) -> tuple[GetPlan | None, str | None]:
        """The plan, or None and why the stored value could not be read (None: not there)."""
        src = self.tiers.borrow(who.digest)  # read in place: no copy into the lease
        try:
            if src is not None:
                value = src.view
            else:
                hit = await self.tiers.get_into(who.digest, lease.view, allowed=entry.tiers)
                if hit is None:
                    lease.release()
                    return None, None
                value = lease.view[: hit.nbytes]
            meta, offset = parse_envelope(value)
            length = int(meta.pop("_n"))
            sealed = bool(meta.pop("_sealed"))
            body = value[offset:]
            if not sealed:
                if self.governance:
                    raise ProtocolError("a governed sidecar found a plaintext value")
                windows = [body[:length]]
                return GetPlan(who, lease, length, meta, None, windows, src), None
            if self.keyring is None:
                raise ProtocolError("a sealed value needs the keyring to open")
            reader = self.keyring.reader(body, tenant=who.tenant, cache_key=who.digest.encode())
            header = reader.header
            windows = []
            for i in range(header.segments):
                if src is not None:  # opened from the tier's buffer into the lease
                    start, plen = header.plain_span(i)
                    windows.append(lease.view[start : start + plen])
                else:  # opened in place in the lease
                    off, _ = header.sealed_span(i)
                    _, plen = header.plain_span(i)
                    windows.append(body[off : off + plen])
            return GetPlan(who, lease, length, meta, reader, windows, src), None
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

    async def drop_unreadable(self, who: Who, error: KvgovError) -> None:
        """A hit failed to open while it was being sent (its ciphertext was corrupted or
        tampered with at rest, or its key was shredded meanwhile): it can never be served, so
        remove it from the index and every tier and record why. The caller closes the
        connection (the reply had promised its bytes; each segment is authenticated before any
        of its bytes go out, so nothing unauthenticated was sent). A put of the same key racing
        this is removed too: KV cache is recomputable."""
        log.warning(
            "dataplane.get.unreadable", extra={"key_digest": who.digest, "error": error.code}
        )
        self.index.pop(who.digest)
        await self.tiers.delete(who.digest)
        if self.governance:
            event = self._event(
                EventKind.KV_DELETE, who, outcome=Outcome.ERROR, reason=f"unreadable:{error.code}"
            )
            try:
                await self._record(entry_gone(event, EntryState.DELETED), durable=True)
            except KvgovError as exc:
                log.error("dataplane.event.unrecorded", extra={"error": exc.code})

    async def remove(self, who: Who) -> bool:
        entry, _ = await self._readable(who, Operation.REMOVE)
        if entry is None:
            return False
        removed = await self.tiers.delete(who.digest)
        self.index.pop(who.digest)
        if self.governance:
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

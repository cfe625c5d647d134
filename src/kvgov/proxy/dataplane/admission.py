"""Whether an operation may go on: identity, then the policy; a denial counted and recorded once.

:meth:`Admission.admit` is who the operation is for
(:func:`~kvgov.proxy.dataplane.identity.resolve`: key tags vs engine and request context, users
pseudonymised) and the policy's decision on the request (its cached fast path first):
``Allowed | Denied``. The policy decides on the request before anything looks at whether the
key is stored; an entry that is there is judged again by what was recorded at put
(:meth:`Admission.readable`). Every denial is counted and recorded (:meth:`Admission.deny`:
a ``kv:entry:denied`` event, durable for a put) up to the
:class:`~kvgov.proxy.dataplane.limits.DenialGate`'s caps (per connection: its
:class:`~kvgov.proxy.dataplane.limits.DenialBudget`; and per second); beyond them one summary
event per connection and second says how many were suppressed (:meth:`Admission.end_denials`,
:meth:`Admission.record_suppressed`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvgov.errors import KvgovError
from kvgov.ledger.events import Event
from kvgov.ledger.pseudonym import Pseudonymizer
from kvgov.policy.cache import CachingPolicyEngine
from kvgov.policy.interfaces import Decision, PolicyEngine, PolicyInput
from kvgov.proxy.dataplane.identity import Denied, Identity, Who, build_input, resolve
from kvgov.proxy.dataplane.index import EntryMeta
from kvgov.proxy.dataplane.limits import DenialBudget, DenialGate, Suppressed
from kvgov.proxy.dataplane.metrics import DataPlaneMetrics
from kvgov.proxy.dataplane.records import Recorder, op_event
from kvgov.types import EventKind, Operation, Outcome, Scope
from kvgov.wire.messages import RequestContext

__all__ = ["Admission", "Allowed", "Denied"]

log = logging.getLogger("kvgov.dataplane")


@dataclass(frozen=True, slots=True)
class Allowed:
    """An operation identity and policy admitted (:meth:`Admission.admit`)."""

    who: Who
    decision: Decision


class Admission:
    """Identity and policy for every operation, and the record of every denial."""

    def __init__(
        self,
        *,
        pseudonymizer: Pseudonymizer,
        policy: PolicyEngine,
        metrics: DataPlaneMetrics,
        recorder: Recorder,
        default_tenant: str | None = None,
        denial_gate: DenialGate | None = None,
    ) -> None:
        self.pseudonymizer = pseudonymizer
        self.policy = policy
        self.metrics = metrics
        self.recorder = recorder
        self.default_tenant = default_tenant or None
        #: caps on denials recorded one event each (None: every denial is recorded)
        self.denial_gate = denial_gate

    @property
    def policy(self) -> PolicyEngine:
        """Who decides."""
        return self._policy

    @policy.setter
    def policy(self, policy: PolicyEngine) -> None:
        self._policy = policy
        #: its decision cache, asked by the input's fields on every operation (:meth:`_decide`)
        self._cache = policy if isinstance(policy, CachingPolicyEngine) else None

    async def may_act_for(self, engine: str, tenant: str) -> bool:
        """Whether the policy lets ``engine`` act for ``tenant`` at all (a remove of one of
        its keys over the kvgov wire: tenant and engine rules, no data rules): whom an EVICT
        for ``tenant`` may reach."""
        inp = PolicyInput(
            operation=Operation.REMOVE,
            tenant=tenant,
            engine=engine,
            key_tenant=tenant,
            listener="kvgov",
        )
        decision = self.policy.decide_cached(inp) or await self.policy.decide(inp)
        return decision.allowed

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

    async def _decide(self, who: Who, op: Operation, entry: EntryMeta | None) -> Decision:
        cache = self._cache
        if cache is not None:  # a hit builds no PolicyInput: the cache is asked by its fields
            ctx, identity = who.ctx, who.identity
            decision = cache.decide_cached_as(
                operation=op,
                tenant=ctx.tenant or who.tenant,
                engine=identity.engine,
                key_tenant=who.tenant,
                key_user=who.key_user,
                model=who.key.model,
                actor_user=who.actor,
                request_id=ctx.request_id,
                sensitivity=ctx.sensitivity,
                entry=None if entry is None else (entry.owner, entry.scope_user, entry.sensitivity),
                listener=identity.listener,
            )
            if decision is not None:
                return decision
        inp = build_input(who, op, entry)  # (the same fields: tests/unit/test_policy_cache.py)
        decision = self.policy.decide_cached(inp) if cache is None else None
        if decision is None:  # the policy engine records what it decides (CachingPolicyEngine)
            decision = await self.policy.decide(inp)
        return decision

    async def readable(
        self, who: Who, entry: EntryMeta, op: Operation, budget: DenialBudget | None
    ) -> Decision | None:
        """The decision that lets ``who`` read the live ``entry``, or None: denied (recorded).

        The policy decided on the request (:meth:`admit`) before anything looked at whether
        the key is stored: a probe it denies (another tenant's key, an engine the tenant does
        not name) is answered, recorded and counted the same whether the key is there or not.
        An entry that is there is then judged again by what was recorded at put (its
        sensitivity and scope user), which only a requester the first decision admitted can
        reach."""
        if entry.tenant != who.tenant:
            await self.deny(who, Denied("tenant_mismatch", who.identity, who.ctx), op, budget)
            return None
        if entry.scope is Scope.USER and entry.scope_user != who.actor:
            await self.deny(who, Denied("not_scope_user", who.identity, who.ctx), op, budget)
            return None
        decision = await self._decide(who, op, entry)
        if decision is not None and not decision.allowed:
            denied = Denied(decision.reason or "denied", who.identity, who.ctx, decision)
            await self.deny(who, denied, op, budget)
            return None
        return decision

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
            event = op_event(
                EventKind.KV_DENIED,
                who,
                outcome=Outcome.DENY,
                reason=denied.reason,
                decision_id=d.decision_id if d else None,
                policy_revision=d.policy_revision if d else None,
                attrs={"operation": op.value},
            )
        try:
            await self.recorder.record(event, durable=op is Operation.PUT)
        except KvgovError as exc:  # still denied (nothing was stored); the connection lives on
            log.error("dataplane.denial.unrecorded", extra={"error": exc.code})

    def end_denials(self, budget: DenialBudget) -> None:
        """A connection closed: record the summary of what its budget still holds."""
        if self.denial_gate is not None:
            self.record_suppressed(self.denial_gate.due(final=(budget,)))

    def record_suppressed(self, summaries: list[Suppressed]) -> None:
        """One ``kv:denied`` event per summary (in the background: nothing waits on it)."""
        for s in summaries:
            self.recorder.soon(
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

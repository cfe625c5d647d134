"""The decision cache and the recording rule, wrapped around any engine.

Cache: keyed by (policy revision, data revision, input). There is one table per revision
pair: :meth:`CachingPolicyEngine.reload` swaps in an empty one, so an answer given under old
policies is never served under new ones. Within a table the key is the tuple of the
:class:`PolicyInput`'s fields (:meth:`PolicyInput.cache_key`: equal exactly when the input
digests are equal), so a hit costs one tuple and one dict lookup, no copy of the input and no
serialisation: that is what keeps :meth:`decide_cached` in the microseconds.
Bounded (LRU); ``max_entries=0`` disables caching.

The request id is not part of the cache key by default: a decision may depend on whether a
request id is present (the shipped policy checks its type), never on its value — otherwise every
request would miss the cache and record a fresh "first allow", one ledger row per request.
Operators whose own policies do read the value set ``vary_on_request_id=True``.

Recording: every deny, and the first allow of each distinct decision (per revision + input
digest), go to the :class:`DecisionRecorder`. Cached allows are therefore never recorded
again; cached denies are never served by :meth:`decide_cached` and each gets its own decision
id and record. An allow the recorder cannot take becomes a deny (``decision_not_recorded``):
nothing is cached without the policy revision that allowed it being on record.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace

from kvgov.errors import KvgovError
from kvgov.logging import get_logger
from kvgov.policy.interfaces import (
    Decision,
    DecisionRecorder,
    DenyReason,
    PolicyEngine,
    PolicyInput,
    PolicyRevision,
    new_decision_id,
)

log = get_logger(__name__)

_Table = OrderedDict[tuple[object, ...], Decision]

#: what a request id becomes in the cache key (see the module docstring)
_PRESENT = "\x00present"


class CachingPolicyEngine:
    """A :class:`PolicyEngine` that caches another one's answers and records decisions."""

    def __init__(
        self,
        inner: PolicyEngine,
        *,
        recorder: DecisionRecorder | None = None,
        max_entries: int = 65_536,
        vary_on_request_id: bool = False,
    ) -> None:
        self.inner = inner
        self.recorder = recorder
        self.max_entries = max_entries
        self.vary_on_request_id = vary_on_request_id
        self._table: _Table = OrderedDict()
        self._table_revision = inner.revision
        self.hits = 0
        self.misses = 0

    @property
    def revision(self) -> PolicyRevision:
        return self.inner.revision

    def __len__(self) -> int:
        return len(self._table)

    def _cache_key(self, inp: PolicyInput) -> tuple[object, ...]:
        """The input as the cache sees it: the request id reduced to present/absent."""
        rid = inp.request_id
        if rid is not None and not self.vary_on_request_id:
            rid = _PRESENT
        return inp.cache_key(rid)

    def decide_cached(self, inp: PolicyInput) -> Decision | None:
        """A cached allow for this input, else None. Synchronous, no serialisation on a hit."""
        table = self._table
        key = self._cache_key(inp)
        try:
            decision = table.get(key)
        except TypeError:  # an unhashable field: not a valid input; decide() denies it
            return None
        if decision is None or not decision.allowed:
            return None
        table.move_to_end(key)
        self.hits += 1
        return decision

    async def decide(self, inp: PolicyInput) -> Decision:
        if self.inner.revision != self._table_revision:  # the inner engine was reloaded
            self.clear()
        table = self._table
        try:
            cached = table.get(self._cache_key(inp))
        except TypeError:
            cached, table = None, OrderedDict()  # evaluate (and deny), cache nothing
        if cached is not None:
            self.hits += 1
            if cached.allowed:
                table.move_to_end(self._cache_key(inp))
                return cached
            deny = replace(cached, decision_id=new_decision_id())
            await self._record(inp, deny)
            return deny
        self.misses += 1
        decision = await self.inner.decide(inp)
        if not await self._record(inp, decision) and decision.allowed:
            return Decision.deny(
                DenyReason.NOT_RECORDED,
                revision=PolicyRevision(decision.policy_revision, decision.data_revision),
                input_digest=decision.input_digest,
                operation=decision.operation,
            )
        if self.max_entries > 0 and table is self._table:
            try:
                table[self._cache_key(inp)] = replace(decision, cached=True)
            except TypeError:
                return decision
            if len(table) > self.max_entries:
                table.popitem(last=False)
        return decision

    async def _record(self, inp: PolicyInput, decision: Decision) -> bool:
        if self.recorder is None:
            return True
        try:
            await self.recorder.record(inp, decision)
        except KvgovError as exc:
            log.error(
                "policy.decision_not_recorded",
                extra={
                    "decision_id": decision.decision_id,
                    "allowed": decision.allowed,
                    "error": exc.code,
                },
            )
            return False
        return True

    def clear(self) -> None:
        """Forget every cached decision (a fresh table for the current revision)."""
        self._table = OrderedDict()
        self._table_revision = self.inner.revision

    async def reload(self) -> PolicyRevision:
        revision = await self.inner.reload()
        self.clear()
        return revision

    async def aclose(self) -> None:
        await self.inner.aclose()

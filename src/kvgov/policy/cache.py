"""The decision cache and the recording rule, wrapped around any engine.

Cache: keyed by (policy revision, data revision, input). There is one table per revision
pair: :meth:`CachingPolicyEngine.reload` swaps in an empty one, so an answer given under old
policies is never served under new ones. Within a table the key is the tuple of the
:class:`PolicyInput`'s fields (:meth:`PolicyInput.cache_key`: equal exactly when the input
digests are equal), so a hit costs one tuple and one dict lookup, no copy of the input and no
serialisation: that is what keeps :meth:`decide_cached` in the microseconds. The data plane
asks :meth:`CachingPolicyEngine.decide_cached_as` with the fields themselves, the same tuple
made without building the input at all (an entry's facts key as a plain tuple).
Bounded (LRU); ``max_entries=0`` disables caching.

Age. With ``decision_ttl_s`` (``policy.opa_decision_ttl_s``, set for ``policy.engine=opa`` only)
no cached decision is served once that many seconds passed since the engine was asked for it:
OPA's authority is its own bundle, which can change (an engine revoked from a tenant) without
kvgov's revision changing, so the revision-keyed tables alone would serve the old allows until
the next reload or restart. Each entry carries its deadline on a monotonic clock; a lookup reads
the clock once (tens of nanoseconds) and only when the entry has a deadline. The embedded engine
needs none: its policy *is* the sources the follower (:mod:`kvgov.policy.watch`) reloads, and a
reload empties the cache. Denials age the same way (a stale deny fails closed, and a newly
admitted engine gets in within the TTL); a deny that says the engine *failed* (OPA timed out,
refused, answered garbage; the embedded engine raised) is never cached: it describes the
engine's health, not the policy, and caching it would stretch a passing fault across the TTL
(or, without one, to the next reload).

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

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace

from kvgov.errors import KvgovError
from kvgov.logging import get_logger
from kvgov.policy.interfaces import (
    Decision,
    DecisionRecorder,
    DenyReason,
    EntryKey,
    PolicyEngine,
    PolicyInput,
    PolicyRevision,
    new_decision_id,
)
from kvgov.types import Operation, Sensitivity

log = get_logger(__name__)

#: a cached decision and its deadline on the engine's clock (None: served until a reload)
_Entry = tuple[Decision, float | None]
_Table = OrderedDict[tuple[object, ...], _Entry]

#: what a request id becomes in the cache key (see the module docstring)
_PRESENT = "\x00present"

#: first reasons of denies that report an engine failure, not a policy answer: never cached
_FAILURES = frozenset(
    {
        DenyReason.OPA_TIMEOUT,
        DenyReason.OPA_UNAVAILABLE,
        DenyReason.OPA_UNTRUSTED,  # OPA's socket served by another uid: OPA's state, too
        DenyReason.OPA_INVALID_REPLY,
        DenyReason.OPA_TOKEN_INVALID,  # kvgov's own token file, being fixed: not the policy's
        # no result at all: OPA has no policy active yet (its bundle still loading) or is asked
        # at the wrong path; its state, not the policy's answer (review s11)
        DenyReason.OPA_UNDEFINED,
        DenyReason.POLICY_ERROR,
    }
)
_BAD_STATUS = f"{DenyReason.OPA_BAD_STATUS}:"


async def _outcome(flight: asyncio.Future[Decision]) -> Decision | None:
    """The answer another caller's question got, or None when it got none (it failed or was
    cancelled: ask the engine yourself). Cancelling the waiter leaves the question running."""
    try:
        return await asyncio.shield(flight)
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # the waiter itself was cancelled
        return None


def _engine_failed(decision: Decision) -> bool:
    reason = decision.reason
    return reason is not None and (reason in _FAILURES or reason.startswith(_BAD_STATUS))


class CachingPolicyEngine:
    """A :class:`PolicyEngine` that caches another one's answers and records decisions."""

    def __init__(
        self,
        inner: PolicyEngine,
        *,
        recorder: DecisionRecorder | None = None,
        max_entries: int = 65_536,
        vary_on_request_id: bool = False,
        decision_ttl_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``decision_ttl_s``: the longest a cached decision is served, in seconds of ``clock``
        (monotonic); None: until the next reload (engines whose sources the follower watches)."""
        if decision_ttl_s is not None and not decision_ttl_s > 0:
            raise ValueError(f"decision_ttl_s must be > 0 seconds, got {decision_ttl_s!r}")
        self.inner = inner
        self.recorder = recorder
        self.max_entries = max_entries
        self.vary_on_request_id = vary_on_request_id
        self.decision_ttl_s = decision_ttl_s
        self._clock = clock
        self._table: _Table = OrderedDict()
        self._table_revision = inner.revision
        #: inputs the inner engine is being asked about now (by cache key): whoever misses on
        #: the same input meanwhile awaits that answer instead of asking again (one question,
        #: one recorded decision, when a hot input's entry expires or after a reload)
        self._flights: dict[tuple[object, ...], asyncio.Future[Decision]] = {}
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
        """A cached allow for this input, else None. Synchronous, no serialisation on a hit;
        one clock read when the entry can expire."""
        return self._cached_allow(self._cache_key(inp))

    def decide_cached_as(
        self,
        *,
        operation: Operation | str,
        tenant: str | None,
        engine: str | None,
        key_tenant: str | None,
        key_user: str | None,
        model: str | None,
        actor_user: str | None,
        request_id: str | None,
        sensitivity: Sensitivity | str | None,
        entry: EntryKey | None,
        listener: str | None,
    ) -> Decision | None:
        """:meth:`decide_cached` for the input with these fields (no ``tier``, no
        ``problems``), without building it: the data plane asks this on every operation, and
        on a hit the :class:`PolicyInput` would only be built to make its key. The key is the
        tuple :meth:`PolicyInput.cache_key` makes of such an input (the same rule for the
        request id), so this hits exactly where :meth:`decide_cached` would."""
        if request_id is not None and not self.vary_on_request_id:
            request_id = _PRESENT
        key = (
            operation,
            tenant,
            engine,
            key_tenant,
            key_user,
            model,
            actor_user,
            request_id,
            sensitivity,
            None,
            entry,
            listener,
            (),
        )
        return self._cached_allow(key)

    def _cached_allow(self, key: tuple[object, ...]) -> Decision | None:
        """The allow cached under ``key`` and still fresh, else None."""
        table = self._table
        try:
            entry = table.get(key)
        except TypeError:  # an unhashable field: not a valid input; decide() denies it
            return None
        if entry is None:
            return None
        decision, deadline = entry
        if not decision.allowed or (deadline is not None and self._clock() >= deadline):
            return None  # decide() asks again (and drops the expired entry)
        table.move_to_end(key)
        self.hits += 1
        return decision

    async def decide(self, inp: PolicyInput) -> Decision:
        if self.inner.revision != self._table_revision:  # the inner engine was reloaded
            self.clear()
        table = self._table
        key = self._cache_key(inp)
        try:
            entry = table.get(key)
        except TypeError:
            entry, table = None, OrderedDict()  # evaluate (and deny), cache nothing
        if entry is not None:
            cached, deadline = entry
            if deadline is not None and self._clock() >= deadline:
                del table[key]  # too old: ask the engine again
            elif cached.allowed:
                self.hits += 1
                table.move_to_end(key)
                return cached
            else:
                self.hits += 1
                deny = replace(cached, decision_id=new_decision_id())
                await self._record(inp, deny)
                return deny
        self.misses += 1
        if table is not self._table:  # an unhashable input: nothing to share or cache
            return await self._ask(inp, key, table)
        flight = self._flights.get(key)
        if flight is not None:  # the engine is being asked this already: share its answer
            shared = await _outcome(flight)
            if shared is not None:
                if shared.allowed:
                    return shared
                deny = replace(shared, decision_id=new_decision_id())
                await self._record(inp, deny)
                return deny
        flight = asyncio.get_running_loop().create_future()
        flights = self._flights
        flights[key] = flight
        try:
            decision = await self._ask(inp, key, table)
        except BaseException:
            flight.cancel()  # those waiting on it ask the engine themselves
            raise
        finally:
            if flights.get(key) is flight:
                del flights[key]
        flight.set_result(decision)
        return decision

    async def _ask(self, inp: PolicyInput, key: tuple[object, ...], table: _Table) -> Decision:
        """Ask the inner engine, record its answer, and cache it in ``table`` (the current
        one: not for an unhashable input)."""
        ttl = self.decision_ttl_s
        # the age counts from the question: the answer may reflect the engine's state then
        deadline = None if ttl is None else self._clock() + ttl
        decision = await self.inner.decide(inp)
        if not await self._record(inp, decision) and decision.allowed:
            return Decision.deny(
                DenyReason.NOT_RECORDED,
                revision=PolicyRevision(decision.policy_revision, decision.data_revision),
                input_digest=decision.input_digest,
                operation=decision.operation,
            )
        if self.max_entries > 0 and table is self._table and not _engine_failed(decision):
            table[key] = (replace(decision, cached=True), deadline)
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
        """Forget every cached decision (a fresh table for the current revision); a question
        already put to the engine is not shared with those who ask after this."""
        self._table = OrderedDict()
        self._table_revision = self.inner.revision
        self._flights = {}

    async def reload(self) -> PolicyRevision:
        revision = await self.inner.reload()
        self.clear()
        return revision

    async def aclose(self) -> None:
        await self.inner.aclose()

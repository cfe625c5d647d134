"""The EVICTs a sidecar owes engines its purges could not reach: a bounded, in-memory queue.

A purge's ``engines@S`` step names an engine it could not reach (no control connection, no
ACK) ``unreachable``; the sidecar keeps that step's key digests for that engine (:class:`Debt`)
until the engine's control channel is back and acknowledges them
(:mod:`kvgov.proxy.purge.late`). Only what the step already hands engines is kept: the purge
job's id, its tenant, the engine id and the entries' key digests; never a user id, pseudonym
or key.

Memory is bounded twice: ``purge.pending_evict_max_digests`` digests in all (a debt that would
pass it makes the oldest ones go first; one larger than the whole bound is not kept) and
``purge.pending_evict_ttl_s`` per debt, counted from its step. Whatever goes is handed to
``on_drop`` (the caller logs and counts it). The queue itself is memory only; a restarted
sidecar owes again what the ledger proves its steps still owe
(:func:`kvgov.services.purge.debts.proven_debt`, :meth:`LateEvictions.restore
<kvgov.proxy.purge.late.LateEvictions.restore>`), each debt as old as its step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

#: why a debt was dropped (``on_drop``'s second argument; the metric's ``dropped_<reason>``)
DROPPED_TTL = "ttl"
DROPPED_MAX = "max_digests"


@dataclass(frozen=True, slots=True, eq=False)
class Debt:
    """EVICT(``digests``) of purge ``job_id``, owed to ``engine`` since ``since``."""

    engine: str
    job_id: str
    tenant: str
    digests: tuple[str, ...]
    #: the queue's clock when the step owed it
    since: float

    @property
    def size(self) -> int:
        return len(self.digests)


class OwedEvictions:
    """Debts per (engine, job), oldest first; at most ``max_digests`` digests in all, none
    older than ``ttl_s``. Not thread-safe: the sidecar's event loop owns it."""

    def __init__(
        self,
        *,
        max_digests: int,
        ttl_s: float,
        on_drop: Callable[[Debt, str], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_digests = max_digests
        self.ttl_s = ttl_s
        self._on_drop = on_drop
        self._clock = clock
        #: insertion order is age order (a debt owed again moves to the end)
        self._debts: dict[tuple[str, str], Debt] = {}
        self._total = 0

    @property
    def total(self) -> int:
        """Digests owed now, all engines together."""
        return self._total

    def owe(
        self,
        job_id: str,
        tenant: str,
        engines: Collection[str],
        digests: Sequence[str],
        *,
        age_s: float = 0.0,
        replace: bool = True,
    ) -> list[Debt]:
        """Owe each of ``engines`` EVICT(``digests``) for ``job_id`` (replacing what the same
        job owed it before: a step run again read its scope again; with ``replace`` false,
        what a restarted sidecar restores, keeping it); the debts kept. ``age_s``: how long
        ago the step ran (its lifetime counts from then)."""
        shared = tuple(sorted(set(digests)))  # one tuple for every engine of the step
        kept = []
        for engine in sorted(set(engines)):
            if not replace and (engine, job_id) in self._debts:
                continue  # owed already (this process's own step): that debt stands
            self._remove(self._debts.get((engine, job_id)))
            debt = Debt(engine, job_id, tenant, shared, self._clock() - max(age_s, 0.0))
            if not shared:
                continue  # nothing to evict: nothing owed
            if debt.size > self.max_digests:
                self._on_drop(debt, DROPPED_MAX)  # it alone passes the bound
                continue
            self.prune()
            while self._total + debt.size > self.max_digests:
                oldest = next(iter(self._debts.values()))
                self._remove(oldest)
                self._on_drop(oldest, DROPPED_MAX)
            self._debts[(engine, job_id)] = debt
            self._total += debt.size
            kept.append(debt)
        return kept

    def due(self, engine: str) -> list[Debt]:
        """What ``engine`` is owed now, oldest first (past their lifetime: dropped first)."""
        self.prune()
        return [d for (e, _), d in self._debts.items() if e == engine]

    def holds(self, debt: Debt) -> bool:
        """Whether ``debt`` is still owed (not settled, replaced or dropped since)."""
        return self._debts.get((debt.engine, debt.job_id)) is debt

    def settle(self, debt: Debt) -> bool:
        """``debt`` was acknowledged: forget it, unless the job owed the engine again
        meanwhile (that debt is newer and stays). Whether it was forgotten."""
        if not self.holds(debt):
            return False
        self._remove(debt)
        return True

    def prune(self) -> list[Debt]:
        """Drop the debts older than ``ttl_s``; those dropped."""
        cutoff = self._clock() - self.ttl_s
        gone = [d for d in self._debts.values() if d.since <= cutoff]
        for debt in gone:
            self._remove(debt)
            self._on_drop(debt, DROPPED_TTL)
        return gone

    def engines(self) -> set[str]:
        """The engines owed anything now."""
        return {e for e, _ in self._debts}

    def _remove(self, debt: Debt | None) -> None:
        if debt is not None and self.holds(debt):
            del self._debts[(debt.engine, debt.job_id)]
            self._total -= debt.size

"""Bounds on what one peer can make the data plane hold or record (``docs/operations.md``,
"Limits"; ``docs/threat-model.md``, "Resource exhaustion").

* :class:`ConnectionLimits`: connection caps shared by every data-plane listener (kvgov wire
  and ``lm://``): a global cap, one per peer (TCP address, or Unix peer uid) and one per engine
  identity (checked at HELLO; every ``lm://`` connection is its one declared engine). A
  connection over a cap is closed at once, counted in
  ``kvgov_dataplane_connections_refused_total`` and logged once per interval, never once per
  connection.
* :class:`Watchdog`: one task per listener that closes connections whose deadline passed (HELLO
  not completed in time, a frame's bytes not arrived in time, a reply not taken in time); a
  connection sets its own deadline (:class:`~kvgov.proxy.dataplane.conn.StreamProtocol`), so
  the data path only stores a float.
* :class:`DenialGate`: how many denials are recorded one event each, per connection and per
  second; the excess is summarised in one ``kv:denied`` event per connection and second
  (``attrs.suppressed``: how many, by operation and reason), so a probe flood is not chained one
  event per probe.
* :class:`SummaryLog`: a log line per interval, with how many were folded into it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from kvgov.proxy.dataplane.metrics import DataPlaneMetrics

log = logging.getLogger("kvgov.dataplane.limits")

#: what the watchdog's tick is bounded by (seconds): deadlines are enforced within a tick
MIN_TICK_S = 0.05
MAX_TICK_S = 1.0


class SummaryLog:
    """Logs the first occurrence of each event name at once, then at most one line per
    ``interval_s`` saying how many more occurred (``suppressed``)."""

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = logger
        self.interval_s = interval_s
        self._clock = clock
        self._next: dict[str, float] = {}
        self._held: Counter[str] = Counter()

    def note(self, name: str, level: int = logging.WARNING, **fields: Any) -> bool:
        """Count one occurrence; returns whether a line was written for it."""
        now = self._clock()
        if now < self._next.get(name, -math.inf):
            self._held[name] += 1
            return False
        suppressed = self._held.pop(name, 0)
        self._next[name] = now + self.interval_s
        self._log.log(level, name, extra={**fields, "suppressed": suppressed})
        return True


class Limited(Protocol):
    """A connection the limits and the watchdog see."""

    listener: str
    #: loop time after which the watchdog closes it (``math.inf``: none)
    deadline: float

    def expire(self) -> None: ...


@dataclass(slots=True)
class _Slot:
    peer: str
    engine: str | None = None


class ConnectionLimits:
    """Connection counts of every data-plane listener of one sidecar."""

    def __init__(
        self,
        *,
        max_total: int,
        per_peer: int,
        per_engine: int,
        metrics: DataPlaneMetrics | None = None,
        summary: SummaryLog | None = None,
    ) -> None:
        self.max_total = max_total
        self.per_peer = per_peer
        self.per_engine = per_engine
        self.metrics = metrics
        self.summary = summary if summary is not None else SummaryLog(log)
        self._slots: dict[int, _Slot] = {}
        self._peers: Counter[str] = Counter()
        self._engines: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return len(self._slots)

    def admit(self, conn: Limited, peer: str) -> bool:
        """Take a slot for a new connection from ``peer``; False (refused, counted, logged
        once per interval) when a cap is reached: the caller closes it."""
        reason = None
        if len(self._slots) >= self.max_total:
            reason = "global"
        elif self._peers[peer] >= self.per_peer:
            reason = "peer"
        if reason is not None:
            self._refused(conn, reason)
            return False
        self._slots[id(conn)] = _Slot(peer)
        self._peers[peer] += 1
        return True

    def admit_engine(self, conn: Limited, engine: str) -> bool:
        """Count an authenticated connection against its engine's cap (False: over it)."""
        slot = self._slots.get(id(conn))
        if slot is None:
            return True  # not counted (already released)
        if slot.engine == engine:
            return True
        if self._engines[engine] >= self.per_engine:
            self._refused(conn, "engine", engine=engine)
            return False
        slot.engine = engine
        self._engines[engine] += 1
        return True

    def release(self, conn: Limited) -> None:
        slot = self._slots.pop(id(conn), None)
        if slot is None:
            return
        self._drop(self._peers, slot.peer)
        if slot.engine is not None:
            self._drop(self._engines, slot.engine)

    @staticmethod
    def _drop(counts: Counter[str], name: str) -> None:
        counts[name] -= 1
        if counts[name] <= 0:
            del counts[name]

    def _refused(self, conn: Limited, reason: str, **fields: Any) -> None:
        if self.metrics is not None:
            self.metrics.refused.labels(conn.listener, reason).inc()
        self.summary.note(
            "dataplane.connection.refused", listener=conn.listener, cap=reason, **fields
        )


class Watchdog:
    """Closes the connections of ``connections()`` whose deadline has passed, checking every
    ``tick_s`` seconds (so a deadline holds to within one tick)."""

    def __init__(self, connections: Callable[[], Iterable[Limited]], tick_s: float) -> None:
        self._connections = connections
        self.tick_s = min(MAX_TICK_S, max(MIN_TICK_S, tick_s))
        self._task: asyncio.Task[None] | None = None

    @staticmethod
    def tick_for(*timeouts: float) -> float:
        """A tick of a quarter of the shortest deadline (bounded)."""
        return min(timeouts) / 4 if timeouts else MAX_TICK_S

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name="kvgov-dataplane-watchdog"
            )

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.tick_s)
            self.check(loop.time())

    def check(self, now: float) -> int:
        """Expire every connection past its deadline; returns how many."""
        late = [c for c in self._connections() if c.deadline <= now]
        for conn in late:
            conn.expire()
        return len(late)


@dataclass(slots=True)
class DenialBudget:
    """One connection's share of :class:`DenialGate` (its principal names the summary)."""

    principal: str | None
    window: int = -1
    recorded: int = 0
    #: denials not recorded one by one in ``window``, by (operation, reason)
    held: Counter[tuple[str, str]] = field(default_factory=Counter)


@dataclass(frozen=True, slots=True)
class Suppressed:
    """What a budget held back in one window: becomes one summary event."""

    principal: str | None
    count: int
    by_operation: dict[str, int]
    by_reason: dict[str, int]


class DenialGate:
    """Per one-second window: at most ``per_connection`` denials recorded individually per
    connection and ``per_second`` in all; the rest are counted and summarised."""

    def __init__(
        self,
        *,
        per_connection: int,
        per_second: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.per_connection = per_connection
        self.per_second = per_second
        self._clock = clock
        self._window = -1
        self._recorded = 0
        #: a window ended while budgets held denials: :meth:`due` has summaries to give
        self.flush_needed = False
        #: budgets holding suppressed denials of an earlier window, flushed when seen
        self._holding: dict[int, DenialBudget] = {}

    def admit(self, budget: DenialBudget | None, op: str, reason: str) -> bool:
        """Whether to record this denial as an event of its own (else it is held for the
        budget's summary; without a budget the global cap alone applies and the excess is
        only counted)."""
        window = int(self._clock())
        if window != self._window:
            self._window, self._recorded = window, 0
            self.flush_needed = bool(self._holding)
        if budget is not None and budget.window != window:
            budget.window, budget.recorded = window, 0
        if self._recorded < self.per_second and (
            budget is None or budget.recorded < self.per_connection
        ):
            self._recorded += 1
            if budget is not None:
                budget.recorded += 1
            return True
        if budget is not None:
            budget.held[(op, reason)] += 1
            self._holding[id(budget)] = budget
        return False

    def due(self, *, final: Iterable[DenialBudget] = ()) -> list[Suppressed]:
        """The summaries to record now: those of budgets whose window is over, and of
        ``final`` budgets (their connections closed)."""
        window = int(self._clock())
        self.flush_needed = False
        out: list[Suppressed] = []
        closing = {id(b): b for b in final}
        for key, budget in list(self._holding.items()):
            if key in closing or budget.window != window:
                del self._holding[key]
                out.append(_summary(budget))
        for key, budget in closing.items():
            if budget.held and key not in self._holding:
                out.append(_summary(budget))
        return [s for s in out if s.count]


def _summary(budget: DenialBudget) -> Suppressed:
    held, budget.held = budget.held, Counter()
    ops: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    for (op, reason), n in held.items():
        ops[op] += n
        reasons[reason] += n
    return Suppressed(budget.principal, sum(held.values()), dict(ops), dict(reasons))

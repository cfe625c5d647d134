"""Late EVICTs: a purge's EVICT reaches an engine whose control channel was down during its
``engines@S`` step once that channel is back (``docs/purge.md``, "Engines not reached").

The step names such an engine ``unreachable`` and the job ends ``incomplete``; its receipt is
signed as it is and never rewritten. The step also hands the engine's debt to
:meth:`LateEvictions.owe` (:class:`~kvgov.proxy.purge.owed.OwedEvictions`: digests only,
bounded). When a control connection of that engine id is authenticated (the wire server's
:attr:`~kvgov.proxy.dataplane.server.WireServer.on_control`, called at HELLO only, never on the
data path), or at once if one is open when the debt is made, a task sends each debt as the step
would (frames of at most 4096 digests, each ACK awaited ``purge.engine_ack_timeout_s``). Each
acknowledged debt is recorded as a chained ``purge:evict:late`` event (the job id, the engine,
the digests sent and the entries removed) and forgotten; one not acknowledged (no ACK, an ACK
with an error, the event not recorded) stays owed for the engine's next connection. Right after
recording one, the sidecar's writer signs its chain's head (``sign``): the job's document lists
only late EVICTs below a head signed while their writer was live
(:func:`kvgov.ledger.purge_trail.late_evictions`), so a row the runtime database role chained on a
dead writer's chain is not listed (review r13, F1).

The engine id is what the connection's token stands for (or, without tokens, what the HELLO
named on a trusted Unix socket): another engine's connection is never sent the digests. A debt
is settled by the first connection of the engine id that acknowledges it.

The queue is memory; a sidecar that restarts owes again, through :meth:`LateEvictions.restore`,
what the ledger proves its earlier steps still owe (:func:`kvgov.services.purge.debts.
proven_debt`: the chained ``purge:step`` event names the engines, the purge's chained
``kv:delete`` events the digests; a chained ``purge:evict:late`` event settles a debt), each as
old as its step and within the same bounds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence
from datetime import datetime
from typing import Protocol

from kvgov.ledger.events import Event, EventSink
from kvgov.proxy.dataplane.identity import Identity
from kvgov.proxy.dataplane.metrics import DataPlaneMetrics
from kvgov.proxy.purge.owed import DROPPED_MAX, DROPPED_TTL, Debt, OwedEvictions
from kvgov.services.purge.deletion import emit_all
from kvgov.types import EventKind, Outcome

log = logging.getLogger("kvgov.purge.late")


class _Answer(Protocol):
    """An engine connection's answer to an EVICT (``EngineEvictResult``)."""

    @property
    def acked(self) -> bool: ...

    @property
    def removed(self) -> int: ...

    @property
    def error(self) -> str | None: ...


class Restored(Protocol):
    """A debt the ledger proves (:class:`~kvgov.services.purge.debts.ProvenDebt`)."""

    @property
    def job_id(self) -> str: ...

    @property
    def tenant(self) -> str: ...

    @property
    def engines(self) -> tuple[str, ...]: ...

    @property
    def digests(self) -> tuple[str, ...]: ...

    @property
    def stepped_at(self) -> datetime: ...


class Control(Protocol):
    """A control connection (``WireConnection``): who it is, and EVICT."""

    identity: Identity | None

    @property
    def closed(self) -> bool: ...

    async def evict(
        self, digests: Sequence[str], timeout_s: float, *, job: str | None = None
    ) -> _Answer: ...


class LateEvictions:
    """What the sidecar owes engines, and the tasks that deliver it."""

    def __init__(
        self,
        *,
        max_digests: int,
        ttl_s: float,
        ack_timeout_s: float,
        sink: EventSink,
        controls: Callable[[], Iterable[Control]],
        principal: str,
        metrics: DataPlaneMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        sign: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """``sign``: has the writer behind ``sink`` sign its chain's head (logging, never
        raising, a failure: the next periodic checkpoint signs it then)."""
        self.owed = OwedEvictions(
            max_digests=max_digests, ttl_s=ttl_s, on_drop=self._dropped, clock=clock
        )
        self._ack_timeout_s = ack_timeout_s
        self._sink = sink
        self._controls = controls
        self._principal = principal
        self._metrics = metrics
        self._sign = sign
        #: the delivery task of each engine now (one at a time per engine)
        self._runs: dict[str, asyncio.Task[None]] = {}
        self._closed = False
        if metrics is not None:
            metrics.late_evict_pending.set_function(lambda: self.owed.total)

    # -- what the purge step and the wire server call ------------------------------------------

    def owe(
        self, job_id: str, tenant: str, engines: Collection[str], key_digests: Sequence[str]
    ) -> None:
        """Owe ``engines`` EVICT(``key_digests``) of purge ``job_id``; an engine connected
        again already (its channel came back while the step ran) is sent it now."""
        for debt in self.owed.owe(job_id, tenant, engines, key_digests):
            self._count("owed", debt.size)
            log.info(
                "purge.late_evict.owed",
                extra={"purge_id": job_id, "engine": debt.engine, "digests": debt.size},
            )
        for engine in sorted(set(engines)):
            if self._live(engine, ()):
                self._deliver(engine)

    def restore(self, debts: Iterable[Restored], *, now: datetime) -> None:
        """Owe again what a restarted sidecar's earlier steps still owe (oldest first), each
        as old as its step at ``now``; a debt this process owes already stands. Engines
        connected already are sent theirs now."""
        engines: set[str] = set()
        for restored in debts:
            age = (now - restored.stepped_at).total_seconds()
            kept = self.owed.owe(
                restored.job_id,
                restored.tenant,
                restored.engines,
                restored.digests,
                age_s=age,
                replace=False,
            )
            for debt in kept:
                engines.add(debt.engine)
                self._count("owed", debt.size)
                log.info(
                    "purge.late_evict.restored",
                    extra={"purge_id": debt.job_id, "engine": debt.engine, "digests": debt.size},
                )
        for engine in sorted(engines):
            if self._live(engine, ()):
                self._deliver(engine)

    def connected(self, conn: Control) -> None:
        """A control connection was authenticated: send its engine what it is owed."""
        if conn.identity is not None and self.owed.due(conn.identity.engine):
            self._deliver(conn.identity.engine)

    def prune(self) -> None:
        """Drop what is past its lifetime now (the sidecar's sweeper calls it)."""
        self.owed.prune()

    async def aclose(self) -> None:
        """Stop delivering (the sidecar stops); what is owed is rebuilt from the ledger by the
        next start (:meth:`restore`)."""
        self._closed = True
        runs = list(self._runs.values())
        for task in runs:
            task.cancel()
        await asyncio.gather(*runs, return_exceptions=True)
        self._runs.clear()

    # -- delivery ------------------------------------------------------------------------------

    def _deliver(self, engine: str) -> None:
        if self._closed:
            return  # stopping: the connections are closed, the next start restores the debt
        running = self._runs.get(engine)
        if running is not None and not running.done():
            return  # it takes the new connection or debt on its next turn
        task = asyncio.get_running_loop().create_task(self._run(engine), name="kvgov-late-evict")
        self._runs[engine] = task
        task.add_done_callback(lambda t: self._ran(engine, t))

    def _ran(self, engine: str, task: asyncio.Task[None]) -> None:
        if self._runs.get(engine) is task:
            del self._runs[engine]
        if not task.cancelled() and task.exception() is not None:
            log.error("purge.late_evict.crashed", exc_info=task.exception())

    def _live(self, engine: str, failed: Collection[Control]) -> Control | None:
        """An open control connection of ``engine`` not in ``failed`` (any: a debt is the
        engine id's, settled by whichever connection of it acknowledges it)."""
        found = None
        for conn in self._controls():
            ident = conn.identity
            mine = ident is not None and ident.engine == engine
            if mine and not conn.closed and conn not in failed:
                found = conn
        return found

    async def _run(self, engine: str) -> None:
        """Send ``engine`` its debts, oldest first, over its open control connections: a
        connection that fails one is not used again by this run; the run ends when nothing is
        owed or no connection is left to try."""
        failed: list[Control] = []
        while True:
            due = self.owed.due(engine)
            conn = self._live(engine, failed)
            if not due or conn is None:
                return
            for debt in due:
                if not self.owed.holds(debt):
                    continue  # dropped (or owed anew) while the ones before were sent
                if not await self._send(conn, debt):
                    failed.append(conn)
                    break

    async def _send(self, conn: Control, debt: Debt) -> bool:
        """One debt over one connection: acknowledged and recorded (then forgotten)."""
        answer = await conn.evict(debt.digests, self._ack_timeout_s, job=debt.job_id)
        if not answer.acked or answer.error is not None:
            self._count("failed", debt.size)
            log.warning(
                "purge.late_evict.failed",
                extra={
                    "purge_id": debt.job_id,
                    "engine": debt.engine,
                    "digests": debt.size,
                    "error": answer.error or "no_ack",
                },
            )
            return False
        try:
            await emit_all(self._sink, [self._event(debt, answer.removed)])
        except Exception as exc:  # noqa: BLE001 - not recorded: stays owed, sent again later
            self._count("failed", debt.size)
            log.warning(
                "purge.late_evict.unrecorded",
                extra={"purge_id": debt.job_id, "engine": debt.engine, "error": type(exc).__name__},
            )
            return False
        self.owed.settle(debt)
        self._count("delivered", debt.size)
        log.info(
            "purge.late_evict.delivered",
            extra={
                "purge_id": debt.job_id,
                "engine": debt.engine,
                "digests": debt.size,
                "removed": answer.removed,
            },
        )
        if self._sign is not None:  # the job's document lists it once its head is signed
            await self._sign()
        return True

    def _event(self, debt: Debt, removed: int) -> Event:
        """The chained record of a late eviction: as the step's ``purge:step`` event names
        the job and the sidecar, this one the engine and the counts. No actor: the queue
        holds no user, not even a pseudonym (the job id leads to the purge)."""
        return Event(
            kind=EventKind.PURGE_EVICT_LATE,
            tenant=debt.tenant,
            principal=self._principal,
            outcome=Outcome.OK,
            reason="reconnected",
            attrs={
                "purge_id": debt.job_id,
                "step": "engines",
                "engine": debt.engine,
                "digests": debt.size,
                "removed": removed,
            },
        )

    # -- drops and counts ----------------------------------------------------------------------

    def _dropped(self, debt: Debt, reason: str) -> None:
        outcome = {DROPPED_TTL: "dropped_ttl", DROPPED_MAX: "dropped_max"}[reason]
        self._count(outcome, debt.size)
        log.warning(
            "purge.late_evict.dropped",
            extra={
                "purge_id": debt.job_id,
                "engine": debt.engine,
                "digests": debt.size,
                "reason": reason,
            },
        )

    def _count(self, outcome: str, digests: int) -> None:
        if self._metrics is not None:
            self._metrics.late_evict.labels(outcome).inc(digests)

"""The purge step executors. Each is idempotent: running it again finds nothing left to do.

An executor returns the step's final state and its typed detail (what it did, counts, who did
not answer: one model per step in :mod:`kvgov.services.purge.documents`, stored as its JSON;
its ``summary()`` is the chained part of the ``purge:step`` event). It raises only for errors
worth a retry (a tier backend failing, the database going away); the caller then puts the step
back to pending, or marks it failed after ``MAX_ATTEMPTS``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from sqlalchemy.orm import Session, sessionmaker

from kvgov.config import Settings
from kvgov.db.engine import SQLITE_BEGIN_IMMEDIATE
from kvgov.db.purge_views import JobView, StepName, StepView
from kvgov.ledger.events import Appended, Event, EventSink
from kvgov.services.purge import scope
from kvgov.services.purge.deletion import delete_entries, emit_all
from kvgov.services.purge.documents import (
    EngineAnswer,
    EnginesDetail,
    EventRef,
    GpuDetail,
    GpuReset,
    KeyDestroyed,
    KeysDetail,
    LedgerDetail,
    StepDetail,
    TiersDetail,
    digest_set_hash,
)
from kvgov.services.purge.gpu import reset_prefix_caches
from kvgov.services.purge.ports import (
    EngineEvictor,
    KeyShredder,
    LateEvictor,
    LocalIndex,
    TierSet,
)
from kvgov.types import EntryState, EventKind, Outcome, PurgeState

log = logging.getLogger(__name__)
T = TypeVar("T")

StepOutcome = tuple[PurgeState, StepDetail]


@dataclass
class StepContext:
    """What the step executors reach: the database, the ledger, and this process's ports."""

    settings: Settings
    sessions: sessionmaker[Session]
    sink: EventSink
    tiers: TierSet
    shredder: KeyShredder
    evictor: EngineEvictor
    local_index: LocalIndex
    #: this process's sidecar id (None for the CLI)
    sidecar_id: str | None
    principal: str

    async def db(self, fn: Callable[[Session], T]) -> T:
        """Run ``fn`` in its own transaction, off the event loop.

        On SQLite the transaction takes the write lock at BEGIN (``BEGIN IMMEDIATE``): ``fn``
        often reads, then writes, and a deferred transaction whose snapshot another writer (the
        ledger writer, a heartbeat) has moved past fails at once with "database is locked"
        instead of waiting its turn. No effect on Postgres."""

        def run() -> T:
            with self.sessions.begin() as s:
                s.connection(execution_options={SQLITE_BEGIN_IMMEDIATE: True})
                return fn(s)

        return await asyncio.to_thread(run)

    async def emit(self, events: Sequence[Event]) -> list[Appended]:
        """Queue every event, then wait until all are durable."""
        return await emit_all(self.sink, events)


async def run_step(ctx: StepContext, job: JobView, step: StepView) -> StepOutcome:
    runner = _RUNNERS[step.name]
    state, detail = await runner(ctx, job, step)
    await ctx.emit(
        [
            Event(
                kind=EventKind.PURGE_STEP,
                tenant=job.tenant,
                actor=job.subject,
                principal=ctx.principal,
                outcome=Outcome.OK if state is PurgeState.COMPLETED else Outcome.ERROR,
                reason=str(state),
                attrs={
                    "purge_id": job.id,
                    "step": str(step.name),
                    "sidecar_id": step.sidecar_id,
                    "attempt": step.attempts,
                    "summary": detail.summary(),
                },
            )
        ]
    )
    return state, detail


async def _tiers(ctx: StepContext, job: JobView, step: StepView) -> StepOutcome:
    # first fence this process's data plane: a put of the scope still arriving is never made
    # visible, one admitted from now until the job ends is refused (review r10, F2); then
    # the puts it acknowledged from its journal reach the database before the scope is read
    purge = ctx.settings.purge
    until = job.created_at.timestamp() + purge.job_timeout_s + purge.step_lease_s
    ctx.local_index.fence(job.id, job.tenant, job.subject, until)
    await ctx.local_index.settle()
    entries = await ctx.db(lambda s: scope.scoped_entries(s, job.tenant, job.subject))
    # and what the index holds of the scope that the database did not show; with the fence
    # up nothing of it enters the index any more, so this one look is complete
    listed = {e.key_digest for e in entries}
    entries += [
        scope.ScopedEntry(d, EntryState.LIVE, (), None)
        for d in ctx.local_index.held(job.tenant, job.subject)
        if d not in listed
    ]
    # stop serving them from this process first, then delete them everywhere it reaches
    ctx.local_index.drop([e.key_digest for e in entries])
    result = await delete_entries(
        ctx.tiers,
        ctx.sink,
        entries,
        tenant=job.tenant,
        new_state=EntryState.PURGED,
        kind=EventKind.KV_DELETE,
        reason="purge",
        principal=ctx.principal,
        attrs={"purge_id": job.id},
    )
    forgotten = 0
    if step.sidecar_id is not None:
        # drop this sidecar's in-memory copies of the subject's data keys (idempotent)
        forgotten = len(await asyncio.to_thread(ctx.shredder.shred, job.tenant, job.subject))
    sweep = result.sweep
    still = {k: len(v) for k, v in sweep.still_present.items()}
    detail = TiersDetail(
        executed_by=ctx.principal,
        tiers=tuple(ctx.tiers.names),
        deleted=sweep.deleted,
        entries_in_scope=len(entries),
        newly_purged=len([e for e in entries if e.state is not EntryState.PURGED]),
        verified=sweep.verified,
        keys_forgotten=forgotten,
        still_present=still or None,
        reason=f"entries still present after delete: {still}" if still else None,
    )
    return (PurgeState.INCOMPLETE if still else PurgeState.COMPLETED), detail


async def _keys(ctx: StepContext, job: JobView, step: StepView) -> StepOutcome:
    destroyed = await asyncio.to_thread(ctx.shredder.shred, job.tenant, job.subject)
    await ctx.emit(
        [
            Event(
                kind=EventKind.KEY_SHREDDED,
                tenant=job.tenant,
                actor=job.subject,
                principal=ctx.principal,
                outcome=Outcome.OK,
                reason="purge",
                attrs={"purge_id": job.id, "key_id": k.key_id, "version": k.version},
            )
            for k in destroyed
        ]
    )
    return PurgeState.COMPLETED, KeysDetail(
        executed_by=ctx.principal,
        destroyed=tuple(KeyDestroyed(key_id=k.key_id, version=k.version) for k in destroyed),
    )


#: why a holder the ledger names got no EVICT (``EngineAnswer.error``)
NO_CONTROL_CONNECTION = "no_control_connection"
NO_CONTROL_CHANNEL = "no_control_channel"


async def _engines(ctx: StepContext, job: JobView, step: StepView) -> StepOutcome:
    # puts are acknowledged from the journal before Postgres has their events: the holders
    # read below must include an engine that stored the data a moment ago (as ``_tiers``)
    await ctx.local_index.settle()
    entries = await ctx.db(lambda s: scope.scoped_entries(s, job.tenant, job.subject))
    # the engines that stored or read an entry in scope through this sidecar are this step's
    # to reach (each other sidecar's engines@S answers for its own chain)
    chain = ctx.settings.chain_id if step.sidecar_id is not None else None
    holders = await ctx.db(
        lambda s: scope.engines_that_held(s, job.tenant, job.subject, chain_id=chain)
    )
    results = await ctx.evictor.evict(
        job.tenant,
        [e.key_digest for e in entries],
        ctx.settings.purge.engine_ack_timeout_s,
        holders.anywhere,
    )
    # an ACK that reports an error (the engine could not look or could not match) did not evict
    answers = [
        EngineAnswer(engine=r.engine, acked=r.acked, removed=r.removed, error=r.error)
        for r in results
    ]
    answers += _not_sent(holders, {r.engine for r in results})
    acked = [a for a in answers if a.acked and a.error is None]
    missing = tuple(a for a in answers if not a.acked or a.error is not None)
    removed: dict[str, int] = {}
    for a in acked:  # two connections of one engine id add up
        removed[a.engine] = removed.get(a.engine, 0) + a.removed
    owed = owed_engines(missing)
    if owed and isinstance(ctx.evictor, LateEvictor):
        # the receipt names them; the EVICT still reaches them when their channel is back
        ctx.evictor.owe(job.id, job.tenant, owed, [e.key_digest for e in entries])
    sent = {e.key_digest for e in entries}
    detail = EnginesDetail(
        executed_by=ctx.principal,
        digests_sent=len(sent),
        acknowledged=tuple(sorted({a.engine for a in acked})),
        removed=removed,
        unreachable=missing,
        reason=not_acknowledged(missing),
        digests_hash=digest_set_hash(sent),
    )
    return (PurgeState.INCOMPLETE if missing else PurgeState.COMPLETED), detail


#: why a connected engine's EVICT got no ACK (``WireConnection.evict``)
EVICT_TIMED_OUT = "TimeoutError"
EVICT_CONNECTION_CLOSED = "ConnectionClosed"
#: the answers whose engine may still hold the entries and may be reached later: no EVICT
#: was sent, or it got no ACK (EVICT is idempotent: sending it again removes nothing twice).
#: An ACK that reports an error is not among them: the engine answered that it cannot evict
#: (no digest key, its handler failed), which the operator must look at; nor is the
#: ``lm://`` engine, which has no control channel to come back on.
UNANSWERED = frozenset({NO_CONTROL_CONNECTION, EVICT_TIMED_OUT, EVICT_CONNECTION_CLOSED})


def not_acknowledged(missing: Sequence[EngineAnswer]) -> str | None:
    """An ``engines`` step's ``reason``: the engines of ``missing`` with their errors."""
    if not missing:
        return None
    return "no successful EVICT acknowledgement from " + ", ".join(
        f"{a.engine} ({a.error})" for a in missing
    )


def owed_engines(missing: Sequence[EngineAnswer]) -> list[str]:
    """The engines of ``missing`` that are owed the EVICT (:data:`UNANSWERED`)."""
    return sorted({a.engine for a in missing if a.error in UNANSWERED})


def _not_sent(holders: scope.Holders, answered: set[str]) -> list[EngineAnswer]:
    """The holders this sidecar had to reach that no EVICT went to: an engine with no open
    control connection (reconnecting, restarting, ``control: false``) and the ``lm://``
    engine, which has none at all. Their local tiers may still hold the entries, so the step
    names them instead of counting them evicted (review r10, F1)."""
    down = [
        EngineAnswer(engine=e, acked=False, removed=0, error=NO_CONTROL_CONNECTION)
        for e in sorted(holders.here - answered)
    ]
    lm = [
        EngineAnswer(
            engine=scope.LM_PRINCIPAL + e, acked=False, removed=0, error=NO_CONTROL_CHANNEL
        )
        for e in sorted(holders.lm_here)
    ]
    return down + lm


async def _gpu(ctx: StepContext, job: JobView, step: StepView) -> StepOutcome:
    results = await reset_prefix_caches(
        list(ctx.settings.purge.vllm_engines), timeout_s=ctx.settings.purge.http_timeout_s
    )
    # a sidecar's own step names the engine with the sidecar: every pod's vLLM is at the same
    # loopback URL, and the receipt must say which pods were reset
    where = f" on sidecar {step.sidecar_id}" if step.sidecar_id else ""
    failed = [f"{r.engine}{where} ({r.status or r.error})" for r in results if not r.ok]
    detail = GpuDetail(
        executed_by=ctx.principal,
        results=tuple(
            GpuReset(engine=r.engine + where, ok=r.ok, status=r.status, error=r.error)
            for r in results
        ),
        reason="GPU prefix cache not reset on " + ", ".join(failed) if failed else None,
    )
    return (PurgeState.INCOMPLETE if failed else PurgeState.COMPLETED), detail


async def _ledger(ctx: StepContext, job: JobView, step: StepView) -> StepOutcome:
    """Erase the payload and record the erasure; the receipt is built by the service."""
    from kvgov.db.engine import utcnow

    def erase(s: Session) -> tuple[int, int]:
        now = utcnow()
        return (
            scope.erase_payloads(s, job.tenant, job.subject, now=now),
            scope.mark_users_erased(s, job.tenant, job.subject, now=now),
        )

    payloads, users = await ctx.db(erase)
    kind = EventKind.TENANT_DATA_PURGED if job.subject is None else EventKind.USER_DATA_PURGED
    erased, purged = await ctx.emit(
        [
            Event(
                kind=EventKind.LEDGER_PAYLOAD_ERASED,
                tenant=job.tenant,
                actor=job.subject,
                principal=ctx.principal,
                outcome=Outcome.OK,
                attrs={"purge_id": job.id, "payloads": payloads, "user_refs": users},
            ),
            Event(
                kind=kind,
                tenant=job.tenant,
                actor=job.subject,
                principal=ctx.principal,
                outcome=Outcome.OK,
                attrs={"purge_id": job.id, "kind": str(job.kind)},
            ),
        ]
    )
    return PurgeState.COMPLETED, LedgerDetail(
        executed_by=ctx.principal,
        payloads_erased=payloads,
        users_erased=users,
        payload_event=EventRef(chain_id=erased.chain_id, seq=erased.seq),
        erasure_event=EventRef(chain_id=purged.chain_id, seq=purged.seq),
    )


_RUNNERS: dict[StepName, Callable[[StepContext, JobView, StepView], Awaitable[StepOutcome]]] = {
    StepName.TIERS: _tiers,
    StepName.KEYS: _keys,
    StepName.ENGINES: _engines,
    StepName.GPU: _gpu,
    StepName.LEDGER: _ledger,
}

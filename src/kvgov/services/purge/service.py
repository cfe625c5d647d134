"""The purge service: plan (dry run), create, execute steps, finish with a signed receipt.

The CLI, the REST API and each sidecar's background executor all use this one class. Creating a
job writes the job, its steps and a ``purge:requested`` event; executing claims one step at a
time (see :mod:`kvgov.db.purge_jobs`), stores each step's typed detail as its JSON and, when the
final ``ledger`` step has run, builds the receipt from every step's detail read back through its
model (:func:`~kvgov.services.purge.documents.read_detail`), signs it with the ledger's Ed25519
key and stores it with the job's final state in the same transaction. The step rows are mutable;
before the receipt is built each is checked against its chained ``purge:step`` event
(:mod:`kvgov.services.purge.trail`), and a job is finished (and signed) once. An event counts
only below a head its writer signed while live, so each step's executor has its own writer sign
its chain's head (the ``checkpoint`` port) after chaining the event and before the step is
marked finished.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import uuid
from collections.abc import Callable, Collection
from datetime import datetime
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from sqlalchemy.orm import Session

from kvgov.config import Settings
from kvgov.db import purge_jobs as jobs
from kvgov.db import sidecars
from kvgov.db.engine import utcnow
from kvgov.db.purge_views import (
    CreationBound,
    JobView,
    PurgeRequest,
    StepName,
    StepView,
    final_state,
    plan_steps,
)
from kvgov.errors import KvgovError, PurgeError
from kvgov.ledger.chain import public_key_bytes
from kvgov.ledger.events import Event
from kvgov.ledger.purge_trail import ChainedLateEviction, chained_steps, late_evictions
from kvgov.services.purge import scope
from kvgov.services.purge.debts import OwedJob, ProvenDebt, owed_jobs, proven_debt
from kvgov.services.purge.documents import (
    CheckpointRef,
    EngineFailure,
    EnginesDetail,
    EnginesOutcome,
    GpuDetail,
    GpuReset,
    KeyDestroyed,
    KeysDetail,
    LedgerDetail,
    LedgerOutcome,
    PurgePlan,
    Receipt,
    ReceiptScope,
    StepDetail,
    TiersDetail,
    read_detail,
)
from kvgov.services.purge.ports import Checkpointer
from kvgov.services.purge.reached import count_acks_elsewhere
from kvgov.services.purge.receipts import sign_receipt
from kvgov.services.purge.steps import StepContext, run_step
from kvgov.services.purge.trail import cross_check
from kvgov.types import EventKind, Outcome, PurgeState

log = logging.getLogger(__name__)


class PurgeService:
    def __init__(
        self,
        ctx: StepContext,
        *,
        signing_key: Ed25519PrivateKey,
        pseudonymize: Callable[[str, str], str],
        checkpoint: Checkpointer | None = None,
        lease_s: float = 120.0,
        trusted_keys: Collection[bytes] = (),
    ) -> None:
        self.ctx = ctx
        self._signing_key = signing_key
        #: the keys whose chains' ``purge:step`` events a receipt may rest on: this signer's
        #: own and ``ledger.trusted_keys`` (the fleet's other nodes)
        self._trusted = frozenset(trusted_keys) | {public_key_bytes(signing_key)}
        self._pseudonymize = pseudonymize
        self._checkpoint = checkpoint
        self.lease_s = lease_s

    @property
    def settings(self) -> Settings:
        return self.ctx.settings

    def subject_of(self, req: PurgeRequest) -> str | None:
        return None if req.user is None else self._pseudonymize(req.tenant, req.user)

    # -- plan / create ---------------------------------------------------------------------

    async def plan(self, req: PurgeRequest) -> PurgePlan:
        """What a purge would delete, changing nothing (``--dry-run``)."""
        subject = self.subject_of(req)

        def read(s: Session) -> dict[str, Any]:
            entries = scope.scoped_entries(s, req.tenant, subject)
            return {
                "entries": entries,
                "payloads": scope.erasable_payloads(s, req.tenant, subject),
                "sidecars": sidecars.live_sidecars(
                    s, now=utcnow(), max_age_s=self.settings.purge.sidecar_live_s
                ),
            }

        found = await self.ctx.db(read)
        known, variants_known = await self.subject_check(req)
        keys = await asyncio.to_thread(self.ctx.shredder.pending, req.tenant, subject)
        entries = found["entries"]
        present = await self.ctx.tiers.count_present([e.key_digest for e in entries])
        by_state: dict[str, int] = {}
        for e in entries:
            state = "unknown" if e.state is None else str(e.state)  # None: no row, chain only
            by_state[state] = by_state.get(state, 0) + 1
        return PurgePlan(
            kind=str(req.kind),
            tenant=req.tenant,
            subject=subject,
            entries_in_scope=len(entries),
            entries_by_state=by_state,
            bytes_in_scope=sum(e.size or 0 for e in entries),
            present_in_reachable_tiers=present,
            keys_to_destroy=tuple(KeyDestroyed(key_id=k, version=v) for k, v in keys),
            payloads_to_erase=found["payloads"],
            sidecars=tuple(found["sidecars"]),
            vllm_engines=tuple(self.settings.purge.vllm_engines),
            sidecar_count=len(found["sidecars"]),
            vllm_engine_count=len(self.settings.purge.vllm_engines),
            subject_known=known,
            spelling_variants_known=variants_known,
        )

    async def subject_check(self, req: PurgeRequest) -> tuple[bool | None, int]:
        """Whether the ledger has seen the request's user act in its tenant (None: a tenant
        purge), and how many other spellings of the id it has seen (:class:`PurgePlan`)."""
        subject = self.subject_of(req)
        if subject is None:
            return None, 0
        variants = self._variant_pseudonyms(req)
        known = await self.ctx.db(
            lambda s: scope.known_subjects(s, req.tenant, [subject, *variants])
        )
        return subject in known, len(known & variants)

    def _variant_pseudonyms(self, req: PurgeRequest) -> set[str]:
        if req.user is None:
            return set()
        return {self._pseudonymize(req.tenant, v) for v in scope.spelling_variants(req.user)}

    async def create(self, req: PurgeRequest, *, bound: CreationBound | None = None) -> JobView:
        """Create the job, its steps and its ``purge:requested`` event. ``bound``: the request
        comes from a tenant-scoped admin token (``POST /v1/purges``), held to the tenant's open
        jobs and the token's creations per minute (:class:`~kvgov.errors.RateLimitedError`,
        nothing written); None for global admins and the CLI."""
        if req.dry_run:
            raise PurgeError("a dry run creates no job: call plan()")
        subject = self.subject_of(req)
        job_id = str(uuid.uuid4())

        def insert(s: Session) -> JobView:
            now = utcnow()
            if bound is not None:
                jobs.hold_to_bound(
                    s,
                    req.tenant,
                    req.requested_by,
                    bound,
                    now=now,
                    job_timeout_s=self.settings.purge.job_timeout_s,
                )
            live = sidecars.live_sidecars(s, now=now, max_age_s=self.settings.purge.sidecar_live_s)
            jobs.insert_job(s, job_id, req, subject, plan_steps(live), now=now)
            return jobs.load_job(s, job_id)

        job = await self.ctx.db(insert)
        await self.ctx.emit(
            [
                Event(
                    kind=EventKind.PURGE_REQUESTED,
                    tenant=req.tenant,
                    actor=subject,
                    principal=req.requested_by,
                    outcome=Outcome.OK,
                    attrs={
                        "purge_id": job_id,
                        "kind": str(req.kind),
                        "sidecars": sorted({s.sidecar_id for s in job.steps if s.sidecar_id}),
                    },
                )
            ]
        )
        log.info("purge.created", extra={"purge_id": job_id, "kind": str(req.kind)})
        return job

    async def get(self, job_id: str) -> JobView:
        return await self.ctx.db(lambda s: jobs.load_job(s, job_id))

    async def late_evictions(self, job: JobView) -> list[ChainedLateEviction]:
        """The job's chained late EVICTs (``purge:evict:late``), on chains this node trusts."""
        return await self.ctx.db(lambda s: late_evictions(s, job.id, job.tenant, self._trusted))

    async def owed_jobs(self, sidecar_id: str) -> list[OwedJob]:
        """The jobs whose ``engines`` step of ``sidecar_id`` may still owe engines (ids only:
        :func:`~kvgov.services.purge.debts.owed_jobs`); :meth:`owed_eviction` reads each."""
        purge = self.settings.purge
        return await self.ctx.db(
            lambda s: owed_jobs(
                s,
                sidecar_id,
                now=utcnow(),
                max_age_s=purge.pending_evict_ttl_s,
                job_window_s=purge.job_timeout_s + purge.step_lease_s,
            )
        )

    async def owed_eviction(
        self, sidecar_id: str, job: OwedJob, *, before: datetime
    ) -> ProvenDebt | None:
        """What ``sidecar_id``'s ``engines`` step of ``job``, if it ran before ``before``, still
        owes engines, as the chain proves it (:func:`~kvgov.services.purge.debts.proven_debt`),
        in a transaction of its own: one of a restarted sidecar's late EVICTs."""
        return await self.ctx.db(
            lambda s: proven_debt(
                s,
                job,
                sidecar_id=sidecar_id,
                trusted=self._trusted,
                now=utcnow(),
                max_age_s=self.settings.purge.pending_evict_ttl_s,
                before=before,
            )
        )

    # -- execution -------------------------------------------------------------------------

    async def run_one(self, job_id: str | None = None) -> StepView | None:
        """Claim and run one step this process may run; None when there is none right now."""
        settings = self.settings

        def claim(s: Session) -> tuple[JobView, StepView] | None:
            return jobs.claim_step(
                s,
                sidecar_id=self.ctx.sidecar_id,
                now=utcnow(),
                lease_s=self.lease_s,
                job_timeout_s=settings.purge.job_timeout_s,
                job_id=job_id,
            )

        claimed = await self.ctx.db(claim)
        if claimed is None:
            return None
        job, step = claimed
        log.info(
            "purge.step.start",
            extra={"purge_id": job.id, "step": str(step.name), "sidecar": step.sidecar_id},
        )
        try:
            state, detail = await run_step(self.ctx, job, step)
            if step.name is not StepName.LEDGER:  # ``_finish`` signs the ledger step's
                await self._sign_head()
        except (KvgovError, OSError, SQLAlchemyError) as exc:
            # a step that meets a database error (a lock it could not get, a lost connection)
            # goes back for a retry like any other failure, instead of staying "running" until
            # its lease runs out. The driver's message only: SQLAlchemy's names the statement
            # and its parameters
            cause = exc.orig if isinstance(exc, DBAPIError) else exc
            error = f"{type(exc).__name__}: {cause}"
            log.warning("purge.step.error", extra={"purge_id": job.id, "step": str(step.name)})
            new_state = await self.ctx.db(
                lambda s: jobs.fail_step(s, step.id, error, now=utcnow(), attempt=step.attempts)
            )
            if new_state is PurgeState.FAILED and step.name is StepName.LEDGER:
                await self._finish(job.id, step, None)
            return step
        if step.name is StepName.LEDGER:
            await self._finish(job.id, step, (state, detail))
        else:
            stored = detail.model_dump(mode="json")
            await self.ctx.db(
                lambda s: jobs.finish_step(
                    s, step.id, state, stored, now=utcnow(), attempt=step.attempts
                )
            )
        log.info("purge.step.done", extra={"purge_id": job.id, "step": str(step.name)})
        return step

    async def _sign_head(self) -> None:
        """Have this process's writer sign its chain's head, now that the step's ``purge:step``
        event is chained, before the step is marked finished: the receipt counts an event only
        below a head signed while its writer was live (:mod:`kvgov.ledger.purge_trail`), and
        whichever process builds it must find this one's signed. A failure is the step's (it
        is retried): the event it leaves unsigned would make the receipt ``incomplete``."""
        if self._checkpoint is not None:
            await self._checkpoint()

    async def run_until_idle(self, job_id: str | None = None) -> int:
        """Run steps until none is claimable now; returns how many ran."""
        count = 0
        while await self.run_one(job_id) is not None:
            count += 1
        return count

    async def lift_fences(self) -> None:
        """Lift this process's erasure fences (raised by its ``tiers`` steps) of the jobs that
        are finished, here or by another process: their subjects' puts are cached again."""
        fenced = self.ctx.local_index.fenced()
        if not fenced:
            return
        open_ids = set(await self.ctx.db(jobs.open_job_ids))
        self.ctx.local_index.lift([j for j in fenced if j not in open_ids])

    async def wait(self, job_id: str, *, run_local: bool = True) -> JobView:
        """Run what this process can and poll until the job is finished (bounded by the job
        timeout: after it, the final step runs and names what did not answer)."""
        poll = self.settings.purge.poll_interval_s
        while True:
            if run_local:
                await self.run_until_idle(job_id)
            job = await self.get(job_id)
            if job.finished:
                return job
            await asyncio.sleep(poll)

    # -- the receipt -----------------------------------------------------------------------

    async def _finish(
        self, job_id: str, ledger_step: StepView, outcome: tuple[PurgeState, StepDetail] | None
    ) -> None:
        checkpoint = None
        if outcome is not None and self._checkpoint is not None:
            info = await self._checkpoint()
            if info is not None:
                checkpoint = CheckpointRef(
                    chain_id=info.chain_id,
                    seq=info.seq,
                    head_hash=info.head_hash,
                    signature=info.signature,
                )

        def write(s: Session) -> None:
            now = utcnow()
            if outcome is not None:
                state, detail = outcome
                if isinstance(detail, LedgerDetail):
                    detail = detail.model_copy(update={"checkpoint": checkpoint})
                stored = detail.model_dump(mode="json")
                if not jobs.finish_step(
                    s, ledger_step.id, state, stored, now=now, attempt=ledger_step.attempts
                ):
                    return  # claimed again since: the later attempt finishes the job
            job = jobs.load_job(s, job_id)
            # the rows are mutable, the chained purge:step events are not: a step the chain does
            # not bear out is not done, and none of its stored figures is signed
            job, _ = cross_check(job, chained_steps(s, job.id, job.tenant, self._trusted))
            # an engine that moved between sidecars: unreachable on one, acknowledged with the
            # same EVICT on another, is reached (the rows keep what each step saw)
            job = count_acks_elsewhere(job)
            final = final_state(job.steps) if outcome is not None else PurgeState.FAILED
            receipt = build_receipt(job, final, finished_at=now.isoformat())
            signed = sign_receipt(receipt, self._signing_key)
            result = {
                "state": str(final),
                "tiers": receipt.tiers,
                "incomplete": list(receipt.incomplete),
            }
            jobs.finish_job(
                s,
                job_id,
                state=final,
                result=result,
                receipt=signed,
                signature=base64.b64decode(signed["signature"]["value"]),
                now=now,
            )

        try:
            await self.ctx.db(write)
        except PurgeError:
            # already finished, or a receipt row was put there first (the runtime role may
            # INSERT receipts): nothing is signed or overwritten a second time, and the job is
            # closed ``failed`` so that its final step is not claimed (and run) again for ever
            log.error("purge.finish.refused", extra={"purge_id": job_id})
            await self.ctx.db(lambda s: jobs.close_refused(s, job_id, ledger_step.id, now=utcnow()))
            await self.lift_fences()
            return
        log.info("purge.finished", extra={"purge_id": job_id})
        await self.lift_fences()


def build_receipt(job: JobView, state: PurgeState, *, finished_at: str) -> Receipt:
    """The receipt document (unsigned) from the job's steps, each detail read as its model."""
    tiers: dict[str, int] = {}
    keys: list[KeyDestroyed] = []
    acked: list[str] = []
    unreachable: list[EngineFailure] = []
    gpu: list[GpuReset] = []
    incomplete: list[str] = []
    sidecars_done: list[str] = []
    entries_in_scope = 0
    newly_purged = 0
    verified = True
    ledger: LedgerOutcome | None = None
    for step in job.steps:
        d = read_detail(step.name, step.detail)
        done = step.state is PurgeState.COMPLETED
        if not done and step.name is not StepName.LEDGER:
            incomplete.append(f"{step.label}: {d.reason or d.error or 'did not complete'}")
        if d.not_taken is True and step.sidecar_id:
            unreachable.append(EngineFailure(engine=f"sidecar:{step.sidecar_id}", error=d.reason))
        if step.name is StepName.TIERS:
            if isinstance(d, TiersDetail):
                for name, n in d.deleted.items():
                    tiers[name] = tiers.get(name, 0) + n
                entries_in_scope = max(entries_in_scope, d.entries_in_scope)
                newly_purged = max(newly_purged, d.newly_purged)
            verified = verified and (d.verified if isinstance(d, TiersDetail) else done)
            if step.sidecar_id and done:
                sidecars_done.append(step.sidecar_id)
        elif isinstance(d, KeysDetail):
            keys.extend(d.destroyed)
        elif isinstance(d, EnginesDetail):
            acked.extend(d.acknowledged)
            unreachable.extend(EngineFailure(engine=u.engine, error=u.error) for u in d.unreachable)
        elif isinstance(d, GpuDetail):
            gpu.extend(d.results)
        elif step.name is StepName.LEDGER:
            ledger = LedgerOutcome()
            if isinstance(d, LedgerDetail):
                ledger = LedgerOutcome(
                    payloads_erased=d.payloads_erased,
                    users_erased=d.users_erased,
                    erasure_event=d.erasure_event,
                    payload_event=d.payload_event,
                    checkpoint=d.checkpoint,
                )
            if not done:
                incomplete.append(f"ledger: {d.error or 'did not complete'}")
    for e in unreachable:
        if e.engine and not any(e.engine in line for line in incomplete):
            incomplete.append(f"engine {e.engine} did not acknowledge: {e.error}")
    return Receipt(
        purge_id=job.id,
        state=str(state),
        kind=str(job.kind),
        tenant=job.tenant,
        subject=job.subject,
        scope=ReceiptScope(
            tenant=job.tenant,
            subject=job.subject,
            rule="every entry of the tenant"
            if job.subject is None
            else "entries of the tenant owned by, scoped to, or put by the subject",
        ),
        requested_by=job.requested_by,
        requested_at=job.created_at.isoformat(),
        finished_at=finished_at,
        entries_in_scope=entries_in_scope,
        entries_purged=newly_purged,
        tiers=tiers,
        tiers_verified_absent=verified,
        keys_destroyed=tuple(keys),
        engines=EnginesOutcome(
            acknowledged=tuple(sorted(set(acked))), unreachable=tuple(unreachable)
        ),
        gpu_reset=tuple(gpu),
        sidecars=tuple(sorted(set(sidecars_done))),
        ledger=ledger,
        incomplete=tuple(incomplete),
    )

"""Typed compliance documents of the purge: the receipt, the dry-run plan, step details, jobs.

A :class:`Receipt` is what ``kvgov purge`` prints, ``/v1/purges/{id}/receipt`` returns and the
ledger's key signs. The signature covers :meth:`Receipt.document` in canonical JSON
(:func:`kvgov.services.purge.receipts.canonical`): that document is byte for byte the one the
earlier ``dict`` builder produced (``tests/unit/test_purge_receipt_documents.py`` holds goldens),
so receipts signed before these models still verify and parse. Models are frozen and refuse
unknown fields; a field added here changes the signed format and needs a new ``format``.

Each step executor returns its detail as a model (:class:`TiersDetail`, :class:`KeysDetail`,
:class:`EnginesDetail`, :class:`GpuDetail`, :class:`LedgerDetail`, all :class:`StepDetail`
with ``executed_by``); ``purge_steps.detail`` stores its ``model_dump(mode="json")``, the JSON
the earlier ``dict`` details had, key for key (an optional key is left out while unset, as
before). A stored detail is read back with :func:`read_detail`: the step's model once its
executor finished it (``executed_by`` is there), else a bare :class:`StepDetail` (pending
``{}``, a retried ``error``, ``not_taken`` with its ``reason``). :class:`PurgeJobDocument` is one
job with its typed steps, the one shape ``GET /v1/purges/{id}`` and ``kvgov purge status --json``
print, with the job's chained late evictions (:class:`LateEviction`, read-only: never in the
receipt).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvgov.db.purge_views import JobView, StepName
from kvgov.ledger.events import JSONValue
from kvgov.ledger.purge_trail import ChainedLateEviction
from kvgov.types import PurgeKind, PurgeState

RECEIPT_FORMAT: Final = "kvgov-purge-receipt/1"


class _Document(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ReceiptScope(_Document):
    tenant: str
    subject: str | None
    rule: str


class KeyDestroyed(_Document):
    key_id: str
    version: int


class EngineFailure(_Document):
    """An engine (or a sidecar, ``sidecar:<id>``) that did not acknowledge its part."""

    engine: str | None
    error: str | None


class EnginesOutcome(_Document):
    acknowledged: tuple[str, ...]
    unreachable: tuple[EngineFailure, ...]


class GpuReset(_Document):
    engine: str
    ok: bool
    status: int | None
    error: str | None


class EventRef(_Document):
    """A ledger event by its position: chain and sequence number."""

    chain_id: str
    seq: int


class CheckpointRef(_Document):
    chain_id: str
    seq: int
    head_hash: str
    signature: str


class LedgerOutcome(_Document):
    payloads_erased: int = 0
    users_erased: int = 0
    erasure_event: EventRef | None = None
    payload_event: EventRef | None = None
    checkpoint: CheckpointRef | None = None


class Receipt(_Document):
    """The signed account of one purge: scope, what was deleted and verified, who did not answer."""

    format: Literal["kvgov-purge-receipt/1"] = RECEIPT_FORMAT
    purge_id: str
    state: str
    kind: str
    tenant: str
    subject: str | None
    scope: ReceiptScope
    requested_by: str
    requested_at: str
    finished_at: str
    entries_in_scope: int
    entries_purged: int
    tiers: dict[str, int]
    tiers_verified_absent: bool
    keys_destroyed: tuple[KeyDestroyed, ...]
    engines: EnginesOutcome
    gpu_reset: tuple[GpuReset, ...]
    sidecars: tuple[str, ...]
    #: ``None`` when no ledger step ran; the document writes it ``{}`` (as it always has)
    ledger: LedgerOutcome | None
    incomplete: tuple[str, ...]

    @field_validator("ledger", mode="before")
    @classmethod
    def _empty_ledger(cls, value: object) -> object:
        return None if value == {} else value

    def document(self) -> dict[str, object]:
        """The JSON object the signature covers (and the API and the CLI show)."""
        out = self.model_dump(mode="json")
        if out["ledger"] is None:
            out["ledger"] = {}
        return out


class PurgePlan(_Document):
    """What a purge would delete, changing nothing (``--dry-run``, ``dry_run: true``)."""

    dry_run: Literal[True] = True
    kind: str
    tenant: str
    subject: str | None
    entries_in_scope: int
    entries_by_state: dict[str, int]
    bytes_in_scope: int
    present_in_reachable_tiers: dict[str, int]
    keys_to_destroy: tuple[KeyDestroyed, ...]
    payloads_to_erase: int
    sidecars: tuple[str, ...] | None = Field(
        description="the live sidecars that would be asked (their ids); null for a "
        "tenant-scoped token: the fleet's make-up is not a tenant's to see (`sidecar_count`)"
    )
    vllm_engines: tuple[str, ...] | None = Field(
        description="the vLLM engines whose GPU prefix cache would be reset (their URLs); null "
        "for a tenant-scoped token (`vllm_engine_count`)"
    )
    sidecar_count: int = Field(default=0, description="how many live sidecars would be asked")
    vllm_engine_count: int = Field(
        default=0, description="how many vLLM engines this node would reset"
    )
    #: whether the ledger has seen this user id act in the tenant (None: a tenant purge). A
    #: purge matches the id exactly as the gateway sent it: an id the ledger never saw is most
    #: likely misspelt, and its purge finds nothing
    subject_known: bool | None = None
    #: how many other spellings of the id (case, surrounding spaces, Unicode form) the ledger
    #: has seen act in the tenant: the id the operator probably meant
    spelling_variants_known: int = 0


# -- step details ------------------------------------------------------------------------------


def _unset(value: object) -> bool:
    return value is None


#: who ran a finished step: ``sidecar:<id>`` or the CLI's principal
ExecutedBy = Annotated[str, Field(description="the principal whose executor ran the step")]


class StepDetail(_Document):
    """What any step's stored detail may say. Alone, the detail of a step no executor finished:
    ``{}`` (pending), ``error`` (an attempt raised: retried, or ``failed``), ``not_taken`` with
    its ``reason`` (the job timed out before an executor took it). Unset keys are not written."""

    executed_by: str | None = Field(
        default=None, exclude_if=_unset, description="the principal whose executor ran the step"
    )
    reason: str | None = Field(
        default=None, exclude_if=_unset, description="why the step is not completed"
    )
    error: str | None = Field(
        default=None, exclude_if=_unset, description="the error of the last attempt that raised"
    )
    not_taken: bool | None = Field(
        default=None,
        exclude_if=_unset,
        description="true: no executor finished the step before the job timed out",
    )

    def summary(self) -> dict[str, JSONValue]:
        """The chained part of the step's ``purge:step`` event: counts and names, no digests."""
        return {}


class TiersDetail(StepDetail):
    """``tiers`` / ``tiers@S``: the subject's entries deleted from every tier reached."""

    executed_by: ExecutedBy
    tiers: tuple[str, ...] = Field(description="the tiers this executor reached")
    deleted: dict[str, int] = Field(description="objects deleted per tier")
    entries_in_scope: int
    newly_purged: int = Field(description="entries this step moved to purged")
    verified: bool = Field(description="every tier answered that none of the entries is left")
    keys_forgotten: int = Field(description="in-memory data key copies this sidecar dropped")
    still_present: dict[str, int] | None = Field(
        default=None, exclude_if=_unset, description="entries a tier still held after delete"
    )

    def summary(self) -> dict[str, JSONValue]:
        return {
            "deleted": dict(self.deleted),
            "entries_in_scope": self.entries_in_scope,
            "newly_purged": self.newly_purged,
            "verified": self.verified,
        }


class KeysDetail(StepDetail):
    """``keys``: the data key versions crypto-shredded."""

    executed_by: ExecutedBy
    destroyed: tuple[KeyDestroyed, ...]

    def summary(self) -> dict[str, JSONValue]:
        # the versions by name (each is also chained as its own ``key:shredded`` event): a
        # receipt naming other keys than were shredded disagrees with the chain
        return {
            "keys_destroyed": len(self.destroyed),
            "destroyed": [[k.key_id, k.version] for k in self.destroyed],
        }


class EngineAnswer(_Document):
    """One engine connection's answer to EVICT (``acked`` with no ``error`` is a success)."""

    engine: str
    acked: bool
    removed: int = Field(description="entries the engine removed from its local tiers")
    error: str | None


class EnginesDetail(StepDetail):
    """``engines@S``: EVICT sent to the engines of sidecar S that may hold the tenant's data."""

    executed_by: ExecutedBy
    digests_sent: int | None = Field(
        default=None, exclude_if=_unset, description="distinct key digests sent in EVICT"
    )
    #: rows written before EVICT went by digest (7b47158) counted the entries instead
    keys_known: int | None = Field(
        default=None, exclude_if=_unset, description="entries known (details before digests)"
    )
    acknowledged: tuple[str, ...] = Field(description="engines that evicted")
    removed: dict[str, int] = Field(description="entries removed per engine")
    unreachable: tuple[EngineAnswer, ...] = Field(
        description="engines that did not answer, or answered with an error"
    )
    #: rows written before it (an ACK elsewhere cannot be matched to them) have none
    digests_hash: str | None = Field(
        default=None,
        exclude_if=_unset,
        description="SHA-256 of the sorted key digests sent (digest_set_hash): two steps of "
        "a job with the same hash sent the same EVICT",
    )

    def summary(self) -> dict[str, JSONValue]:
        out: dict[str, JSONValue] = {
            "acknowledged": list(self.acknowledged),
            "unreachable": [u.engine for u in self.unreachable],
        }
        if self.digests_hash is not None:  # chained: an ACK counts elsewhere on its strength
            out["digests_hash"] = self.digests_hash
        return out


def digest_set_hash(key_digests: Iterable[str]) -> str:
    """What an ``engines`` step records of the digests it sent (:attr:`EnginesDetail.
    digests_hash`): the SHA-256 of the distinct digests, sorted, one per line. It names no
    digest; equal hashes mean the same EVICT."""
    joined = "\n".join(sorted(set(key_digests)))
    return hashlib.sha256(joined.encode()).hexdigest()


class GpuDetail(StepDetail):
    """``gpu``: each configured vLLM engine's answer to ``POST /reset_prefix_cache``."""

    executed_by: ExecutedBy
    results: tuple[GpuReset, ...]

    def summary(self) -> dict[str, JSONValue]:
        # which engines were reset and which not, by name: the receipt lists them
        return {
            "reset": [r.engine for r in self.results if r.ok],
            "not_reset": [r.engine for r in self.results if not r.ok],
        }


class LedgerDetail(StepDetail):
    """``ledger``: the subject's payloads erased, the erasure recorded and checkpointed."""

    executed_by: ExecutedBy
    payloads_erased: int
    users_erased: int
    payload_event: EventRef
    erasure_event: EventRef
    #: signed after the erasure event is durable (null: no checkpointer, or it signed nothing)
    checkpoint: CheckpointRef | None = None


#: the model of each step's detail once its executor finished it
DETAIL_MODELS: Final[Mapping[StepName, type[StepDetail]]] = {
    StepName.TIERS: TiersDetail,
    StepName.KEYS: KeysDetail,
    StepName.ENGINES: EnginesDetail,
    StepName.GPU: GpuDetail,
    StepName.LEDGER: LedgerDetail,
}

#: any stored detail; each JSON object fits exactly one member (required keys, no extra keys)
AnyStepDetail = TiersDetail | KeysDetail | EnginesDetail | GpuDetail | LedgerDetail | StepDetail


def read_detail(name: StepName, stored: Mapping[str, object] | None) -> StepDetail:
    """A stored ``purge_steps.detail`` as its model (see the module docstring)."""
    data = dict(stored or {})
    model = DETAIL_MODELS[name] if "executed_by" in data else StepDetail
    return model.model_validate(data)


# -- jobs --------------------------------------------------------------------------------------

_JOB_ID = "0b7d4f0e-6a3c-4d8e-9b61-2f1c5a7e9d30"


class PurgeStepDocument(_Document):
    """One step of a purge job: where it runs, its state and what it did."""

    name: StepName
    sidecar_id: str | None = Field(description="the sidecar whose step it is (null: any executor)")
    state: PurgeState
    attempts: int
    detail: AnyStepDetail = Field(description="what the step did, or why it did not")
    started_at: datetime | None
    finished_at: datetime | None


class LateEviction(_Document):
    """An EVICT of this job an engine acknowledged after its ``engines@S`` step, once its
    control channel was back: a chained ``purge:evict:late`` event. The signed receipt is not
    changed by it (it still names the engine unreachable); this is the record that the engine
    was reached afterwards."""

    engine: str = Field(description="the engine that acknowledged the EVICT")
    removed: int = Field(description="entries the engine removed from its local tiers")
    digests: int = Field(description="key digests it was sent")
    recorded_at: datetime = Field(description="when the sidecar chained the acknowledgement")


class PurgeJobDocument(_Document):
    """A purge job with its steps and, once finished, its signed receipt."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "id": _JOB_ID,
                    "kind": "user",
                    "tenant": "acme",
                    "subject": "3f9c2a51b0d84e6f9a7c11d2e8b45a90",
                    "state": "completed",
                    "dry_run": False,
                    "requested_by": "token:5b0c8a8e",
                    "created_at": "2026-11-21T10:15:02Z",
                    "updated_at": "2026-11-21T10:15:04Z",
                    "finished_at": "2026-11-21T10:15:04Z",
                    "result": {"state": "completed", "tiers": {"memory": 12}, "incomplete": []},
                    "steps": [
                        {
                            "name": "keys",
                            "sidecar_id": None,
                            "state": "completed",
                            "attempts": 1,
                            "detail": {
                                "executed_by": "sidecar:node-1",
                                "destroyed": [
                                    {
                                        "key_id": "u:acme:3f9c2a51b0d84e6f9a7c11d2e8b45a90",
                                        "version": 1,
                                    }
                                ],
                            },
                            "started_at": "2026-11-21T10:15:02Z",
                            "finished_at": "2026-11-21T10:15:02Z",
                        }
                    ],
                    "receipt": None,
                    "late_evictions": [],
                }
            ]
        }
    )

    id: str
    kind: PurgeKind
    tenant: str
    subject: str | None = Field(description="pseudonym of the erased user")
    state: PurgeState
    dry_run: bool
    requested_by: str
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None
    result: dict[str, Any] | None
    steps: tuple[PurgeStepDocument, ...]
    receipt: dict[str, Any] | None = Field(description="the signed receipt once finished")
    late_evictions: tuple[LateEviction, ...] = Field(
        default=(),
        description=(
            "EVICTs engines acknowledged after their step (chained purge:evict:late events), "
            "oldest first; the receipt is not changed by them"
        ),
    )


def job_document(job: JobView, late: Iterable[ChainedLateEviction] = ()) -> PurgeJobDocument:
    """The job as the API and the CLI show it, each step's detail read through its model, with
    its chained late evictions (:func:`kvgov.ledger.purge_trail.late_evictions`)."""
    return PurgeJobDocument(
        id=job.id,
        kind=job.kind,
        tenant=job.tenant,
        subject=job.subject,
        state=job.state,
        dry_run=job.dry_run,
        requested_by=job.requested_by,
        created_at=job.created_at,
        updated_at=job.updated_at,
        finished_at=job.finished_at,
        result=job.result,
        steps=tuple(
            PurgeStepDocument(
                name=s.name,
                sidecar_id=s.sidecar_id,
                state=s.state,
                attempts=s.attempts,
                detail=read_detail(s.name, s.detail),
                started_at=s.started_at,
                finished_at=s.finished_at,
            )
            for s in job.steps
        ),
        receipt=job.receipt,
        late_evictions=tuple(
            LateEviction(
                engine=e.engine, removed=e.removed, digests=e.digests, recorded_at=e.recorded_at
            )
            for e in late
        ),
    )

"""Typed compliance documents of the purge: the receipt and its parts.

A :class:`Receipt` is what ``kvgov purge`` prints, ``/v1/purges/{id}/receipt`` returns and the
ledger's key signs. The signature covers :meth:`Receipt.document` in canonical JSON
(:func:`kvgov.services.purge.receipts.canonical`): that document is byte for byte the one the
earlier ``dict`` builder produced (``tests/unit/test_purge_receipt_documents.py`` holds goldens),
so receipts signed before these models still verify and parse. Models are frozen and refuse
unknown fields; a field added here changes the signed format and needs a new ``format``.
"""

from __future__ import annotations

from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, field_validator

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
    sidecars: tuple[str, ...]
    vllm_engines: tuple[str, ...]

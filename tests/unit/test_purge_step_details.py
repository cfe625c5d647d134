"""Typed purge step details store and read the JSON the ``dict`` details had, key for key.

Every sample below is a detail as the dict-building executors (before the models) wrote it to
``purge_steps.detail``, or as ``fail_step`` / the job timeout left it. Read back through
:func:`read_detail` each one is its step's model (or a bare :class:`StepDetail` when no executor
finished the step) and dumps to exactly the stored JSON; the ``purge:step`` event's summary is
what the dict ``_summary`` (kept below as the reference) made of it, and since the receipt is
cross-checked with the chain, also the destroyed key versions and the GPU engines by name.
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from kvgov.db.purge_views import StepName
from kvgov.services.purge.documents import (
    EnginesDetail,
    EventRef,
    GpuDetail,
    KeysDetail,
    LedgerDetail,
    PurgeStepDocument,
    StepDetail,
    TiersDetail,
    read_detail,
)
from kvgov.types import PurgeState

TIERS = {
    "tiers": ["memory", "filesystem"],
    "deleted": {"memory": 2, "filesystem": 2},
    "entries_in_scope": 2,
    "newly_purged": 2,
    "verified": True,
    "keys_forgotten": 1,
    "executed_by": "sidecar:node-1",
}
TIERS_LEFT = {
    **TIERS,
    "verified": False,
    "still_present": {"memory": 1},
    "reason": "entries still present after delete: {'memory': 1}",
}
KEYS = {"destroyed": [{"key_id": "u:acme:abc", "version": 1}], "executed_by": "cli"}
ENGINES = {
    "digests_sent": 5,
    "acknowledged": ["engine-a", "engine-b"],
    "removed": {"engine-a": 5, "engine-b": 3},
    "unreachable": [],
    "executed_by": "sidecar:node-1",
}
ENGINES_MISSING = {
    "digests_sent": 5,
    "acknowledged": [],
    "removed": {},
    "unreachable": [{"engine": "engine-c", "acked": False, "removed": 0, "error": "timeout"}],
    "reason": "no successful EVICT acknowledgement from engine-c (timeout)",
    "executed_by": "sidecar:node-1",
}
#: before EVICT went by key digest (7b47158) the engines step counted entries as keys_known
ENGINES_OLD = {
    "keys_known": 4,
    "acknowledged": ["engine-a"],
    "removed": {"engine-a": 4},
    "unreachable": [],
    "executed_by": "sidecar:node-1",
}
GPU = {
    "results": [{"engine": "http://vllm-0:8000", "ok": False, "status": 503, "error": "busy"}],
    "reason": "GPU prefix cache not reset on http://vllm-0:8000 (503)",
    "executed_by": "cli",
}
LEDGER = {
    "payloads_erased": 3,
    "users_erased": 1,
    "payload_event": {"chain_id": "c1", "seq": 10},
    "erasure_event": {"chain_id": "c1", "seq": 11},
    "executed_by": "cli",
    "checkpoint": {"chain_id": "c1", "seq": 11, "head_hash": "ab" * 32, "signature": "c2ln"},
}
LEDGER_NO_CHECKPOINT = {**LEDGER, "checkpoint": None}

RAN: list[tuple[StepName, dict[str, Any], type[StepDetail]]] = [
    (StepName.TIERS, TIERS, TiersDetail),
    (StepName.TIERS, TIERS_LEFT, TiersDetail),
    (StepName.KEYS, KEYS, KeysDetail),
    (StepName.ENGINES, ENGINES, EnginesDetail),
    (StepName.ENGINES, ENGINES_MISSING, EnginesDetail),
    (StepName.ENGINES, ENGINES_OLD, EnginesDetail),
    (StepName.GPU, GPU, GpuDetail),
    (StepName.LEDGER, LEDGER, LedgerDetail),
    (StepName.LEDGER, LEDGER_NO_CHECKPOINT, LedgerDetail),
    # an executor whose lease ran out finished late with an error after another finished it
    (StepName.KEYS, {**KEYS, "error": "OperationalError: gone"}, KeysDetail),
]
NOT_RUN: list[dict[str, Any]] = [
    {},  # pending or running
    {"error": "TierError: redis down"},  # an attempt raised: retried, or failed
    {
        "not_taken": True,
        "reason": "sidecar node-2 did not finish this step before the job timed out",
    },
    {
        "error": "TierError: redis down",
        "not_taken": True,
        "reason": "no executor did not finish this step before the job timed out",
    },
]


def dict_summary(detail: dict[str, Any]) -> dict[str, Any]:
    """The ``purge:step`` summary as the dict executors made it (before the models)."""
    keep = ("deleted", "entries_in_scope", "newly_purged", "verified", "acknowledged")
    out: dict[str, Any] = {k: detail[k] for k in keep if k in detail}
    if "destroyed" in detail:
        out["keys_destroyed"] = len(detail["destroyed"])
        out["destroyed"] = [[k["key_id"], k["version"]] for k in detail["destroyed"]]
    if "results" in detail:
        out["reset"] = [r["engine"] for r in detail["results"] if r["ok"]]
        out["not_reset"] = [r["engine"] for r in detail["results"] if not r["ok"]]
    if "unreachable" in detail and isinstance(detail["unreachable"], list):
        out["unreachable"] = [u.get("engine") for u in detail["unreachable"]]
    return out


@pytest.mark.parametrize(("name", "stored", "model"), RAN)
def test_a_finished_steps_detail_reads_as_its_model_and_dumps_to_the_stored_json(
    name: StepName, stored: dict[str, Any], model: type[StepDetail]
) -> None:
    detail = read_detail(name, stored)
    assert type(detail) is model
    assert detail.model_dump(mode="json") == stored
    assert detail.summary() == dict_summary(stored)


@pytest.mark.parametrize("stored", NOT_RUN)
@pytest.mark.parametrize("name", list(StepName))
def test_an_unfinished_steps_detail_is_a_bare_step_detail(
    name: StepName, stored: dict[str, Any]
) -> None:
    detail = read_detail(name, stored)
    assert type(detail) is StepDetail
    assert detail.model_dump(mode="json") == stored


def test_a_missing_detail_reads_as_empty() -> None:
    assert read_detail(StepName.GPU, None) == StepDetail()


def test_executors_models_write_the_dict_shape() -> None:
    tiers = TiersDetail(
        executed_by="sidecar:node-1",
        tiers=("memory", "filesystem"),
        deleted={"memory": 2, "filesystem": 2},
        entries_in_scope=2,
        newly_purged=2,
        verified=True,
        keys_forgotten=1,
    )
    assert tiers.model_dump(mode="json") == TIERS  # no still_present, no reason: not written
    ledger = LedgerDetail(
        executed_by="cli",
        payloads_erased=3,
        users_erased=1,
        payload_event=EventRef(chain_id="c1", seq=10),
        erasure_event=EventRef(chain_id="c1", seq=11),
    )
    assert ledger.model_dump(mode="json") == LEDGER_NO_CHECKPOINT  # checkpoint: always written


def test_details_are_frozen_and_refuse_unknown_or_missing_keys() -> None:
    detail = read_detail(StepName.KEYS, KEYS)
    with pytest.raises(ValidationError):
        detail.executed_by = "someone else"  # type: ignore[misc]
    with pytest.raises(ValidationError):
        read_detail(StepName.KEYS, {**KEYS, "surprise": 1})
    with pytest.raises(ValidationError):
        read_detail(StepName.TIERS, {"executed_by": "cli", "deleted": {}})
    with pytest.raises(ValidationError):
        read_detail(StepName.GPU, {"results": []})  # a result without its executor


@pytest.mark.parametrize(("name", "stored", "model"), [*RAN, (StepName.GPU, {}, StepDetail)])
def test_a_step_document_parsed_from_json_finds_the_one_model_its_detail_fits(
    name: StepName, stored: dict[str, Any], model: type[StepDetail]
) -> None:
    step = {
        "name": str(name),
        "sidecar_id": None,
        "state": "completed",
        "attempts": 1,
        "detail": stored,
        "started_at": None,
        "finished_at": None,
    }
    parsed = PurgeStepDocument.model_validate(step)
    assert type(parsed.detail) is model
    assert parsed.state is PurgeState.COMPLETED
    assert parsed.model_dump(mode="json") == step

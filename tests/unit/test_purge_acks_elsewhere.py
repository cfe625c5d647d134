"""An engine one ``engines@S`` step could not reach counts as reached when another step of the
job acknowledged it with the same EVICT (:mod:`kvgov.services.purge.reached`), and only then.

The two-sidecar run is ``tests/security/test_purge_engine_moved.py``.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from kvgov.db.purge_views import JobView, StepName, StepView
from kvgov.services.purge.documents import EngineAnswer, EnginesDetail, digest_set_hash
from kvgov.services.purge.reached import count_acks_elsewhere
from kvgov.services.purge.service import build_receipt
from kvgov.types import PurgeKind, PurgeState

SENT = digest_set_hash(["a" * 64, "b" * 64])
NOW = datetime(2026, 1, 1, tzinfo=UTC)


def _engines(
    sid: int, acked: list[str], missing: list[tuple[str, str]], hashed: str | None = SENT
) -> StepView:
    answers = tuple(
        EngineAnswer(engine=e, acked=error == "no_digest_key", removed=0, error=error)
        for e, error in missing
    )
    detail = EnginesDetail(
        executed_by=f"sidecar:s{sid}",
        digests_sent=2,
        acknowledged=tuple(acked),
        removed=dict.fromkeys(acked, 1),
        unreachable=answers,
        reason="x" if answers else None,
        digests_hash=hashed,
    )
    state = PurgeState.INCOMPLETE if answers else PurgeState.COMPLETED
    dumped: dict[str, Any] = detail.model_dump(mode="json")
    return StepView(sid, StepName.ENGINES, f"s{sid}", state, 1, dumped, NOW, NOW)


def _job(*steps: StepView) -> JobView:
    return JobView(
        "job",
        PurgeKind.USER,
        "acme",
        "u",
        PurgeState.RUNNING,
        False,
        "t",
        NOW,
        NOW,
        None,
        None,
        list(steps),
    )


def _engines_outcome(job: JobView) -> dict[str, Any]:
    receipt = build_receipt(count_acks_elsewhere(job), PurgeState.COMPLETED, finished_at="x")
    return receipt.engines.model_dump(mode="json")


def test_an_engine_acknowledged_with_the_same_evict_elsewhere_is_reached() -> None:
    job = _job(_engines(1, [], [("vllm-a", "no_control_connection")]), _engines(2, ["vllm-a"], []))
    read = count_acks_elsewhere(job)
    assert [s.state for s in read.steps] == [PurgeState.COMPLETED, PurgeState.COMPLETED]
    assert _engines_outcome(job) == {"acknowledged": ["vllm-a"], "unreachable": []}
    assert job.steps[0].state is PurgeState.INCOMPLETE  # the rows are not changed


def test_an_ack_of_another_evict_or_of_another_engine_does_not_count() -> None:
    other = digest_set_hash(["a" * 64])
    for second in (
        _engines(2, ["vllm-a"], [], hashed=other),  # it sent other digests
        _engines(2, ["vllm-a"], [], hashed=None),  # a row from before the hash
        _engines(2, ["vllm-b"], []),  # another engine
    ):
        first = _engines(1, [], [("vllm-a", "TimeoutError")])
        job = _job(first, second)
        assert count_acks_elsewhere(job) is job
        assert [u["engine"] for u in _engines_outcome(job)["unreachable"]] == ["vllm-a"]


def test_an_engine_that_answered_with_an_error_stays_named() -> None:
    """It said it cannot evict (``no_digest_key``): an operator must look, whatever else."""
    job = _job(_engines(1, [], [("vllm-a", "no_digest_key")]), _engines(2, ["vllm-a"], []))
    assert count_acks_elsewhere(job) is job


def test_a_step_keeps_the_engines_no_one_reached() -> None:
    first = _engines(1, [], [("vllm-a", "no_control_connection"), ("vllm-c", "TimeoutError")])
    job = _job(first, _engines(2, ["vllm-a"], []))
    (step, _) = count_acks_elsewhere(job).steps
    assert step.state is PurgeState.INCOMPLETE
    assert [u["engine"] for u in step.detail["unreachable"]] == ["vllm-c"]
    assert step.detail["reason"] == "no successful EVICT acknowledgement from vllm-c (TimeoutError)"

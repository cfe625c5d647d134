"""The queue of EVICTs a sidecar owes engines (:mod:`kvgov.proxy.purge.owed`): per engine, bounded
in digests and in time, the oldest going first, and what the purge step puts in it.

The delivery over real control connections, the ledger event and the bounds in a running
sidecar are shown by ``tests/security/test_purge_late_evict.py``.
"""

from __future__ import annotations

import pytest

from kvgov.proxy.purge.owed import DROPPED_MAX, DROPPED_TTL, Debt, OwedEvictions
from kvgov.services.purge.documents import EngineAnswer
from kvgov.services.purge.steps import owed_engines


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _digests(n: int, tag: str = "a") -> list[str]:
    return [f"{tag}{i:063x}" for i in range(n)]


@pytest.fixture
def clock() -> Clock:
    return Clock()


def _queue(clock: Clock, dropped: list[tuple[Debt, str]], **kw: float) -> OwedEvictions:
    args = {"max_digests": 10, "ttl_s": 60.0, **kw}
    return OwedEvictions(
        max_digests=int(args["max_digests"]),
        ttl_s=args["ttl_s"],
        on_drop=lambda d, why: dropped.append((d, why)),
        clock=clock,
    )


def test_each_engine_is_owed_only_its_own(clock: Clock) -> None:
    q = _queue(clock, [])
    q.owe("job-1", "acme", ["vllm-a"], _digests(2))
    q.owe("job-2", "acme", ["vllm-a", "vllm-b"], _digests(3, "b"))
    assert [(d.job_id, d.size) for d in q.due("vllm-a")] == [("job-1", 2), ("job-2", 3)]
    assert [(d.job_id, d.size) for d in q.due("vllm-b")] == [("job-2", 3)]
    assert q.due("vllm-c") == []
    assert q.total == 8
    assert q.engines() == {"vllm-a", "vllm-b"}


def test_a_debt_holds_the_digests_once_sorted_and_no_more(clock: Clock) -> None:
    q = _queue(clock, [])
    (debt,) = q.owe("job-1", "acme", ["vllm-a"], ["b" * 64, "a" * 64, "b" * 64])
    assert debt.digests == ("a" * 64, "b" * 64)
    assert set(Debt.__slots__) == {"engine", "job_id", "tenant", "digests", "since"}


def test_nothing_is_owed_for_no_digests(clock: Clock) -> None:
    q = _queue(clock, [])
    assert q.owe("job-1", "acme", ["vllm-a"], []) == []
    assert q.total == 0 and q.engines() == set()


def test_a_step_run_again_replaces_what_its_job_owed(clock: Clock) -> None:
    q = _queue(clock, [])
    (first,) = q.owe("job-1", "acme", ["vllm-a"], _digests(2))
    (second,) = q.owe("job-1", "acme", ["vllm-a"], _digests(3))
    assert q.due("vllm-a") == [second] and q.total == 3
    assert not q.settle(first)  # the older debt's ACK does not settle the newer one
    assert q.total == 3
    assert q.settle(second)
    assert q.total == 0 and q.due("vllm-a") == []


def test_past_the_digest_cap_the_oldest_go_first(clock: Clock) -> None:
    dropped: list[tuple[Debt, str]] = []
    q = _queue(clock, dropped, max_digests=5)
    q.owe("job-1", "acme", ["vllm-a"], _digests(2))
    q.owe("job-2", "acme", ["vllm-b"], _digests(2, "b"))
    q.owe("job-3", "acme", ["vllm-a"], _digests(3, "c"))
    assert [(d.job_id, why) for d, why in dropped] == [("job-1", DROPPED_MAX)]
    assert q.total == 5
    assert [d.job_id for d in q.due("vllm-a")] == ["job-3"]


def test_a_debt_larger_than_the_cap_is_not_kept_and_drops_nothing_else(clock: Clock) -> None:
    dropped: list[tuple[Debt, str]] = []
    q = _queue(clock, dropped, max_digests=5)
    q.owe("job-1", "acme", ["vllm-a"], _digests(2))
    assert q.owe("job-2", "acme", ["vllm-a"], _digests(6, "b")) == []
    assert [(d.job_id, d.size, why) for d, why in dropped] == [("job-2", 6, DROPPED_MAX)]
    assert [d.job_id for d in q.due("vllm-a")] == ["job-1"]


def test_a_cap_of_zero_keeps_nothing(clock: Clock) -> None:
    dropped: list[tuple[Debt, str]] = []
    q = _queue(clock, dropped, max_digests=0)
    assert q.owe("job-1", "acme", ["vllm-a", "vllm-b"], _digests(1)) == []
    assert len(dropped) == 2 and q.total == 0


def test_past_their_lifetime_debts_are_dropped(clock: Clock) -> None:
    dropped: list[tuple[Debt, str]] = []
    q = _queue(clock, dropped, ttl_s=60.0)
    q.owe("job-1", "acme", ["vllm-a"], _digests(2))
    clock.now += 30
    q.owe("job-2", "acme", ["vllm-a"], _digests(1, "b"))
    clock.now += 29.9
    assert len(q.due("vllm-a")) == 2 and not dropped
    clock.now += 0.2
    assert [d.job_id for d in q.due("vllm-a")] == ["job-2"]  # due() prunes first
    assert [(d.job_id, why) for d, why in dropped] == [("job-1", DROPPED_TTL)]
    clock.now += 60
    assert [d.job_id for d in q.prune()] == ["job-2"]
    assert q.total == 0


def test_the_step_owes_the_engines_that_were_sent_nothing_or_gave_no_ack() -> None:
    """Not an engine that acknowledged with an error (it answered that it cannot evict), nor
    the ``lm://`` engine (no control channel to come back on)."""
    answers = [
        EngineAnswer(engine="down", acked=False, removed=0, error="no_control_connection"),
        EngineAnswer(engine="slow", acked=False, removed=0, error="TimeoutError"),
        EngineAnswer(engine="gone", acked=False, removed=0, error="ConnectionClosed"),
        EngineAnswer(engine="nokey", acked=True, removed=0, error="no_digest_key"),
        EngineAnswer(engine="lm:lm-acme", acked=False, removed=0, error="no_control_channel"),
    ]
    assert owed_engines(answers) == ["down", "gone", "slow"]


def test_a_debt_is_held_until_settled_replaced_or_dropped(clock: Clock) -> None:
    dropped: list[tuple[Debt, str]] = []
    q = _queue(clock, dropped, max_digests=3)
    (a,) = q.owe("job-1", "acme", ["vllm-a"], _digests(2))
    (b,) = q.owe("job-2", "acme", ["vllm-a"], _digests(1, "b"))
    assert q.holds(a) and q.holds(b)
    (c,) = q.owe("job-3", "acme", ["vllm-a"], _digests(2, "c"))  # a makes room
    assert not q.holds(a) and q.holds(b) and q.holds(c)
    assert q.settle(b) and not q.holds(b)
    assert not q.settle(b)  # once


def test_a_restored_debt_is_as_old_as_its_step_and_keeps_a_newer_one(clock: Clock) -> None:
    """What a restarted sidecar restores (``replace=False``) counts its lifetime from its
    step, and never replaces what this process's own step owes already."""
    dropped: list[tuple[Debt, str]] = []
    q = _queue(clock, dropped)
    (mine,) = q.owe("job-1", "acme", ["vllm-a"], _digests(1))
    kept = q.owe("job-1", "acme", ["vllm-a", "vllm-b"], _digests(2, "r"), age_s=50, replace=False)
    assert [d.engine for d in kept] == ["vllm-b"]
    assert q.holds(mine)
    clock.now += 11  # vllm-b's step ran 61 s ago: past its 60 s
    assert [d.job_id for d in q.due("vllm-b")] == []
    assert [(d.engine, why) for d, why in dropped] == [("vllm-b", DROPPED_TTL)]
    assert q.due("vllm-a") == [mine]

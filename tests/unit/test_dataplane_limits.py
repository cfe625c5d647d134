"""The data plane's bookkeeping of limits (``kvgov.proxy.dataplane.limits``), on a fake clock."""

from __future__ import annotations

import logging

import pytest

from kvgov.proxy.dataplane.limits import (
    ConnectionLimits,
    DenialBudget,
    DenialGate,
    SummaryLog,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Conn:
    listener = "kvgov"
    deadline = float("inf")

    def expire(self) -> None:
        pass


def test_summary_log_writes_one_line_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    summary = SummaryLog(logging.getLogger("kvgov.test.limits"), 10.0, clock)
    caplog.set_level(logging.INFO, logger="kvgov.test.limits")
    assert summary.note("x.happened")
    assert not any(summary.note("x.happened") for _ in range(500))
    clock.now += 10
    assert summary.note("x.happened")
    lines = [r for r in caplog.records if r.getMessage() == "x.happened"]
    assert [getattr(r, "suppressed", None) for r in lines] == [0, 500]


def test_connection_caps_count_and_release() -> None:
    limits = ConnectionLimits(max_total=3, per_peer=2, per_engine=1)
    a, b, c, d = Conn(), Conn(), Conn(), Conn()
    assert limits.admit(a, "p1") and limits.admit(b, "p1")
    assert not limits.admit(c, "p1")  # peer cap
    assert limits.admit(c, "p2")
    assert not limits.admit(d, "p3")  # global cap
    assert limits.admit_engine(a, "e") and not limits.admit_engine(b, "e")
    limits.release(a)
    assert limits.admit_engine(b, "e")
    assert limits.admit(d, "p1")
    assert limits.total == 3


def test_denial_gate_caps_per_connection_and_second_and_summarises() -> None:
    clock = Clock()
    gate = DenialGate(per_connection=3, per_second=5, clock=clock)
    one, two = DenialBudget("engine:a"), DenialBudget("engine:b")
    assert [gate.admit(one, "exists", "r") for _ in range(5)] == [True] * 3 + [False] * 2
    assert [gate.admit(two, "get", "r") for _ in range(4)] == [True, True, False, False]
    assert gate.admit(None, "get", "r") is False  # the second's global cap is spent
    assert gate.due() == []  # the window is not over
    clock.now += 1
    assert gate.admit(one, "exists", "s")  # a new second
    assert gate.flush_needed
    summaries = {s.principal: s for s in gate.due()}
    assert summaries["engine:b"].count == 2
    assert summaries["engine:b"].by_operation == {"get": 2}
    # one's held denials moved into the new window with it: summarised when it closes
    final = gate.due(final=[one])
    assert [(s.principal, s.count) for s in final] == [("engine:a", 2)]
    assert gate.due(final=[one]) == []

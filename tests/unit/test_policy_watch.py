"""Following the policy's sources (``kvgov.policy.watch``): what is loaded, when, and what a
change that does not load leaves in force."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvgov.errors import PolicyError
from kvgov.policy.bundle import PolicyBundle, source_stamp
from kvgov.policy.interfaces import PolicyRevision
from kvgov.policy.watch import follow_sources


def test_the_stamp_changes_when_a_source_is_replaced_and_only_then(tmp_path: Path) -> None:
    policy, data = tmp_path / "policy", tmp_path / "data.json"
    policy.mkdir()
    (policy / "authz.rego").write_text("package kvgov.authz\n")
    data.write_text("{}")
    first = source_stamp(policy, data)
    assert source_stamp(policy, data) == first
    tmp = tmp_path / "data.tmp"
    tmp.write_text("{} ")
    tmp.replace(data)  # as the kubelet swaps a ConfigMap's files
    second = source_stamp(policy, data)
    assert second != first
    (policy / "extra.rego").write_text("package kvgov.extra\n")
    third = source_stamp(policy, data)
    assert third != second
    data.unlink()
    assert source_stamp(policy, data) != third  # a missing file is a change too
    assert source_stamp(None, None) == source_stamp(None, None) == ()  # the shipped sources


class _Engine:
    def __init__(self) -> None:
        self.revision = PolicyRevision(policy="p1", data="d1")
        self.reloads = 0

    async def reload(self) -> PolicyRevision:
        self.reloads += 1
        self.revision = PolicyRevision(policy="p1", data=f"d{self.reloads + 1}")
        return self.revision


class _Bundle:
    def __init__(self, data: str) -> None:
        self.revision = PolicyRevision(policy="p1", data=data)


async def test_it_loads_only_on_a_changed_stamp_and_reloads_only_on_a_new_revision(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = _Engine()
    stamp, loads = ["s1"], []
    answer: list[object] = [_Bundle("d1")]

    def load() -> PolicyBundle:
        loads.append(stamp[0])
        if isinstance(answer[0], Exception):
            raise answer[0]
        return answer[0]  # type: ignore[return-value]

    task = asyncio.create_task(follow_sources(engine, load, 0.01, lambda: stamp[0]))  # type: ignore[arg-type]
    try:
        await asyncio.sleep(0.1)
        assert loads == ["s1"] and engine.reloads == 0  # one first look; same revision
        stamp[0], answer[0] = "s2", PolicyError("invalid data")
        await asyncio.sleep(0.1)
        assert loads == ["s1", "s2"] and engine.reloads == 0  # refused once, not retried
        assert [r.getMessage() for r in caplog.records].count("policy.reload_refused") == 1
        stamp[0], answer[0] = "s3", _Bundle("d2")
        await asyncio.sleep(0.1)
        assert loads == ["s1", "s2", "s3"] and engine.reloads == 1
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

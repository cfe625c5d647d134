"""Following the policy's sources (``kvgov.policy.watch``): what is loaded, when, and what a
change that does not load leaves in force."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
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


class _FailingOnce(_Engine):
    """An engine whose first reload fails with what is no policy error: the kubelet removed
    the ConfigMap's old ``..<time>`` folder while the reload walked the policy directory."""

    def __init__(self) -> None:
        super().__init__()
        self.fail_next = True

    async def reload(self) -> PolicyRevision:
        if self.fail_next:
            self.fail_next = False
            raise FileNotFoundError(2, "No such file or directory", "/etc/kvgov/policy/..old")
        return await super().reload()


async def test_a_reload_that_fails_on_a_passing_fault_is_tried_again() -> None:
    """(review s10) Only a PolicyError was caught around the engine's reload: any other error
    ended the task for good, and every later change (a revocation) was ignored."""
    engine = _FailingOnce()
    task = asyncio.create_task(
        follow_sources(engine, lambda: _Bundle("d2"), 0.01, lambda: "unchanged")  # type: ignore[arg-type,return-value]
    )
    try:
        await asyncio.sleep(0.2)
        assert not task.done(), "the follower died: the policy in force is frozen"
        assert engine.reloads == 1  # the fault passed; the next look reloaded
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


def test_data_with_a_lone_surrogate_is_refused_not_a_crash(tmp_path: Path) -> None:
    """(review s10) The Rego engine crashes the process (SIGSEGV) on a string that is not text;
    a data file with a lone surrogate escape must be a PolicyError, as any invalid data is. In
    a child process: were it not refused, the crash would take only the child."""
    data = tmp_path / "data.json"
    base = json.loads(
        (Path(__file__).resolve().parents[2] / "src/kvgov/policy/rego/data.json").read_text()
    )
    base["note"] = "X"
    data.write_text(json.dumps(base).replace('"X"', '"\\ud800"'))
    code = (
        "import sys, pathlib\nfrom kvgov.errors import PolicyError\n"
        "from kvgov.policy.bundle import load_bundle\n"
        "try:\n    load_bundle(None, pathlib.Path(sys.argv[1]))\n"
        "except PolicyError as exc:\n    print('refused:', exc)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(data)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, f"the process died: rc={proc.returncode} (-11: SIGSEGV)"
    assert "refused:" in proc.stdout and "not text" in proc.stdout, proc.stdout + proc.stderr

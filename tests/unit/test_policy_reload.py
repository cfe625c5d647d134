"""The embedded engine's reload: loaded and compiled off the event loop, put in force at once.

Attack (availability): a policy change made the running sidecar load, check and compile the
new policies on its event loop (~15-20 ms for the shipped policy, far more for a large one) and
every connection waited meanwhile; whoever can change the policy's sources often enough stalls
the data plane. Now the work runs on a worker thread and the new (bundle, program) pair is
swapped in on the loop in one assignment, so a decision sees the old policy or the new one,
whole.

The compile is made slow on purpose (200 ms, a sleep that lets go of the GIL) so that a blocked
loop is unmistakable: the test counts the ticks of a task that sleeps 10 ms at a time, not wall
times. What it proves is the hop off the loop; regorus itself holds the GIL inside each call,
so the loop still waits out the longest single regorus call (``kvgov.policy.embedded``).
Real regorus throughout.
"""

from __future__ import annotations

import asyncio
import gc
import json
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvgov.errors import PolicyError
from kvgov.policy import embedded
from kvgov.policy.bundle import PolicyBundle, load_bundle
from kvgov.policy.cache import CachingPolicyEngine
from kvgov.policy.embedded import EmbeddedPolicyEngine
from tests.unit.test_policy_cache_ttl import ALLOW

SLOW_S = 0.2
TICK_S = 0.01


@pytest.fixture
def compiles(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make every compile from now on take ``SLOW_S`` longer; the threads they ran on."""
    real = embedded._compile
    threads: list[int] = []

    def slow_compile(bundle: PolicyBundle, *, rvm: bool = True) -> Any:
        threads.append(threading.get_ident())
        time.sleep(SLOW_S)
        return real(bundle, rvm=rvm)

    monkeypatch.setattr(embedded, "_compile", slow_compile)
    return threads


@pytest.fixture
def unraisable() -> Iterator[list[Any]]:
    """Every unraisable error (a regorus object dropped on the wrong thread) seen."""
    seen: list[Any] = []
    saved = sys.unraisablehook
    sys.unraisablehook = seen.append
    try:
        yield seen
    finally:
        gc.collect()
        sys.unraisablehook = saved


def _data_file(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    config = json.loads(json.dumps(load_bundle().config))
    path = tmp_path / "data.json"
    path.write_text(json.dumps(config))
    return path, config


class Ticker:
    """A task that sleeps ``TICK_S`` at a time and counts: it counts only while the loop runs."""

    def __init__(self) -> None:
        self.ticks = 0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            self.ticks += 1

    async def __aenter__(self) -> Ticker:
        self._task = asyncio.create_task(self._run())
        await asyncio.sleep(0)  # started
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


async def test_the_event_loop_keeps_running_while_a_reload_compiles(
    tmp_path: Path, compiles: list[int]
) -> None:
    data, config = _data_file(tmp_path)
    engine = EmbeddedPolicyEngine.from_paths(None, data)
    compiles.clear()
    config["revision"] = "changed"
    data.write_text(json.dumps(config))
    async with Ticker() as ticker:
        before = ticker.ticks
        revision = await engine.reload()
        during = ticker.ticks - before
    assert revision.data.startswith("changed") and engine.revision == revision
    # a 200 ms compile holds ~20 ticks of 10 ms; a blocked loop, none
    assert during >= 5, f"the loop ticked {during} times during a {SLOW_S}s compile: blocked"
    assert compiles and threading.get_ident() not in compiles  # compiled on a worker thread


async def test_decisions_during_a_reload_see_the_old_policy_or_the_new_one_whole(
    tmp_path: Path, compiles: list[int]
) -> None:
    """Through the cache, as the data plane asks (``decide_cached`` or ``decide``): until the
    swap every decision is the old policy's (allowed, under its revision), after it the new
    one's (acme disabled, under the new revision); never one's revision with the other's
    answer. And decisions went on during the compile."""
    data, config = _data_file(tmp_path)
    engine = CachingPolicyEngine(EmbeddedPolicyEngine.from_paths(None, data))
    old = engine.revision
    config["tenants"]["acme"]["enabled"] = False
    config["revision"] = "acme-disabled"
    data.write_text(json.dumps(config))
    seen: list[tuple[str, bool, tuple[str, ...]]] = []
    reloading = asyncio.Event()

    async def data_plane() -> None:
        while True:
            decision = engine.decide_cached(ALLOW) or await engine.decide(ALLOW)
            if reloading.is_set():
                seen.append((decision.data_revision, decision.allowed, decision.reasons))
            await asyncio.sleep(0.002)

    task = asyncio.create_task(data_plane())
    try:
        await asyncio.sleep(0.01)
        reloading.set()
        new = await engine.reload()
        await asyncio.sleep(0.02)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert new != old
    before = [s for s in seen if s[0] == old.data]
    after = [s for s in seen if s[0] == new.data]
    assert len(before) + len(after) == len(seen), seen
    assert all(allowed and reasons == () for _, allowed, reasons in before)
    assert all(not allowed and reasons == ("tenant_disabled",) for _, allowed, reasons in after)
    assert len(before) >= 5, "no decision was answered while the reload compiled"
    assert after, "the new policy never answered"
    first_new = seen.index(after[0])
    assert all(s[0] == new.data for s in seen[first_new:]), "the old policy answered again"


async def test_a_reload_that_fails_leaves_the_policy_in_force_and_no_regorus_object_astray(
    tmp_path: Path, unraisable: list[Any]
) -> None:
    """Invalid Rego fails inside the worker with a half-checked regorus engine in its frames;
    the exception crosses to the loop's thread. The engine must be dropped on the worker
    (dropped elsewhere, regorus raises "unsendable")."""
    policy = tmp_path / "policy"
    policy.mkdir()
    for module in load_bundle().modules:
        (policy / module.name).write_text(module.source)
    engine = EmbeddedPolicyEngine.from_paths(policy, None)
    revision = engine.revision
    (policy / "broken.rego").write_text("package kvgov.authz\nimport rego.v1\nbroken if {\n")
    with pytest.raises(PolicyError, match=r"broken\.rego") as refused:
        await engine.reload()
    await asyncio.sleep(0.2)  # the worker thread lets go of the exception: this is the last ref
    del refused
    gc.collect()
    assert [f"{u.exc_type.__name__}: {u.exc_value}" for u in unraisable] == []
    assert engine.revision == revision
    assert engine.decide_sync(ALLOW).allowed


async def test_overlapping_reloads_put_the_last_started_in_force(tmp_path: Path) -> None:
    """Two reloads in flight (the follower and an operator): the one that started last read
    the newer sources, so it wins even when the older one finishes after it."""
    data, config = _data_file(tmp_path)
    bundles = []
    for name in ("older", "newer"):
        config["revision"] = name
        data.write_text(json.dumps(config))
        bundles.append(load_bundle(None, data))
    delays = iter([0.3, 0.0])  # the first reload's load is slow, the second's fast
    picks = iter(bundles)

    def loader() -> PolicyBundle:
        delay, bundle = next(delays), next(picks)
        time.sleep(delay)
        return bundle

    engine = EmbeddedPolicyEngine(load_bundle(), loader=loader)
    first = asyncio.create_task(engine.reload())
    await asyncio.sleep(0.05)  # the first is loading
    second = asyncio.create_task(engine.reload())
    await asyncio.gather(first, second)
    assert engine.revision.data.startswith("newer")
    assert not engine.decide_sync(ALLOW).data_revision.startswith("older")


async def test_the_follower_refusing_invalid_rego_drops_no_regorus_object_astray(
    tmp_path: Path, unraisable: list[Any]
) -> None:
    """The follower (``kvgov.policy.watch``) loads the sources on a worker thread before it
    reloads: the same hazard when they are invalid."""
    from kvgov.policy.watch import follow_sources

    policy = tmp_path / "policy"
    policy.mkdir()
    for module in load_bundle().modules:
        (policy / module.name).write_text(module.source)
    engine = EmbeddedPolicyEngine.from_paths(policy, None)
    (policy / "broken.rego").write_text("package kvgov.authz\nimport rego.v1\nbroken if {\n")
    refused: list[PolicyError] = []

    def load() -> PolicyBundle:
        try:
            return load_bundle(policy, None)
        except PolicyError as exc:
            refused.append(exc)  # held here, so that the last reference is the test's
            raise

    task = asyncio.create_task(follow_sources(engine, load, 0.01, lambda: "unchanged"))
    try:
        for _ in range(200):
            await asyncio.sleep(0.01)
            if refused:
                break
        await asyncio.sleep(0.2)  # the worker thread and the follower let go of the exception
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert refused
    refused.clear()  # the last reference, dropped on the loop's thread
    gc.collect()
    assert [f"{u.exc_type.__name__}: {u.exc_value}" for u in unraisable] == []
    assert engine.decide_sync(ALLOW).allowed

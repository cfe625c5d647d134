"""The embedded engine across threads: regorus objects are bound to the thread that made them
(using one elsewhere panics, dropping one elsewhere raises "unsendable, but is being dropped on
another thread"). The engine must be buildable, usable and droppable on any threads, with no
such error, and give the same answers everywhere. Real regorus throughout.

Errors raised while an object is dropped are "unraisable": pytest turns them into a warning,
an error under ``-W error``; each test also records them itself, so it fails on its own too.
"""

from __future__ import annotations

import asyncio
import gc
import json
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from kvgov.policy import embedded
from kvgov.policy.bundle import load_bundle
from kvgov.policy.embedded import EmbeddedPolicyEngine
from kvgov.policy.interfaces import Decision, PolicyInput
from kvgov.types import Operation

SHIPPED = load_bundle()


def inp(i: int) -> PolicyInput:
    sensitivities = ["public", "internal", "confidential", "restricted"]
    return PolicyInput(
        operation=Operation.PUT if i % 2 else Operation.GET,
        tenant="acme",
        engine="vllm-acme-0",
        key_tenant="acme" if i % 5 else "globex",
        actor_user=f"u{i}",
        model="llama",
        request_id=f"r{i}",
        sensitivity=sensitivities[i % len(sensitivities)],
    )


def answer(d: Decision) -> tuple[Any, ...]:
    return (d.allowed, d.reasons, d.tiers, d.ttl_s, d.scope, d.input_digest)


def on_thread(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on a new thread that exits afterwards; its result (or its exception)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # re-raised on the caller's thread
            box["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join(30)
    if "error" in box:
        raise box["error"]
    return box.get("value")


@pytest.fixture
def unraisable() -> Iterator[list[Any]]:
    """Every unraisable error (e.g. a regorus object dropped on the wrong thread) seen."""
    seen: list[Any] = []
    saved = sys.unraisablehook
    sys.unraisablehook = seen.append
    try:
        yield seen
    finally:
        gc.collect()
        sys.unraisablehook = saved


def messages(seen: list[Any]) -> list[str]:
    return [f"{u.exc_type.__name__}: {u.exc_value}" for u in seen]


def test_built_on_one_thread_used_on_another_dropped_on_a_third(unraisable: list[Any]) -> None:
    expected = [answer(EmbeddedPolicyEngine(SHIPPED).decide_sync(inp(i))) for i in range(20)]
    engines: dict[str, EmbeddedPolicyEngine] = {}
    on_thread(lambda: engines.setdefault("e", EmbeddedPolicyEngine(SHIPPED)))  # thread 1 builds

    # thread 2 evaluates, then stays alive while the engine is dropped elsewhere
    used = threading.Event()
    release = threading.Event()
    got: list[tuple[Any, ...]] = []

    def user() -> None:
        engine = engines["e"]
        got.extend(answer(engine.decide_sync(inp(i))) for i in range(20))
        del engine
        used.set()
        release.wait(30)

    t2 = threading.Thread(target=user)
    t2.start()
    assert used.wait(30)

    def drop() -> None:  # thread 3 drops the last reference
        engines.clear()
        gc.collect()

    on_thread(drop)
    gc.collect()
    release.set()  # thread 2 exits: its VM goes with it, on it
    t2.join(30)
    gc.collect()
    assert got == expected
    assert messages(unraisable) == []


def test_built_and_used_on_a_thread_dropped_on_main(unraisable: list[Any]) -> None:
    """What a sidecar on its own loop thread does when its owner lets go of it."""

    def build_and_use() -> EmbeddedPolicyEngine:
        engine = EmbeddedPolicyEngine(SHIPPED)
        assert engine.decide_sync(inp(1)).allowed
        return engine

    engine = on_thread(build_and_use)
    del engine
    gc.collect()
    assert messages(unraisable) == []


def test_same_answers_from_many_threads_at_once(unraisable: list[Any]) -> None:
    engines = [EmbeddedPolicyEngine(SHIPPED)]
    items = [inp(i) for i in range(200)]
    expected = [answer(engines[0].decide_sync(x)) for x in items]

    def run(offset: int) -> list[tuple[Any, ...]]:
        order = items[offset:] + items[:offset]
        out = [answer(engines[0].decide_sync(x)) for x in order]
        return out[len(items) - offset :] + out[: len(items) - offset]

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(run, [0, 50, 100, 150]))
    assert all(r == expected for r in results)
    engines.clear()
    gc.collect()  # the pool's threads have exited; the main thread drops the engine
    assert messages(unraisable) == []


async def test_awaited_decide_on_a_loop_thread_engine_built_and_dropped_on_main(
    unraisable: list[Any],
) -> None:
    engine = EmbeddedPolicyEngine(SHIPPED)
    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever)
    t.start()
    try:
        d = asyncio.run_coroutine_threadsafe(engine.decide(inp(1)), loop).result(30)
        assert d.allowed
    finally:
        loop.call_soon_threadsafe(loop.stop)
        t.join(30)
        loop.close()
    del engine
    gc.collect()
    assert messages(unraisable) == []


def test_a_long_lived_thread_drops_vms_of_dead_engines(unraisable: list[Any]) -> None:
    def table_size() -> int:
        return len(getattr(embedded._THREAD, "table", {}))

    with ThreadPoolExecutor(max_workers=1) as worker:
        for i in range(5):
            engine = EmbeddedPolicyEngine(SHIPPED)
            assert worker.submit(engine.decide_sync, inp(i)).result(30).input_digest
            del engine  # dropped here, on the main thread, while the worker lives on
            gc.collect()
            # the worker drops the dead engines' VMs itself, when it next builds one
            assert worker.submit(table_size).result(30) <= 1
    gc.collect()
    assert messages(unraisable) == []


async def test_reload_on_another_thread_switches_every_thread(
    tmp_path: Path, unraisable: list[Any]
) -> None:
    data = json.loads(json.dumps(SHIPPED.config))
    data_file = tmp_path / "data.json"
    data_file.write_text(json.dumps(data))
    engine = EmbeddedPolicyEngine.from_paths(None, data_file)
    probe = inp(1)  # a put by acme, allowed while acme is enabled
    assert engine.decide_sync(probe).allowed
    with ThreadPoolExecutor(max_workers=1) as worker:
        assert worker.submit(engine.decide_sync, probe).result(30).allowed
        data["tenants"]["acme"]["enabled"] = False
        data_file.write_text(json.dumps(data))
        revision = on_thread(lambda: asyncio.run(engine.reload()))
        assert revision == engine.revision
        assert not worker.submit(engine.decide_sync, probe).result(30).allowed
        assert not engine.decide_sync(probe).allowed
        await engine.aclose()
    gc.collect()
    assert messages(unraisable) == []

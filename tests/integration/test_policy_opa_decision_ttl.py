"""A bundle published to OPA alone reaches kvgov's cached decisions within a bounded age.

Attack: with ``policy.engine = "opa"`` OPA answers from its own bundle. An operator revokes an
engine from a tenant by publishing a new bundle (its token leaked) without touching kvgov's
``policy_dir``/``data_file``: kvgov's revision does not change, its follower sees nothing, and
its decision cache kept serving the allows it had been given until the next change of those
files or a restart. Now every cached decision from OPA expires ``policy.opa_decision_ttl_s``
after OPA was asked for it.

Against the loopback OPA REST STAND-IN (``test_policy_opa_standin.py``: aiohttp speaking OPA's
API, evaluating with the real OPA engine); the "publish" is the stand-in loading another
bundle. Time is an injected clock, never a sleep.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvgov.ledger.events import InMemoryEventSink
from kvgov.policy.bundle import PolicyBundle, load_bundle
from kvgov.policy.cache import CachingPolicyEngine
from kvgov.policy.opa import OpaRestPolicyEngine
from kvgov.policy.recording import EventDecisionRecorder
from kvgov.types import Outcome
from tests.integration.test_policy_opa_rest import ALLOWED
from tests.integration.test_policy_opa_standin import OpaStandIn, running_standin

pytest.importorskip("opa_bindings")

TTL_S = 10.0


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def opa_standin() -> AsyncIterator[OpaStandIn]:
    async with running_standin() as server:
        yield server


def revoked_bundle(tmp_path: Path) -> PolicyBundle:
    """The shipped policy with ``vllm-acme-0`` removed from acme's engines: what the operator
    publishes to OPA's bundle server."""
    data = json.loads(json.dumps(load_bundle().config))
    data["tenants"]["acme"]["engines"] = ["vllm-acme-1"]
    data["revision"] = "bundle-revoked"
    path = tmp_path / "revoked.json"
    path.write_text(json.dumps(data))
    return load_bundle(None, path)


@pytest.fixture
async def cached_opa(
    opa_standin: OpaStandIn,
) -> AsyncIterator[tuple[CachingPolicyEngine, Clock, InMemoryEventSink]]:
    """kvgov's OPA engine behind its decision cache, as ``build_policy_engine`` makes it for
    ``policy.engine = "opa"``, with a hand-moved clock."""
    shipped = load_bundle()  # kvgov's own sources: untouched by the publish
    opa_standin.load(shipped)
    clock, sink = Clock(), InMemoryEventSink()
    engine = CachingPolicyEngine(
        OpaRestPolicyEngine(shipped, url=opa_standin.url, timeout_s=2.0),
        recorder=EventDecisionRecorder(sink),
        decision_ttl_s=TTL_S,
        clock=clock,
    )
    try:
        yield engine, clock, sink
    finally:
        await engine.aclose()


async def test_an_engine_revoked_in_opas_bundle_alone_is_denied_once_the_ttl_passed(
    cached_opa: tuple[CachingPolicyEngine, Clock, InMemoryEventSink],
    opa_standin: OpaStandIn,
    tmp_path: Path,
) -> None:
    engine, clock, sink = cached_opa
    revision = engine.revision
    assert (await engine.decide(ALLOWED)).allowed
    assert engine.decide_cached(ALLOWED) is not None  # a cached allow

    opa_standin.load(revoked_bundle(tmp_path))  # the bundle publish; kvgov's files unchanged
    clock.now += TTL_S + 0.001

    assert engine.decide_cached(ALLOWED) is None, (
        "the revoked engine is still served a cached allow"
    )
    decision = await engine.decide(ALLOWED)
    assert not decision.allowed, "the revoked engine is still allowed past the TTL"
    assert decision.reasons == ("engine_not_allowed",)
    assert engine.revision == revision  # nothing kvgov watches changed: only the age did it
    assert [e.outcome for e in sink.events] == [Outcome.ALLOW, Outcome.DENY]


async def test_within_the_ttl_the_cache_answers_without_asking_opa(
    cached_opa: tuple[CachingPolicyEngine, Clock, InMemoryEventSink],
    opa_standin: OpaStandIn,
    tmp_path: Path,
) -> None:
    """The price, bounded: until the TTL passes a cached allow is served, and OPA is not asked
    for it (the cache still works)."""
    engine, clock, sink = cached_opa
    first = await engine.decide(ALLOWED)
    asked = len(opa_standin.requests)
    opa_standin.load(revoked_bundle(tmp_path))
    clock.now += TTL_S - 0.01
    hit = engine.decide_cached(ALLOWED)
    assert hit is not None and hit.decision_id == first.decision_id
    again = await engine.decide(ALLOWED)
    assert again.allowed and again.cached and again.decision_id == first.decision_id
    assert len(opa_standin.requests) == asked, "a hit within the TTL asked OPA"
    assert engine.hits == 2 and engine.misses == 1
    assert len(sink.events) == 1  # the first allow, recorded once


async def test_the_age_counts_from_the_question_not_the_answer(
    cached_opa: tuple[CachingPolicyEngine, Clock, InMemoryEventSink],
    opa_standin: OpaStandIn,
) -> None:
    """OPA answered from the bundle it had when asked: a slow answer does not buy its
    decision a longer life."""
    engine, clock, _ = cached_opa
    inner = engine.inner
    real_decide = inner.decide

    async def slow_decide(inp: object) -> object:
        decision = await real_decide(inp)  # type: ignore[arg-type]
        clock.now += 4.0  # the answer took 4 s to come back
        return decision

    inner.decide = slow_decide  # type: ignore[method-assign]
    assert (await engine.decide(ALLOWED)).allowed
    clock.now += TTL_S - 4.0
    assert engine.decide_cached(ALLOWED) is None


async def test_a_policy_deny_is_cached_for_the_ttl_and_then_asked_again(
    cached_opa: tuple[CachingPolicyEngine, Clock, InMemoryEventSink],
    opa_standin: OpaStandIn,
    tmp_path: Path,
) -> None:
    """A stale deny fails closed, so denies may be cached as long as allows; an engine OPA's
    bundle admits again gets in once the TTL passed. Every deny is still recorded."""
    engine, clock, sink = cached_opa
    opa_standin.load(revoked_bundle(tmp_path))
    assert not (await engine.decide(ALLOWED)).allowed
    asked = len(opa_standin.requests)
    assert not (await engine.decide(ALLOWED)).allowed  # from the cache
    assert len(opa_standin.requests) == asked
    opa_standin.load(load_bundle())  # admitted again
    clock.now += TTL_S
    assert (await engine.decide(ALLOWED)).allowed
    assert [e.outcome for e in sink.events] == [Outcome.DENY, Outcome.DENY, Outcome.ALLOW]


async def test_a_deny_for_an_opa_failure_is_never_cached(
    cached_opa: tuple[CachingPolicyEngine, Clock, InMemoryEventSink],
    opa_standin: OpaStandIn,
) -> None:
    """A timeout, an error reply or garbage says OPA failed, not what the policy says: cached,
    it would deny the input for the whole TTL after OPA recovered."""
    engine, _, sink = cached_opa
    failures = (
        ("error", "opa_bad_status:500"),
        ("garbage", "opa_invalid_reply"),
        # no result: OPA's bundle not active yet (a restarted OPA sidecar still loading it)
        ("undefined", "opa_undefined"),
    )
    for mode, reason in failures:
        opa_standin.mode = mode
        assert (await engine.decide(ALLOWED)).reasons == (reason,)
        assert len(engine) == 0
    opa_standin.mode = "ok"
    assert (await engine.decide(ALLOWED)).allowed  # at once: no clock moved
    assert [e.outcome for e in sink.events] == [Outcome.DENY] * 3 + [Outcome.ALLOW]

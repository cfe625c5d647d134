"""The decision cache's age bound (``policy.opa_decision_ttl_s``): its setting, which engines
get it, and how entries expire. The attack it answers (a bundle published to OPA alone) is
``tests/integration/test_policy_opa_decision_ttl.py``. Real Rego (embedded engine) here."""

from __future__ import annotations

import math
import os

import pytest

from kvgov.config import load_settings
from kvgov.errors import ConfigError
from kvgov.policy.bundle import load_bundle
from kvgov.policy.cache import CachingPolicyEngine
from kvgov.policy.embedded import EmbeddedPolicyEngine
from kvgov.policy.factory import build_policy_engine
from kvgov.policy.interfaces import PolicyInput

ALLOW = PolicyInput(
    operation="put",
    tenant="acme",
    engine="vllm-acme-0",
    key_tenant="acme",
    actor_user="u1",
    request_id="r1",
    sensitivity="internal",
)


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("KVGOV_") and not name.startswith("KVGOV_TEST_"):
            monkeypatch.delenv(name)


def test_the_setting_defaults_to_ten_seconds_and_takes_a_positive_number() -> None:
    assert load_settings().policy.opa_decision_ttl_s == 10.0
    assert load_settings(policy={"opa_decision_ttl_s": 0.5}).policy.opa_decision_ttl_s == 0.5


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, 3601])
def test_a_ttl_that_is_not_a_positive_bounded_number_stops_startup(bad: float) -> None:
    with pytest.raises(ConfigError, match=r"policy\.opa_decision_ttl_s: .*must be seconds > 0"):
        load_settings(policy={"opa_decision_ttl_s": bad})


def test_the_environment_sets_it_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGOV_POLICY__OPA_DECISION_TTL_S", "2.5")
    assert load_settings().policy.opa_decision_ttl_s == 2.5
    monkeypatch.setenv("KVGOV_POLICY__OPA_DECISION_TTL_S", "0")
    with pytest.raises(ConfigError, match="opa_decision_ttl_s"):
        load_settings()


async def test_only_the_opa_engine_gets_the_ttl() -> None:
    """OPA answers from its own bundle, which the follower cannot see; the embedded engine's
    policy is the sources the follower reloads (and a reload empties the cache)."""
    opa = build_policy_engine(load_settings(policy={"engine": "opa", "opa_decision_ttl_s": 3.0}))
    try:
        assert opa.decision_ttl_s == 3.0
    finally:
        await opa.aclose()
    assert build_policy_engine(load_settings()).decision_ttl_s is None


def test_the_cache_refuses_a_ttl_that_is_not_positive() -> None:
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="decision_ttl_s"):
            CachingPolicyEngine(EmbeddedPolicyEngine(load_bundle()), decision_ttl_s=bad)


async def test_without_a_ttl_an_entry_never_ages() -> None:
    clock = Clock()
    engine = CachingPolicyEngine(EmbeddedPolicyEngine(load_bundle()), clock=clock)
    first = await engine.decide(ALLOW)
    clock.now += 1e9
    hit = engine.decide_cached(ALLOW)
    assert hit is not None and hit.decision_id == first.decision_id
    assert engine.misses == 1


async def test_an_expired_entry_is_asked_again_replaced_and_recorded() -> None:
    from kvgov.policy.recording import InMemoryDecisionRecorder

    clock, recorder = Clock(), InMemoryDecisionRecorder()
    engine = CachingPolicyEngine(
        EmbeddedPolicyEngine(load_bundle()), recorder=recorder, decision_ttl_s=5.0, clock=clock
    )
    first = await engine.decide(ALLOW)
    clock.now += 4.999
    assert engine.decide_cached(ALLOW) is not None
    clock.now += 0.001  # exactly the TTL: no longer served
    assert engine.decide_cached(ALLOW) is None
    second = await engine.decide(ALLOW)
    assert second.allowed and not second.cached and second.decision_id != first.decision_id
    assert engine.misses == 2 and len(engine) == 1
    assert [d.decision_id for _, d in recorder.records] == [first.decision_id, second.decision_id]
    hit = engine.decide_cached(ALLOW)  # the new answer is cached for its own TTL
    assert hit is not None and hit.decision_id == second.decision_id

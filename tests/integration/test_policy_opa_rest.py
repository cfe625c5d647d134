"""The ``opa-python-client`` path end to end, against the loopback OPA REST STAND-IN (see
``test_policy_opa_standin.py``: aiohttp speaking OPA's API, evaluating with the real OPA
engine). Same answers as the embedded engine; every failure of OPA is a recorded deny.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvgov.ledger.events import InMemoryEventSink
from kvgov.policy.bundle import PolicyBundle, load_bundle
from kvgov.policy.cache import CachingPolicyEngine
from kvgov.policy.embedded import EmbeddedPolicyEngine
from kvgov.policy.interfaces import PolicyInput
from kvgov.policy.opa import OpaRestPolicyEngine
from kvgov.policy.recording import EventDecisionRecorder
from kvgov.types import EventKind, Outcome
from tests.integration.test_policy_differential import answer, decision_cases
from tests.integration.test_policy_opa_standin import (
    OpaStandIn,
    closed_port_url,
    running_standin,
)

opa_bindings = pytest.importorskip("opa_bindings")

ALLOWED = PolicyInput(
    operation="put",
    tenant="acme",
    engine="vllm-acme-0",
    key_tenant="acme",
    actor_user="u1",
    sensitivity="internal",
)


@pytest.fixture
async def opa_standin() -> AsyncIterator[OpaStandIn]:
    async with running_standin() as server:
        yield server


@pytest.fixture
def bundle() -> PolicyBundle:
    return load_bundle()


@pytest.fixture
async def opa(opa_standin: OpaStandIn, bundle: PolicyBundle) -> AsyncIterator[OpaRestPolicyEngine]:
    opa_standin.load(bundle)
    engine = OpaRestPolicyEngine(bundle, url=opa_standin.url, timeout_s=0.3)
    try:
        yield engine
    finally:
        await engine.aclose()


async def test_same_answers_as_embedded_engine(
    opa: OpaRestPolicyEngine, bundle: PolicyBundle
) -> None:
    embedded = EmbeddedPolicyEngine(bundle)
    cases = decision_cases()[::23]  # a spread of the differential table, over HTTP
    assert len(cases) > 300
    allowed = 0
    for inp in cases:
        over_rest = await opa.decide(inp)
        assert answer(over_rest) == answer(embedded.decide_sync(inp)), inp
        assert over_rest.policy_revision == bundle.revision.policy
        allowed += over_rest.allowed
    assert 0 < allowed < len(cases)


async def test_undefined_decision_denies(opa_standin: OpaStandIn, tmp_path: Path) -> None:
    # a real undefined: OPA evaluating a policy whose decision has no default
    (tmp_path / "authz.rego").write_text(
        "package kvgov.authz\nimport rego.v1\n"
        'decision := {"allowed": true} if input.tenant == "x"\n'
    )
    shipped = load_bundle()
    opa_standin.engine = opa_bindings.OpaEngine()
    opa_standin.engine.add_policy("authz.rego", (tmp_path / "authz.rego").read_text())
    engine = OpaRestPolicyEngine(shipped, url=opa_standin.url, timeout_s=0.3)
    try:
        decision = await engine.decide(ALLOWED)
        assert decision.allowed is False
        assert decision.reasons == ("opa_undefined",)
        # and the stand-in's blanket-undefined mode, for any input
        opa_standin.load(shipped)
        opa_standin.mode = "undefined"
        assert (await engine.decide(ALLOWED)).reasons == ("opa_undefined",)
    finally:
        await engine.aclose()


async def test_opa_down_denies(bundle: PolicyBundle) -> None:
    engine = OpaRestPolicyEngine(bundle, url=closed_port_url(), timeout_s=0.3)
    try:
        decision = await engine.decide(ALLOWED)
    finally:
        await engine.aclose()
    assert decision.allowed is False
    assert decision.reasons == ("opa_unavailable",)


async def test_slow_opa_denies_after_the_timeout(
    opa: OpaRestPolicyEngine, opa_standin: OpaStandIn
) -> None:
    assert (await opa.decide(ALLOWED)).allowed is True
    opa_standin.mode = "slow"
    opa_standin.delay_s = 30.0
    decision = await opa.decide(ALLOWED)
    assert decision.allowed is False
    assert decision.reasons == ("opa_timeout",)
    # denied while OPA was still holding the request: the timeout answered, not OPA
    assert not opa_standin.release.is_set()


async def test_non_200_denies(opa: OpaRestPolicyEngine, opa_standin: OpaStandIn) -> None:
    opa_standin.mode = "error"
    decision = await opa.decide(ALLOWED)
    assert decision.allowed is False
    assert decision.reasons == ("opa_bad_status:500",)


async def test_reply_that_is_not_json_denies(
    opa: OpaRestPolicyEngine, opa_standin: OpaStandIn
) -> None:
    opa_standin.mode = "garbage"
    decision = await opa.decide(ALLOWED)
    assert decision.allowed is False
    assert decision.reasons == ("opa_invalid_reply",)


async def test_bad_input_denied_without_asking_opa(
    opa: OpaRestPolicyEngine, opa_standin: OpaStandIn
) -> None:
    before = len(opa_standin.requests)
    for doc in ({"operation": "drop"}, {"operation": "get", "tenant": 5}, ["x"]):
        decision = await opa.decide(PolicyInput.from_document(doc))
        assert decision.allowed is False
        assert decision.reasons[0].startswith("invalid_input:")
    assert len(opa_standin.requests) == before


async def test_opa_failures_are_recorded_denials(bundle: PolicyBundle) -> None:
    sink = InMemoryEventSink()
    engine = CachingPolicyEngine(
        OpaRestPolicyEngine(bundle, url=closed_port_url(), timeout_s=0.3),
        recorder=EventDecisionRecorder(sink),
    )
    try:
        first = await engine.decide(ALLOWED)
        second = await engine.decide(ALLOWED)
    finally:
        await engine.aclose()
    assert not first.allowed and not second.allowed
    assert engine.decide_cached(ALLOWED) is None
    assert sink.kinds() == [EventKind.POLICY_DECISION, EventKind.POLICY_DECISION]
    assert [e.outcome for e in sink.events] == [Outcome.DENY, Outcome.DENY]
    assert [e.reason for e in sink.events] == ["opa_unavailable", "opa_unavailable"]
    assert sink.events[0].decision_id != sink.events[1].decision_id
    assert sink.events[0].policy_revision == bundle.revision.policy


# -- the CLI against the stand-in ---------------------------------------------------------


async def _kvgov(*args: str, url: str, cwd: Path) -> tuple[int, str]:
    env = {
        **os.environ,
        "KVGOV_POLICY__ENGINE": "opa",
        "KVGOV_POLICY__OPA_URL": url,
        # the stand-in evaluates in this test's process: on a loaded machine the default
        # 0.25 s budget read as "opa_timeout" (CI, 2026-11-27); what is tested here is the CLI
        "KVGOV_POLICY__OPA_TIMEOUT_S": "10",
        "KVGOV_DATA_DIR": str(cwd / ".kvgov"),
        "RUST_BACKTRACE": "0",
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvgov",
        *args,
        env=env,
        cwd=cwd,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await proc.communicate()
    return proc.returncode or 0, out.decode()


async def test_cli_push_then_policy_test_and_eval_through_opa(
    opa_standin: OpaStandIn, tmp_path: Path
) -> None:
    code, out = await _kvgov("policy", "test", url=opa_standin.url, cwd=tmp_path)
    assert code == 1, out  # nothing pushed yet: every test is undefined in OPA

    code, out = await _kvgov("policy", "push", url=opa_standin.url, cwd=tmp_path)
    assert code == 0, out
    assert "pushed kvgov/authz" in out and "pushed kvgov/authz_test" in out
    assert ("PUT", "/v1/data/kvgov/config") in opa_standin.requests

    code, out = await _kvgov("policy", "test", url=opa_standin.url, cwd=tmp_path)
    assert code == 0, out
    assert "0 failed" in out and "engine: opa" in out

    doc = tmp_path / "input.json"
    doc.write_text(
        '{"operation": "put", "tenant": "acme", "key": {"tenant": "acme", "user": null,'
        ' "model": "m"}, "actor": {"user": "u1", "engine": "vllm-acme-0"},'
        ' "request": {"id": "r1", "sensitivity": "restricted"}, "tier": null, "entry": null}'
    )
    code, out = await _kvgov(
        "policy", "eval", "--input", str(doc), url=opa_standin.url, cwd=tmp_path
    )
    assert code == 0, out
    assert '"not_cacheable:restricted"' in out and '"allowed": false' in out

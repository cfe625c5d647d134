"""One question per input in flight: whoever misses on an input the engine is being asked about
awaits that answer (review s11: with ``policy.opa_decision_ttl_s``, every operation on a hot
input that arrived while its expired decision was being refreshed asked OPA itself and recorded
its own first allow: K OPA calls and K ledger rows per input, every TTL)."""

from __future__ import annotations

import asyncio

import pytest

from kvgov.policy.bundle import load_bundle
from kvgov.policy.cache import CachingPolicyEngine
from kvgov.policy.embedded import EmbeddedPolicyEngine
from kvgov.policy.interfaces import Decision, PolicyInput, PolicyRevision
from kvgov.policy.recording import InMemoryDecisionRecorder
from tests.unit.test_policy_cache_ttl import ALLOW, Clock

DENY = PolicyInput(
    operation="put",
    tenant="acme",
    engine="rogue",
    key_tenant="acme",
    actor_user="u1",
    request_id="r1",
    sensitivity="internal",
)


class SlowOpa:
    """The shipped policy answering after a round trip, as OPA over REST does; ``fail`` makes
    the next questions raise (a bug, not a deny)."""

    def __init__(self) -> None:
        self.inner = EmbeddedPolicyEngine(load_bundle())
        self.calls = 0
        self.fail = 0

    @property
    def revision(self) -> PolicyRevision:
        return self.inner.revision

    def decide_cached(self, inp: PolicyInput) -> Decision | None:
        return None

    async def decide(self, inp: PolicyInput) -> Decision:
        self.calls += 1
        await asyncio.sleep(0.005)
        if self.fail:
            self.fail -= 1
            raise RuntimeError("engine bug")
        return await self.inner.decide(inp)

    async def reload(self) -> PolicyRevision:
        return self.inner.revision

    async def aclose(self) -> None:
        return None


def _engine() -> tuple[Clock, InMemoryDecisionRecorder, SlowOpa, CachingPolicyEngine]:
    clock, recorder, opa = Clock(), InMemoryDecisionRecorder(), SlowOpa()
    engine = CachingPolicyEngine(opa, recorder=recorder, decision_ttl_s=10.0, clock=clock)  # type: ignore[arg-type]
    return clock, recorder, opa, engine


async def test_an_expiring_hot_decision_is_refreshed_once_not_once_per_waiting_operation() -> None:
    clock, recorder, opa, engine = _engine()
    assert (await engine.decide(ALLOW)).allowed
    assert opa.calls == 1 and len(recorder.records) == 1
    clock.now += 10.0  # the TTL passed; 20 operations on the same input arrive together

    async def operation() -> bool:
        decision = engine.decide_cached(ALLOW) or await engine.decide(ALLOW)
        return decision.allowed

    assert all(await asyncio.gather(*(operation() for _ in range(20))))
    assert opa.calls == 2, f"OPA was asked {opa.calls - 1} times for one expired input"
    assert len(recorder.records) == 2, f"{len(recorder.records) - 1} allows recorded for one TTL"


async def test_a_shared_deny_is_recorded_by_each_operation_it_refuses() -> None:
    _, recorder, opa, engine = _engine()
    answers = await asyncio.gather(*(engine.decide(DENY) for _ in range(5)))
    assert opa.calls == 1
    assert not any(d.allowed for d in answers)
    # each refused operation is on record under its own decision id
    assert len(recorder.records) == 5
    assert len({d.decision_id for d in answers}) == 5


async def test_when_the_question_fails_those_waiting_ask_themselves() -> None:
    _, _, opa, engine = _engine()
    opa.fail = 1
    results = await asyncio.gather(
        *(engine.decide(ALLOW) for _ in range(3)), return_exceptions=True
    )
    assert isinstance(results[0], RuntimeError)  # the one that asked sees its failure
    assert all(isinstance(r, Decision) and r.allowed for r in results[1:])


async def test_a_waiter_cancelled_leaves_the_question_running() -> None:
    _, recorder, opa, engine = _engine()
    leader = asyncio.ensure_future(engine.decide(ALLOW))
    await asyncio.sleep(0)
    waiter = asyncio.ensure_future(engine.decide(ALLOW))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert (await leader).allowed
    assert opa.calls == 1 and len(recorder.records) == 1


async def test_a_reload_meanwhile_does_not_share_the_old_question() -> None:
    _, _, opa, engine = _engine()
    first = asyncio.ensure_future(engine.decide(ALLOW))
    await asyncio.sleep(0)
    await engine.reload()  # new answers must come from the engine as it is now
    second = await engine.decide(ALLOW)
    assert (await first).allowed and second.allowed
    assert opa.calls == 2

"""The data plane asks the decision cache by the input's fields (no :class:`PolicyInput` built on
a hit, issue 16): the key it makes must be exactly the one :meth:`PolicyInput.cache_key` makes
of the input it would have built, for every operation, request shape and entry, or a cached
allow would be served to an input it was not given for (or never served). Real Rego behind the
cache; real pseudonyms."""

from __future__ import annotations

import itertools

import pytest
from prometheus_client import CollectorRegistry

from kvgov.ledger.events import InMemoryEventSink
from kvgov.ledger.pseudonym import Pseudonymizer
from kvgov.policy.bundle import load_bundle
from kvgov.policy.cache import CachingPolicyEngine
from kvgov.policy.embedded import EmbeddedPolicyEngine
from kvgov.policy.interfaces import Decision
from kvgov.proxy.dataplane.admission import Admission
from kvgov.proxy.dataplane.identity import Identity, Who, build_input, resolve
from kvgov.proxy.dataplane.index import EntryMeta
from kvgov.proxy.dataplane.metrics import DataPlaneMetrics
from kvgov.proxy.dataplane.records import Recorder
from kvgov.types import Operation, Scope
from kvgov.wire.messages import RequestContext

KEYS = (
    "llama@1@0@abc@bf16@tenant%acme",
    "llama@1@0@abc@bf16@tenant%acme@user%alice",
    "mistral@1@0@abd@bf16@tenant%demo",
)
CONTEXTS = (
    {},
    {"request_id": "r-1"},
    {"request_id": "r-2", "user": "alice", "sensitivity": "confidential"},
    {"tenant": "acme", "sensitivity": "phi"},
)
IDENTITIES = (
    Identity("vllm-acme-0", "engine:vllm-acme-0"),
    Identity("lm-demo", "lm:lm-demo", unattributed=True),
)
ENTRIES = (
    None,
    EntryMeta("acme", None, None, Scope.TENANT, None, "llama", 1, ("memory",), None, None, None),
    EntryMeta("acme", "o1", "o1", Scope.USER, "phi", "llama", 1, ("memory",), None, None, None),
)


def admission(policy: CachingPolicyEngine) -> Admission:
    return Admission(
        pseudonymizer=Pseudonymizer(b"p" * 32),
        policy=policy,
        metrics=DataPlaneMetrics(CollectorRegistry()),
        recorder=Recorder(InMemoryEventSink()),
    )


def whos(adm: Admission) -> list[Who]:
    out = []
    for identity, raw, ctx in itertools.product(IDENTITIES, KEYS, CONTEXTS):
        who, _ = resolve(identity, raw, RequestContext(**ctx), adm.pseudonymizer, "demo")
        if who is not None:
            out.append(who)
    return out


@pytest.mark.parametrize("vary_on_request_id", [False, True])
async def test_fields_key_is_the_inputs_key(
    vary_on_request_id: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = CachingPolicyEngine(
        EmbeddedPolicyEngine(load_bundle()), vary_on_request_id=vary_on_request_id
    )
    adm = admission(engine)
    asked: list[tuple[object, ...]] = []
    looked_up = engine._cached_allow

    def spy(key: tuple[object, ...]) -> Decision | None:
        asked.append(key)
        return looked_up(key)

    monkeypatch.setattr(engine, "_cached_allow", spy)
    cases = list(itertools.product(whos(adm), Operation, ENTRIES))
    assert len(cases) > 100
    for who, op, entry in cases:
        asked.clear()
        decision = await adm._decide(who, op, entry)
        assert asked == [engine._cache_key(build_input(who, op, entry))]
        again = await adm._decide(who, op, entry)
        if decision.allowed:  # a hit by fields: the allow the input got
            assert again.cached and again.decision_id == decision.decision_id
        else:  # denies are never served from the cache: each is decided (and recorded) anew
            assert not again.allowed and again.decision_id != decision.decision_id


async def test_a_hit_by_fields_is_what_the_input_would_hit() -> None:
    """Across every case, the fields path serves exactly the allows ``decide_cached`` serves."""
    engine = CachingPolicyEngine(EmbeddedPolicyEngine(load_bundle()))
    adm = admission(engine)
    cases = list(itertools.product(whos(adm), Operation, ENTRIES))
    for who, op, entry in cases[::3]:  # a third decided: the rest must miss where theirs did
        await engine.decide(build_input(who, op, entry))
    for who, op, entry in cases:
        by_input = engine.decide_cached(build_input(who, op, entry))
        got = await adm._decide(who, op, entry)
        if by_input is not None:
            assert got is by_input
        else:  # decided anew (or a cached deny, which decide() serves and records again)
            assert not (got.allowed and got.cached)

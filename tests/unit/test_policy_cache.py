"""Decision cache (keyed by revision + input, bounded, invalidated on reload) and the recording
rule (every deny, the first allow of each distinct decision) into a ledger event sink.
Real Rego (embedded engine) behind the cache; the sink is the ledger's InMemoryEventSink."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import pytest

from kvgov.errors import LedgerBackpressureError, LedgerError
from kvgov.ledger.events import Appended, Event, InMemoryEventSink
from kvgov.policy.bundle import load_bundle
from kvgov.policy.cache import CachingPolicyEngine
from kvgov.policy.embedded import EmbeddedPolicyEngine
from kvgov.policy.interfaces import Decision, EntryFacts, PolicyInput
from kvgov.policy.recording import EventDecisionRecorder, InMemoryDecisionRecorder
from kvgov.types import EventKind, Outcome, Scope

ALLOW = PolicyInput(
    operation="put",
    tenant="acme",
    engine="vllm-acme-0",
    key_tenant="acme",
    key_user="u-pseudonym-1",
    actor_user="u-pseudonym-1",
    model="llama",
    request_id="req-1",
    sensitivity="confidential",
    tier="memory",
)
DENY = PolicyInput(operation="put", tenant="acme", engine="rogue", key_tenant="acme")


def cached_engine(**kwargs: object) -> tuple[CachingPolicyEngine, InMemoryEventSink]:
    sink = InMemoryEventSink()
    engine = CachingPolicyEngine(
        EmbeddedPolicyEngine(load_bundle()),
        recorder=EventDecisionRecorder(sink),
        **kwargs,  # type: ignore[arg-type]
    )
    return engine, sink


async def test_first_allow_recorded_then_served_from_cache() -> None:
    engine, sink = cached_engine()
    assert engine.decide_cached(ALLOW) is None  # nothing cached yet
    first = await engine.decide(ALLOW)
    assert first.allowed and not first.cached
    hit = engine.decide_cached(ALLOW)
    assert hit is not None and hit.cached
    assert (hit.decision_id, hit.input_digest, hit.policy_revision) == (
        first.decision_id,
        first.input_digest,
        first.policy_revision,
    )
    again = await engine.decide(ALLOW)
    assert again.cached and again.decision_id == first.decision_id
    assert engine.hits == 2 and engine.misses == 1
    assert len(sink.events) == 1  # the first allow only


async def test_request_id_value_does_not_split_the_cache() -> None:
    """One decision serves every request of the same shape: no ledger row per request."""
    from dataclasses import replace

    engine, sink = cached_engine()
    first = await engine.decide(ALLOW)
    other_request = replace(ALLOW, request_id="req-2")
    hit = engine.decide_cached(other_request)
    assert hit is not None and hit.decision_id == first.decision_id
    assert (await engine.decide(other_request)).decision_id == first.decision_id
    assert engine.misses == 1 and len(sink.events) == 1
    # presence still matters: an input without a request id is its own decision
    assert engine.decide_cached(replace(ALLOW, request_id=None)) is None


async def test_vary_on_request_id_keys_the_cache_on_its_value() -> None:
    from dataclasses import replace

    engine, sink = cached_engine(vary_on_request_id=True)
    await engine.decide(ALLOW)
    assert engine.decide_cached(replace(ALLOW, request_id="req-2")) is None
    await engine.decide(replace(ALLOW, request_id="req-2"))
    assert engine.misses == 2 and len(sink.events) == 2


async def test_every_deny_is_recorded_and_never_served_by_the_fast_path() -> None:
    engine, sink = cached_engine()
    denies = [await engine.decide(DENY) for _ in range(3)]
    assert all(not d.allowed for d in denies)
    assert engine.decide_cached(DENY) is None
    assert engine.misses == 1  # evaluated once, the deny itself was cached
    assert len({d.decision_id for d in denies}) == 3
    assert [e.outcome for e in sink.events] == [Outcome.DENY] * 3
    assert [e.decision_id for e in sink.events] == [d.decision_id for d in denies]


async def test_decision_event_carries_what_the_ledger_needs() -> None:
    engine, sink = cached_engine()
    allowed = await engine.decide(ALLOW)
    denied = await engine.decide(DENY)
    allow_event, deny_event = sink.events
    assert allow_event.kind is EventKind.POLICY_DECISION
    assert allow_event.tenant == "acme"
    assert allow_event.actor == "u-pseudonym-1"
    assert allow_event.request_id == "req-1"
    assert allow_event.principal == "vllm-acme-0"
    assert allow_event.outcome is Outcome.ALLOW and allow_event.reason is None
    assert allow_event.decision_id == allowed.decision_id
    assert allow_event.policy_revision == allowed.policy_revision
    assert allow_event.attrs == {
        "decision_id": allowed.decision_id,
        "policy_revision": allowed.policy_revision,
        "data_revision": allowed.data_revision,
        "input_digest": allowed.input_digest,
        "allowed": True,
        "reasons": [],
        "tiers": ["filesystem", "memory"],
        "ttl_s": 900,
        "scope": "user",
        "sensitivity": "confidential",
        "operation": "put",
        "model": "llama",
    }
    assert deny_event.outcome is Outcome.DENY
    assert deny_event.reason == "engine_not_allowed" == denied.reason
    assert deny_event.attrs["reasons"] == ["engine_not_allowed"]
    json.dumps(dict(allow_event.attrs))  # JSON-ready for the ledger row


async def test_distinct_inputs_are_distinct_decisions() -> None:
    engine, sink = cached_engine()
    a = await engine.decide(ALLOW)
    b = await engine.decide(PolicyInput(**{**_fields(ALLOW), "tier": "filesystem"}))
    assert a.input_digest != b.input_digest
    assert len(sink.events) == 2


def test_every_input_field_keys_the_cache() -> None:
    """The cache keys on a tuple of the input's fields (no copy of the input per lookup): an
    input that differs in any one field, a field added later included, is another key; only
    the request id's value is folded into "present" (test above)."""
    engine, _ = cached_engine()
    base = engine._cache_key(ALLOW)
    changed = {
        "operation": "get",
        "tenant": "other",
        "engine": "vllm-other",
        "key_tenant": "other",
        "key_user": "u-pseudonym-2",
        "model": "mistral",
        "actor_user": "u-pseudonym-2",
        "request_id": None,
        "sensitivity": "public",
        "tier": "filesystem",
        "entry": EntryFacts(owner="u-pseudonym-1"),
        "listener": "lm",
        "problems": ("bad",),
    }
    assert set(changed) == {f.name for f in dataclasses.fields(PolicyInput)}
    keys = {base}
    for name, value in changed.items():
        key = engine._cache_key(PolicyInput(**{**_fields(ALLOW), name: value}))
        assert key != base, name
        keys.add(key)
    assert len(keys) == len(changed) + 1
    assert engine._cache_key(PolicyInput(**{**_fields(ALLOW), "request_id": "req-2"})) == base


async def test_reload_invalidates_and_records_under_the_new_revision(tmp_path: Path) -> None:
    data = tmp_path / "data.json"
    config = json.loads(json.dumps(load_bundle().config))
    data.write_text(json.dumps(config))
    inner = EmbeddedPolicyEngine.from_paths(None, data)
    sink = InMemoryEventSink()
    engine = CachingPolicyEngine(inner, recorder=EventDecisionRecorder(sink))
    before = await engine.decide(ALLOW)
    assert engine.decide_cached(ALLOW) is not None

    config["classes"]["confidential"]["max_ttl_s"] = 60
    data.write_text(json.dumps(config))
    revision = await engine.reload()
    assert revision.data != before.data_revision
    assert engine.decide_cached(ALLOW) is None  # the old answer is gone
    after = await engine.decide(ALLOW)
    assert after.ttl_s == 60 and after.data_revision == revision.data
    assert [e.attrs["data_revision"] for e in sink.events] == [
        before.data_revision,
        revision.data,
    ]


async def test_invalid_reload_keeps_the_old_policy(tmp_path: Path) -> None:
    data = tmp_path / "data.json"
    data.write_text(json.dumps(load_bundle().config))
    engine = CachingPolicyEngine(EmbeddedPolicyEngine.from_paths(None, data))
    revision = engine.revision
    data.write_text("{ not json")
    with pytest.raises(Exception, match="line 1"):
        await engine.reload()
    assert engine.revision == revision
    assert (await engine.decide(ALLOW)).allowed


async def test_cache_is_bounded_lru() -> None:
    engine, _ = cached_engine(max_entries=2)
    inputs = [PolicyInput(**{**_fields(ALLOW), "model": f"model-{i}"}) for i in range(3)]
    for inp in inputs:
        await engine.decide(inp)
    assert len(engine) == 2
    assert engine.decide_cached(inputs[0]) is None
    assert engine.decide_cached(inputs[2]) is not None


async def test_cache_disabled_with_zero_entries() -> None:
    engine, sink = cached_engine(max_entries=0)
    await engine.decide(ALLOW)
    await engine.decide(ALLOW)
    assert engine.decide_cached(ALLOW) is None and len(engine) == 0
    assert len(sink.events) == 2  # each allow is a first allow again


async def test_unhashable_input_is_denied_not_raised() -> None:
    engine, sink = cached_engine()
    bad = PolicyInput(**{**_fields(ALLOW), "tenant": ["acme"]})  # type: ignore[arg-type]
    assert engine.decide_cached(bad) is None
    d = await engine.decide(bad)
    assert not d.allowed and d.reasons == ("invalid_input:tenant",)
    assert len(engine) == 0 and sink.events[-1].outcome is Outcome.DENY


class FailingSink(InMemoryEventSink):
    """Stand-in for a ledger writer whose queue is full."""

    def submit(self, event: Event) -> asyncio.Future[Appended]:
        raise LedgerBackpressureError("ledger queue full")


async def test_allow_that_cannot_be_recorded_becomes_a_deny() -> None:
    engine = CachingPolicyEngine(
        EmbeddedPolicyEngine(load_bundle()), recorder=EventDecisionRecorder(FailingSink())
    )
    d = await engine.decide(ALLOW)
    assert not d.allowed and d.reasons == ("decision_not_recorded",)
    assert engine.decide_cached(ALLOW) is None and len(engine) == 0
    assert not (await engine.decide(DENY)).allowed  # denies stay denies


async def test_durable_recorder_waits_for_the_ledger() -> None:
    sink = InMemoryEventSink()
    engine = CachingPolicyEngine(
        EmbeddedPolicyEngine(load_bundle()), recorder=EventDecisionRecorder(sink, durable=True)
    )
    assert (await engine.decide(ALLOW)).allowed
    assert len(sink.events) == 1


async def test_failed_durable_append_is_a_deny() -> None:
    class BrokenSink(InMemoryEventSink):
        async def append(self, event: Event) -> Appended:
            raise LedgerError("database down")

    engine = CachingPolicyEngine(
        EmbeddedPolicyEngine(load_bundle()),
        recorder=EventDecisionRecorder(BrokenSink(), durable=True),
    )
    assert (await engine.decide(ALLOW)).reasons == ("decision_not_recorded",)


async def test_in_memory_recorder_and_scope() -> None:
    recorder = InMemoryDecisionRecorder()
    engine = CachingPolicyEngine(EmbeddedPolicyEngine(load_bundle()), recorder=recorder)
    d = await engine.decide(ALLOW)
    assert d.scope is Scope.USER
    assert recorder.records == [(ALLOW, d)]
    assert isinstance(recorder.records[0][1], Decision)


def _fields(inp: PolicyInput) -> dict[str, object]:
    return {name: getattr(inp, name) for name in PolicyInput.__dataclass_fields__}

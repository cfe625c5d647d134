"""Differential test: one table of decision cases, identical answers from every engine.

Engines compared: kvgov's embedded engine (regorus RVM bytecode, the default), regorus'
interpreter, and the real OPA engine (``opa-golib-python-bindings``). The table is the cross
product of operations, identities, sensitivities, user scopes, tiers and recorded entries over
the shipped data document, plus malformed inputs (both before and after kvgov's Python-side
validation, so the Rego layer is compared on bad input too).
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from kvgov.policy.bundle import load_bundle
from kvgov.policy.embedded import EmbeddedPolicyEngine
from kvgov.policy.interfaces import Decision, EntryFacts, PolicyInput
from tests.integration.test_policy_opa_standin import GolibPolicyEngine

IDENTITIES = [  # (tenant, key tenant, engine)
    ("acme", "acme", "vllm-acme-0"),
    ("acme", "demo", "vllm-acme-0"),
    ("acme", "acme", "rogue"),
    ("demo", "demo", "anything"),
    ("initech", "initech", "vllm-initech-0"),
    ("nobody", "nobody", "e"),
    (None, "acme", "vllm-acme-0"),
    ("acme", None, "vllm-acme-0"),
    ("", "", None),
]
SENSITIVITIES = [None, "public", "internal", "confidential", "restricted", "phi", "pci", "secret"]
USERS = [(None, "u1"), ("u1", "u1"), ("u1", "u2"), (None, None)]  # (key user, acting user)
TIERS = [None, "redis"]
ENTRIES = [
    None,
    EntryFacts(owner="u1", scope_user=None, sensitivity="internal"),
    EntryFacts(owner="u1", scope_user="u1", sensitivity="confidential"),
    EntryFacts(owner="u1", scope_user=None, sensitivity="restricted"),
    EntryFacts(owner="u1", scope_user="u1", sensitivity=None),
]


def decision_cases() -> list[PolicyInput]:
    cases = []
    for op, ident, sens, users, tier, entry in itertools.product(
        ["put", "get", "exists", "remove"], IDENTITIES, SENSITIVITIES, USERS, TIERS, ENTRIES
    ):
        if entry is not None and op == "put" and entry.sensitivity != "internal":
            continue  # keep the table small: puts over existing entries once
        tenant, key_tenant, engine = ident
        cases.append(
            PolicyInput(
                operation=op,
                tenant=tenant,
                engine=engine,
                key_tenant=key_tenant,
                key_user=users[0],
                model="llama",
                actor_user=users[1],
                request_id="req-1",
                sensitivity=sens,
                tier=tier,
                entry=entry,
            )
        )
    return cases


BAD_INPUTS: list[object] = [
    "not an object",
    {"operation": "drop", "tenant": "acme"},
    {"operation": 5},
    {"operation": "get", "tenant": ["acme"], "key": {"tenant": "acme"}},
    {"operation": "get", "key": "acme", "actor": {"engine": "vllm-acme-0"}},
    {"operation": "put", "tenant": "acme", "actor": {"user": 7, "engine": "vllm-acme-0"}},
    {"operation": "get", "tenant": "acme", "entry": "yes"},
    {"operation": "put", "tenant": "acme", "extra": 1},
]

#: raw documents evaluated by the Rego layer itself (no Python-side validation first)
RAW_DOCUMENTS: list[dict[str, Any]] = [
    {},
    {"operation": "drop"},
    {"operation": 5, "tenant": "acme"},
    {
        "operation": "put",
        "tenant": 5,
        "key": {"tenant": "acme", "user": ["u1"], "model": None},
        "actor": {"user": "u1", "engine": "vllm-acme-0"},
        "request": {"id": None, "sensitivity": None},
        "tier": None,
        "entry": None,
    },
    {
        "operation": "get",
        "tenant": "acme",
        "key": {"tenant": "acme", "user": None, "model": None},
        "actor": {"user": "u1", "engine": "vllm-acme-0"},
        "request": {"id": None, "sensitivity": None},
        "tier": None,
        "entry": "yes",
    },
    {
        "operation": "put",
        "tenant": "acme",
        "key": {"tenant": "acme"},
        "actor": {"engine": "vllm-acme-0"},
        "request": {},
    },
]


def answer(d: Decision) -> tuple[Any, ...]:
    return (d.allowed, d.reasons, d.tiers, d.ttl_s, d.scope, d.sensitivity if d.allowed else None)


@pytest.fixture(scope="module")
def engines() -> dict[str, Any]:
    bundle = load_bundle()
    rvm = EmbeddedPolicyEngine(bundle)
    assert rvm.mode == "rvm"
    interpreter = EmbeddedPolicyEngine(bundle, rvm=False)
    assert interpreter.mode == "interpreter"
    return {"rvm": rvm, "interpreter": interpreter, "opa": GolibPolicyEngine(bundle)}


def test_table_covers_allows_and_every_denial(engines: dict[str, Any]) -> None:
    reasons: set[str] = set()
    allowed = 0
    for inp in decision_cases():
        d = engines["rvm"].decide_sync(inp)
        allowed += d.allowed
        reasons.update(r.split(":")[0] for r in d.reasons)
    assert allowed > 100
    assert reasons >= {
        "missing_tenant",
        "unknown_tenant",
        "tenant_disabled",
        "engine_not_allowed",
        "missing_key_tenant",
        "tenant_mismatch",
        "not_cacheable",
        "label_not_allowed",
        "user_scope_required",
        "user_scope_mismatch",
        "tier_not_allowed",
        "unknown_sensitivity",
    }


@pytest.mark.slow
def test_embedded_and_opa_give_identical_answers(engines: dict[str, Any]) -> None:
    cases = decision_cases()
    assert len(cases) > 3000
    mismatches = []
    for i, inp in enumerate(cases):
        # regorus' interpreter (used only for operators' policies the RVM cannot compile) is
        # ~5x slower: it gets every 7th case
        names = ["rvm", "opa", "interpreter"] if i % 7 == 0 else ["rvm", "opa"]
        answers = {name: answer(engines[name].decide_sync(inp)) for name in names}
        if len(set(answers.values())) != 1:
            mismatches.append((inp, answers))
    assert mismatches == []


@pytest.mark.parametrize("doc", BAD_INPUTS, ids=lambda d: repr(d)[:40])
def test_bad_input_denied_identically(engines: dict[str, Any], doc: object) -> None:
    inp = PolicyInput.from_document(doc)
    answers = {name: answer(engine.decide_sync(inp)) for name, engine in engines.items()}
    assert len(set(answers.values())) == 1, answers
    allowed, reasons, *_ = answers["rvm"]
    assert allowed is False
    assert all(r.startswith("invalid_input:") for r in reasons)


@pytest.mark.parametrize("doc", RAW_DOCUMENTS, ids=lambda d: repr(d)[:40])
def test_rego_layer_agrees_on_raw_documents(engines: dict[str, Any], doc: dict[str, Any]) -> None:
    import json

    rvm = json.loads(engines["rvm"]._evaluate(json.dumps(doc)))
    interpreter = json.loads(engines["interpreter"]._evaluate(json.dumps(doc)))
    opa = engines["opa"].raw(doc)
    assert rvm == interpreter == opa
    assert opa["allowed"] is False

"""The embedded engine, startup validation of policies and data, the factory, UnsafeAllowAll,
and the input/decision contract. Real Rego evaluation throughout (regorus)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvgov.config import Settings
from kvgov.errors import PolicyError
from kvgov.policy.allow_all import UnsafeAllowAll
from kvgov.policy.bundle import load_bundle
from kvgov.policy.cache import CachingPolicyEngine
from kvgov.policy.embedded import EmbeddedPolicyEngine
from kvgov.policy.factory import build_inner_engine, build_policy_engine
from kvgov.policy.interfaces import (
    Decision,
    EntryFacts,
    PolicyInput,
    PolicyRevision,
)
from kvgov.policy.opa import OpaRestPolicyEngine
from kvgov.types import Operation, Scope

SHIPPED = load_bundle()
REV = PolicyRevision("p", "d")


def put(**overrides: object) -> PolicyInput:
    fields: dict[str, object] = {
        "operation": Operation.PUT,
        "tenant": "acme",
        "engine": "vllm-acme-0",
        "key_tenant": "acme",
        "actor_user": "u1",
        "model": "llama",
        "request_id": "r1",
        "sensitivity": "internal",
    }
    fields.update(overrides)
    return PolicyInput(**fields)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def engine() -> EmbeddedPolicyEngine:
    return EmbeddedPolicyEngine(SHIPPED)


# -- decisions ----------------------------------------------------------------------------


async def test_allow_carries_tiers_ttl_scope_and_revisions(engine: EmbeddedPolicyEngine) -> None:
    d = await engine.decide(put())
    assert engine.mode == "rvm"
    assert d.allowed and d.reasons == ()
    assert d.tiers == ("filesystem", "memory")
    assert d.ttl_s == 3600  # acme caps internal at 1 h (class max 6 h)
    assert d.scope is Scope.TENANT
    assert d.sensitivity == "internal"
    assert (d.policy_revision, d.data_revision) == (SHIPPED.revision.policy, SHIPPED.revision.data)
    assert d.input_digest == put().digest()
    assert len(d.decision_id) == 32 and not d.cached


async def test_denies_name_the_rule(engine: EmbeddedPolicyEngine) -> None:
    cases = {
        "unknown_tenant": put(tenant="nobody", key_tenant="nobody"),
        "tenant_disabled": put(tenant="initech", key_tenant="initech", engine="vllm-initech-0"),
        "engine_not_allowed": put(engine="rogue"),
        "tenant_mismatch": put(key_tenant="demo"),
        "not_cacheable:restricted": put(sensitivity="restricted"),
        "user_scope_required": put(sensitivity="confidential"),
        "label_not_allowed:pci": put(sensitivity="pci", key_user="u1"),
        "tier_not_allowed": put(tier="redis"),
    }
    for reason, inp in cases.items():
        d = await engine.decide(inp)
        assert not d.allowed and d.reasons == (reason,), (reason, d.reasons)
        assert d.tiers == () and d.ttl_s is None and d.scope is None


async def test_get_is_judged_by_the_entry(engine: EmbeddedPolicyEngine) -> None:
    entry = EntryFacts(owner="u1", scope_user="u1", sensitivity="confidential")
    owner = await engine.decide(put(operation="get", key_user="u1", entry=entry))
    other = await engine.decide(
        put(operation="get", key_user="u1", actor_user="u2", sensitivity="public", entry=entry)
    )
    assert owner.allowed and owner.scope is Scope.USER
    assert not other.allowed and other.reasons == ("user_scope_mismatch",)


@pytest.mark.parametrize(
    ("inp", "reason"),
    [
        (PolicyInput(operation="drop", tenant="acme", engine="e"), "invalid_input:operation"),
        (PolicyInput(operation=7, tenant="acme", engine="e"), "invalid_input:operation"),  # type: ignore[arg-type]
        (put(tenant=["acme"]), "invalid_input:tenant"),
        (put(key_user={"u": 1}), "invalid_input:key_user"),
        (put(entry="x"), "invalid_input:entry"),
        (put(entry=EntryFacts(owner=5)), "invalid_input:entry.owner"),  # type: ignore[arg-type]
        (PolicyInput.from_document([1, 2]), "invalid_input:document"),
        (PolicyInput.from_document({"operation": "get", "key": "k"}), "invalid_input:key"),
        (PolicyInput.from_document({"operation": "get", "oops": 1}), "invalid_input:unknown:oops"),
        (PolicyInput.from_document({"actor": {"user": 3}}), "invalid_input:actor.user"),
    ],
)
async def test_bad_input_is_a_deny_never_an_exception(
    engine: EmbeddedPolicyEngine, inp: PolicyInput, reason: str
) -> None:
    for candidate in (engine, CachingPolicyEngine(engine), UnsafeAllowAll(("memory",))):
        d = await candidate.decide(inp)
        assert not d.allowed
        assert reason in d.reasons


def test_input_document_shape() -> None:
    entry = EntryFacts(owner="o", scope_user=None, sensitivity="internal")
    doc = put(entry=entry, tier="memory").to_document()
    assert doc == {
        "operation": "put",
        "tenant": "acme",
        "key": {"tenant": "acme", "user": None, "model": "llama"},
        "actor": {"user": "u1", "engine": "vllm-acme-0", "listener": None},
        "request": {"id": "r1", "sensitivity": "internal"},
        "tier": "memory",
        "entry": {"owner": "o", "scope_user": None, "sensitivity": "internal"},
    }
    assert PolicyInput.from_document(doc) == put(entry=entry, tier="memory")


@pytest.mark.parametrize(
    ("result", "what"),
    [
        (None, "not_an_object"),
        ({"allowed": "yes"}, "allowed"),
        ({"allowed": True, "reasons": "none"}, "reasons"),
        ({"allowed": True, "tiers": [1]}, "tiers"),
        ({"allowed": True, "ttl_s": 1.5}, "ttl_s"),
        ({"allowed": True, "ttl_s": True}, "ttl_s"),
        # an allowed put with a TTL of 0 was stored without expiry ("keep nothing" became
        # "keep for ever"); below 0 is as meaningless
        ({"allowed": True, "ttl_s": 0}, "ttl_s"),
        ({"allowed": True, "ttl_s": -60}, "ttl_s"),
        ({"allowed": True, "scope": "world"}, "scope"),
    ],
)
def test_malformed_policy_answers_deny(result: object, what: str) -> None:
    d = Decision.from_result(result, revision=REV, input_digest="x")
    assert not d.allowed and d.reasons == (f"invalid_decision:{what}",)


async def test_operator_policy_without_rvm_support_falls_back_to_interpreter(
    tmp_path: Path,
) -> None:
    # regorus' RVM compiler does not take `with` (yet); make the decision depend on one
    source = (
        SHIPPED.modules[0]
        .source.replace("sensitivity := _label if {", "sensitivity := _label_with if {")
        .replace(
            "class := cfg.classes[sensitivity]",
            "class := cfg.classes[sensitivity]\n\n"
            '_label_with := x if {\n\tx := _label with input.tier as "memory"\n}',
        )
    )
    (tmp_path / "authz.rego").write_text(source)
    engine = EmbeddedPolicyEngine(load_bundle(tmp_path))
    assert engine.mode == "interpreter"
    d = await engine.decide(put())
    assert d.allowed and d.ttl_s == 3600 and d.tiers == ("filesystem", "memory")
    denied = await engine.decide(put(sensitivity="restricted"))
    assert denied.reasons == ("not_cacheable:restricted",)


# -- startup validation -------------------------------------------------------------------


def test_invalid_rego_names_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "authz.rego").write_text(SHIPPED.modules[0].source)
    (tmp_path / "extra.rego").write_text(
        "package kvgov.extra\n\nimport rego.v1\n\nbroken if {\n\tinput.x ==\n}\n"
    )
    with pytest.raises(PolicyError) as err:
        load_bundle(tmp_path)
    assert "extra.rego line 7" in err.value.message


def test_invalid_data_json_names_file_and_line(tmp_path: Path) -> None:
    data = tmp_path / "tenants.json"
    data.write_text('{\n  "tenants": {\n    "acme": {,}\n  }\n}\n')
    with pytest.raises(PolicyError) as err:
        load_bundle(None, data)
    assert f"{data} line 3" in err.value.message


def test_data_of_the_wrong_shape_names_the_field(tmp_path: Path) -> None:
    config = json.loads(json.dumps(SHIPPED.config))
    config["tenants"]["acme"]["engines"] = "vllm-acme-0"
    config["classes"]["public"]["max_ttl_s"] = -1
    data = tmp_path / "data.json"
    data.write_text(json.dumps(config))
    with pytest.raises(PolicyError) as err:
        load_bundle(None, data)
    assert "tenants.acme.engines" in err.value.message
    assert "classes.public.max_ttl_s" in err.value.message


def test_policy_without_a_decision_is_refused(tmp_path: Path) -> None:
    (tmp_path / "authz.rego").write_text(
        "package kvgov.authz\n\nimport rego.v1\n\ndecision := true if input.x\n"
    )
    with pytest.raises(PolicyError, match="must always be an object"):
        load_bundle(tmp_path)
    (tmp_path / "authz.rego").write_text("package other\n\nimport rego.v1\n\nx := 1\n")
    with pytest.raises(PolicyError, match=r"package kvgov\.authz"):
        load_bundle(tmp_path)


def test_missing_policy_dir_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="not found"):
        load_bundle(tmp_path / "nope")
    with pytest.raises(PolicyError, match=r"no \.rego files"):
        load_bundle(tmp_path)


def test_revisions_follow_content(tmp_path: Path) -> None:
    (tmp_path / "authz.rego").write_text(SHIPPED.modules[0].source)
    same = load_bundle(tmp_path)
    assert same.revision.policy == SHIPPED.revision.policy
    (tmp_path / "authz.rego").write_text(SHIPPED.modules[0].source + "\n# changed\n")
    (tmp_path / ".manifest").write_text('{"revision": "v42"}')
    changed = load_bundle(tmp_path)
    assert changed.revision.policy.startswith("v42+sha256:")
    assert changed.revision.policy != SHIPPED.revision.policy
    assert SHIPPED.revision.data.startswith("kvgov-example-1+sha256:")


# -- factory ------------------------------------------------------------------------------


def test_factory_builds_each_engine(tmp_path: Path) -> None:
    embedded = build_policy_engine(Settings(data_dir=tmp_path))
    assert isinstance(embedded, CachingPolicyEngine)
    assert isinstance(embedded.inner, EmbeddedPolicyEngine)
    assert embedded.max_entries == 65_536
    opa = build_inner_engine(
        Settings(data_dir=tmp_path, policy={"engine": "opa", "opa_url": "http://opa:8181"})
    )
    assert isinstance(opa, OpaRestPolicyEngine)
    assert opa.revision == SHIPPED.revision
    allow_all = build_inner_engine(
        Settings(data_dir=tmp_path, policy={"engine": "unsafe-allow-all"})
    )
    assert isinstance(allow_all, UnsafeAllowAll)


def test_factory_stops_startup_on_invalid_policy(tmp_path: Path) -> None:
    (tmp_path / "authz.rego").write_text("package kvgov.authz\nimport rego.v1\nx if {\n")
    with pytest.raises(PolicyError, match=r"authz\.rego line"):
        build_policy_engine(Settings(data_dir=tmp_path, policy={"policy_dir": tmp_path}))
    with pytest.raises(PolicyError, match="opa_url"):
        build_inner_engine(Settings(data_dir=tmp_path, policy={"engine": "opa", "opa_url": "x"}))


async def test_unsafe_allow_all_allows_everything_well_formed() -> None:
    engine = UnsafeAllowAll(("memory", "filesystem"))
    d = await engine.decide(put(tenant="nobody", sensitivity="restricted", key_user="u9"))
    assert d.allowed and d.tiers == ("memory", "filesystem") and d.scope is Scope.USER
    assert d.policy_revision == "unsafe-allow-all"

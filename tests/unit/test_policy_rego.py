"""The shipped Rego unit tests (``authz_test.rego``), one pytest test per Rego test per engine:
regorus (kvgov's embedded engine) and the real OPA engine when its bindings are installed.
Plus: the runner notices failures, and ``kvgov policy test`` passes and counts them.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvgov.cli.main import build_app
from kvgov.policy import testing
from kvgov.policy.bundle import load_bundle

BUNDLE = load_bundle()
RULES = testing.discover_test_rules(BUNDLE)


def _opa_evaluator() -> testing.RuleEvaluator:
    opa_bindings = pytest.importorskip("opa_bindings")
    engine = opa_bindings.OpaEngine()
    for module in BUNDLE.modules + BUNDLE.tests:
        engine.add_policy(module.name, module.source)
    engine.add_data(BUNDLE.data_document())

    def evaluate(rule: str) -> object:
        try:
            return engine.eval_document(rule.removeprefix("data."))
        except opa_bindings.OpaUndefinedError:
            return testing.UNDEFINED

    return evaluate


@pytest.fixture(scope="module")
def regorus_eval() -> testing.RuleEvaluator:
    return testing.regorus_evaluator(BUNDLE)


@pytest.fixture(scope="module")
def opa_eval() -> testing.RuleEvaluator:
    return _opa_evaluator()


def test_at_least_one_rego_test_per_rule() -> None:
    names = " ".join(RULES)
    for topic in [
        "missing_tenant",
        "unknown_tenant",
        "disabled_tenant",
        "engine_not_allowed",
        "key_tenant_must_equal",
        "get_never_crosses_tenants",
        "restricted_put_denied",
        "phi_denied_unless_tenant_allows",
        "pci_denied_unless_tenant_allows",
        "confidential_requires_user_scoped_key",
        "confidential_only_in_allowed_tiers",
        "class_max_ttl",
        "tenant_ttl_cap",
        "internal_entry_shared_across_users",
        "public_entry_shared_across_users",
        "missing_sensitivity_is_internal",
        "unknown_operation",
        "decision_defined",
    ]:
        assert topic in names, topic
    assert len(RULES) >= 40


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.rsplit(".", 1)[1])
def test_rego_regorus(rule: str, regorus_eval: testing.RuleEvaluator) -> None:
    report = testing.run_tests([rule], regorus_eval, engine="regorus")
    assert report.ok, report.results[0].error


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.rsplit(".", 1)[1])
def test_rego_opa(rule: str, opa_eval: testing.RuleEvaluator) -> None:
    report = testing.run_tests([rule], opa_eval, engine="opa")
    assert report.ok, report.results[0].error


def _copy_policies(tmp_path: Path, *, break_test: bool) -> Path:
    policy_dir = tmp_path / "policies"
    policy_dir.mkdir()
    for module in BUNDLE.modules + BUNDLE.tests:
        source = module.source
        if break_test and module.name.endswith("_test.rego"):
            # the TTL cap is 3600 in the fixture; claim 3601
            source = source.replace("_decide({}).ttl_s == 3600", "_decide({}).ttl_s == 3601")
        (policy_dir / module.name).write_text(source)
    return policy_dir


def test_runner_reports_a_failing_rego_test(tmp_path: Path) -> None:
    broken = load_bundle(_copy_policies(tmp_path, break_test=True))
    report = testing.run_embedded(broken)
    assert not report.ok
    failed = [r.rule for r in report.results if not r.passed]
    assert failed == ["data.kvgov.authz_test.test_tenant_ttl_cap_lowers_never_raises"]
    assert report.passed == len(RULES) - 1


def test_cli_policy_test_passes_with_counts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(build_app(), ["policy", "test"])
    assert result.exit_code == 0, result.output
    match = re.search(r"(\d+) passed, 0 failed", result.output)
    assert match and int(match.group(1)) == len(RULES)


def test_cli_policy_test_fails_on_a_failing_test(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KVGOV_POLICY__POLICY_DIR", str(_copy_policies(tmp_path, break_test=True)))
    result = CliRunner().invoke(build_app(), ["policy", "test"])
    assert result.exit_code == 1, result.output
    assert "FAIL data.kvgov.authz_test.test_tenant_ttl_cap_lowers_never_raises" in result.output
    assert f"{len(RULES) - 1} passed, 1 failed" in result.output

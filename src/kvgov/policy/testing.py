"""Run the Rego unit tests (``test_*`` rules) of a bundle through an engine.

A test passes when its rule evaluates to ``true``; undefined or anything else fails, and an
evaluation error is a failure with its message. The runner takes any :data:`RuleEvaluator`
(a rule path in, its value or :data:`UNDEFINED` out), so the same tests run through regorus
here, through an OPA server over REST (``kvgov policy test`` with ``policy.engine = "opa"``)
and, in the test suite, through the real OPA engine.

regorus runs tests with its interpreter: its RVM compiler does not support ``with``, which
Rego tests rely on. The differential tests check the RVM against the interpreter and OPA.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Final

from kvgov.policy.bundle import PolicyBundle, rego_error_text

UNDEFINED: Final = object()

#: evaluates ``data.<package>.<rule>`` with an empty input; returns the value or UNDEFINED
RuleEvaluator = Callable[[str], object]


@dataclass(frozen=True, slots=True)
class RegoTestResult:
    rule: str
    passed: bool
    error: str | None = None


@dataclass(frozen=True, slots=True)
class RegoTestReport:
    engine: str
    results: tuple[RegoTestResult, ...]

    @property
    def passed(self) -> int:
        return sum(1 for r in self.results if r.passed)

    @property
    def failed(self) -> int:
        return len(self.results) - self.passed

    @property
    def ok(self) -> bool:
        return bool(self.results) and self.failed == 0


def discover_test_rules(bundle: PolicyBundle) -> list[str]:
    """Every ``data.<package>.test_*`` rule of the bundle's test modules, in file order."""
    rules: list[str] = []
    for module in bundle.tests:
        rules.extend(r for r in module.test_rules() if r not in rules)
    return rules


def run_tests(rules: Iterable[str], evaluate: RuleEvaluator, *, engine: str) -> RegoTestReport:
    results: list[RegoTestResult] = []
    for rule in rules:
        try:
            value = evaluate(rule)
        except Exception as exc:  # noqa: BLE001 - a broken test is a failed test, with its message
            results.append(RegoTestResult(rule, passed=False, error=rego_error_text(exc)))
            continue
        if value is True:
            results.append(RegoTestResult(rule, passed=True))
        elif value is UNDEFINED:
            results.append(RegoTestResult(rule, passed=False, error="undefined (a check failed)"))
        else:
            results.append(RegoTestResult(rule, passed=False, error=f"evaluated to {value!r}"))
    return RegoTestReport(engine=engine, results=tuple(results))


def _constant(value: object) -> RuleEvaluator:
    def evaluate(_rule: str) -> object:
        return value

    return evaluate


def regorus_evaluator(bundle: PolicyBundle) -> RuleEvaluator:
    """Evaluate rules of the bundle's policies and tests with regorus' interpreter."""
    import regorus

    engine = regorus.Engine()
    for module in bundle.modules + bundle.tests:
        engine.add_policy(module.name, module.source)
    engine.add_data(bundle.data_document())
    engine.set_input({})

    def evaluate(rule: str) -> object:
        value: object = engine.eval_rule(rule)
        return UNDEFINED if value is None else value

    return evaluate


def run_embedded(bundle: PolicyBundle) -> RegoTestReport:
    rules = discover_test_rules(bundle)
    return run_tests(rules, regorus_evaluator(bundle), engine="embedded (regorus)")


def opa_error_text(exc: Exception) -> str:
    """What to print of a failed OPA request: its HTTP status, or the error's class. Never the
    exception's repr: aiohttp's holds the request's headers, the bearer token among them."""
    import aiohttp

    if isinstance(exc, aiohttp.ClientResponseError):
        text = f"OPA: HTTP {exc.status}"
        if exc.status in (401, 403):
            text += " (this OPA refuses test rules to this token: run them on an OPA of your own)"
        return text
    return f"OPA: {type(exc).__name__}"


async def run_opa(
    bundle: PolicyBundle,
    *,
    url: str,
    token: str | None = None,
    timeout_s: float = 5.0,
    opa_uids: Collection[int] | None = None,
) -> RegoTestReport:
    """Evaluate the test rules in an OPA server (push them first: ``kvgov policy push``)."""
    import aiohttp

    from kvgov.policy.opa_channel import OpaEndpoint, opa_client

    endpoint = OpaEndpoint.parse(url)
    results: list[RegoTestResult] = []
    async with opa_client(endpoint, timeout_s=timeout_s, token=token, opa_uids=opa_uids) as client:
        for rule in discover_test_rules(bundle):
            package, _, name = rule.removeprefix("data.").rpartition(".")
            try:
                body = await client.query_rule({}, package, name)
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                results.append(RegoTestResult(rule, passed=False, error=opa_error_text(exc)))
                continue
            value = body.get("result", UNDEFINED) if isinstance(body, dict) else UNDEFINED
            results.extend(run_tests([rule], _constant(value), engine="opa").results)
    return RegoTestReport(engine=f"opa ({url})", results=tuple(results))

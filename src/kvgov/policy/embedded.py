"""The embedded Rego engine (the default): regorus, in process, no extra service.

Policies are compiled once into a regorus RVM program (bytecode) with ``data.kvgov.authz.decision``
as its entry point; evaluating it costs tens of microseconds where regorus' tree-walking
interpreter costs hundreds for the same policy (``bench/policy.py``). Policies the RVM compiler
cannot take (it does not support ``with`` yet) fall back to the interpreter, with a warning.

regorus engines are not thread-safe: one program per engine, evaluations serialised by a lock.
Evaluation runs inline on the caller's thread (the event loop): it is shorter than a hop to a
worker thread would be.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvgov.logging import get_logger
from kvgov.policy.bundle import PolicyBundle, load_bundle, rego_error_text
from kvgov.policy.interfaces import (
    DECISION_RULE,
    POLICY_PACKAGE,
    Decision,
    DenyReason,
    PolicyInput,
    PolicyRevision,
    canonical_json,
    safe_digest,
    text_digest,
    validated_document,
)

log = get_logger(__name__)

DECISION_PATH = f"data.{POLICY_PACKAGE}.{DECISION_RULE}"
_UNDEFINED = '"<undefined>"'

#: evaluates one JSON input document, returns the decision as JSON text (or _UNDEFINED)
_Evaluator = Callable[[str], str]


def _compile(bundle: PolicyBundle, *, rvm: bool = True) -> tuple[_Evaluator, str]:
    """Build the evaluator for a bundle: RVM bytecode when it compiles, else the interpreter."""
    import regorus

    data_json = json.dumps(bundle.data_document())
    modules = [(m.name, m.source) for m in bundle.modules]
    program = None
    if rvm:
        try:
            program = regorus.Program.compile_from_modules(data_json, modules, [DECISION_PATH])
        except RuntimeError as exc:
            log.warning(
                "policy.rvm_unavailable",
                extra={"error": rego_error_text(exc).splitlines()[-1:], "mode": "interpreter"},
            )
    if program is not None:
        vm = regorus.Rvm()
        vm.load_program(program)
        vm.set_data_json(data_json)

        def run_vm(input_json: str) -> str:
            vm.set_input_json(input_json)
            return str(vm.execute())

        return run_vm, "rvm"

    engine = regorus.Engine()
    for module in bundle.modules:
        engine.add_policy(module.name, module.source)
    engine.add_data_json(data_json)

    def run_interpreter(input_json: str) -> str:
        engine.set_input_json(input_json)
        result = engine.eval_rule(DECISION_PATH)
        return _UNDEFINED if result is None else json.dumps(result)

    return run_interpreter, "interpreter"


class EmbeddedPolicyEngine:
    """:class:`kvgov.policy.interfaces.PolicyEngine` evaluating Rego in process with regorus."""

    def __init__(
        self,
        bundle: PolicyBundle,
        *,
        loader: Callable[[], PolicyBundle] | None = None,
        rvm: bool = True,
    ) -> None:
        """``rvm=False`` forces regorus' interpreter (for comparisons; slower)."""
        self._lock = threading.Lock()
        self._loader = loader
        self._bundle = bundle
        self._rvm = rvm
        self._evaluate, self.mode = _compile(bundle, rvm=rvm)

    @classmethod
    def from_paths(
        cls, policy_dir: Path | None = None, data_file: Path | None = None
    ) -> EmbeddedPolicyEngine:
        def loader() -> PolicyBundle:
            return load_bundle(policy_dir, data_file)

        return cls(loader(), loader=loader)

    @property
    def revision(self) -> PolicyRevision:
        return self._bundle.revision

    @property
    def bundle(self) -> PolicyBundle:
        return self._bundle

    def decide_cached(self, inp: PolicyInput) -> Decision | None:
        return None

    async def decide(self, inp: PolicyInput) -> Decision:
        return self.decide_sync(inp)

    def decide_sync(self, inp: PolicyInput) -> Decision:
        """Evaluate now, on this thread; never raises."""
        revision = self._bundle.revision
        operation = inp.operation if isinstance(inp.operation, str) else None
        doc, problems = validated_document(inp)
        if doc is None:
            return Decision.deny(
                *problems,
                revision=revision,
                input_digest=safe_digest(inp),
                operation=operation,
            )
        input_json = canonical_json(doc)
        digest = text_digest(input_json)
        try:
            with self._lock:
                revision = self._bundle.revision
                raw = self._evaluate(input_json)
            result: Any = None if raw == _UNDEFINED else json.loads(raw)
        except (RuntimeError, ValueError) as exc:
            log.error("policy.eval_failed", extra={"error": rego_error_text(exc)[:500]})
            return Decision.deny(
                DenyReason.POLICY_ERROR, revision=revision, input_digest=digest, operation=operation
            )
        if result is None:
            return Decision.deny(
                "policy_undefined", revision=revision, input_digest=digest, operation=operation
            )
        return Decision.from_result(
            result, revision=revision, input_digest=digest, operation=operation
        )

    async def reload(self) -> PolicyRevision:
        if self._loader is None:
            return self._bundle.revision
        bundle = self._loader()  # raises PolicyError: the current policies keep answering
        evaluate, mode = _compile(bundle, rvm=self._rvm)
        with self._lock:
            self._bundle, self._evaluate, self.mode = bundle, evaluate, mode
        log.info(
            "policy.reloaded",
            extra={
                "policy_revision": bundle.revision.policy,
                "data_revision": bundle.revision.data,
                "mode": mode,
            },
        )
        return bundle.revision

    async def aclose(self) -> None:
        return None

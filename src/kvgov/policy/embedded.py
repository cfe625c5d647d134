"""The embedded Rego engine (the default): regorus, in process, no extra service.

Policies are compiled once into a regorus RVM program (bytecode) with ``data.kvgov.authz.decision``
as its entry point; evaluating it costs tens of microseconds where regorus' tree-walking
interpreter costs hundreds for the same policy (``bench/policy.py``). Policies the RVM compiler
cannot take (it does not support ``with`` yet) fall back to the interpreter, with a warning.

Threads. regorus objects (``Program``, ``Rvm``, ``Engine``) are bound to the thread that created
them: using one from another thread panics, and dropping one on another thread raises
"unsendable, but is being dropped on another thread" (an unraisable error, a test failure under
``-W error``). So the engine itself holds no regorus object, only a :class:`_Spec` of plain data
(the serialized program, or the module sources for the interpreter). Each thread that evaluates
builds its own VM from the spec on first use (~0.1 ms) and keeps it in a thread-local table:
evaluation runs inline on the caller's thread (the event loop) with no lock and no thread hop,
and a thread's VMs are dropped on that thread when it exits, or by that thread once their spec
is gone (engine collected, policy reloaded). The engine can be built, used and dropped on any
threads.

Reload. :meth:`EmbeddedPolicyEngine.reload` loads, checks and compiles the new sources on a
worker thread (~15-20 ms for the shipped policy, all of which the event loop used to wait out),
then swaps the new ``(bundle, spec)`` in on the caller's thread in one assignment: a decision
reads that pair once, so it sees the old policy or the new one whole, never one's revision with
the other's rules. Reloads that overlap are applied in the order they started. Limit: regorus
holds the GIL inside each of its calls, so the loop still waits out the longest single one
(parsing the shipped ``authz_test.rego``: ~12 ms here; the RVM compile: ~4 ms), no longer the
whole reload. Only another process would take that off the loop.
"""

from __future__ import annotations

import itertools
import json
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvgov.errors import PolicyError
from kvgov.logging import get_logger
from kvgov.policy.bundle import PolicyBundle, load_bundle, off_loop, rego_error_text
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

_tokens = itertools.count(1)
#: tokens of the specs still alive; a thread drops its VMs of the others
_live: set[int] = set()
#: bumped whenever a spec dies, so a thread knows when to sweep its table
_retired = [0]
#: this thread's VMs: ``table`` {spec token: evaluator}, ``seen`` the _retired it last swept at.
#: Module-level on purpose: a thread's entry is freed when that thread exits, on that thread.
_THREAD = threading.local()


def _retire(token: int) -> None:
    _live.discard(token)
    _retired[0] += 1


@dataclass(frozen=True, eq=False)
class _Spec:
    """Everything a thread needs to build its own evaluator; plain data, safe on any thread."""

    mode: str  # "rvm" or "interpreter"
    data_json: str
    modules: tuple[tuple[str, str], ...]
    program: bytes = b""  # the RVM program, serialized
    token: int = field(default_factory=lambda: next(_tokens))

    def __post_init__(self) -> None:
        _live.add(self.token)
        weakref.finalize(self, _retire, self.token)

    def build(self) -> _Evaluator:
        """A new evaluator owned by the calling thread."""
        import regorus

        if self.mode == "rvm":
            program, partial = regorus.Program.deserialize_binary(self.program)
            if partial:  # written by another regorus build: compile from the sources
                program = regorus.Program.compile_from_modules(
                    self.data_json, list(self.modules), [DECISION_PATH]
                )
            vm = regorus.Rvm()
            vm.load_program(program)
            vm.set_data_json(self.data_json)

            def run_vm(input_json: str) -> str:
                vm.set_input_json(input_json)
                return str(vm.execute())

            return run_vm

        engine = regorus.Engine()
        for name, source in self.modules:
            engine.add_policy(name, source)
        engine.add_data_json(self.data_json)

        def run_interpreter(input_json: str) -> str:
            engine.set_input_json(input_json)
            result = engine.eval_rule(DECISION_PATH)
            return _UNDEFINED if result is None else json.dumps(result)

        return run_interpreter

    def evaluator(self) -> _Evaluator:
        """This thread's evaluator for the spec (built on first use)."""
        try:
            return _THREAD.table[self.token]  # type: ignore[no-any-return]
        except AttributeError:
            _THREAD.table, _THREAD.seen = {}, _retired[0]
        except KeyError:
            pass
        table: dict[int, _Evaluator] = _THREAD.table
        if _THREAD.seen != _retired[0]:
            _THREAD.seen = _retired[0]
            for token in [t for t in table if t not in _live]:
                del table[token]  # dropped here, on the thread that built it
        table[self.token] = evaluator = self.build()
        return evaluator

    def release(self) -> None:
        """Drop this thread's evaluator for the spec (other threads drop theirs later)."""
        table = getattr(_THREAD, "table", None)
        if table is not None:
            table.pop(self.token, None)


def _compile(bundle: PolicyBundle, *, rvm: bool = True) -> _Spec:
    """Compile the bundle once (here, to check it): RVM bytecode when it compiles, else the
    interpreter. The regorus objects made here are dropped before returning."""
    import regorus

    data_json = json.dumps(bundle.data_document())
    modules = tuple((m.name, m.source) for m in bundle.modules)
    if rvm:
        try:
            program = regorus.Program.compile_from_modules(
                data_json, list(modules), [DECISION_PATH]
            )
        except RuntimeError as exc:
            log.warning(
                "policy.rvm_unavailable",
                extra={"error": rego_error_text(exc).splitlines()[-1:], "mode": "interpreter"},
            )
        else:
            blob = bytes(program.serialize_binary())
            del program
            return _Spec("rvm", data_json, modules, blob)
    engine = regorus.Engine()
    try:
        for name, source in modules:
            engine.add_policy(name, source)
        engine.add_data_json(data_json)
    except RuntimeError as exc:
        raise PolicyError(f"the policies do not load: {rego_error_text(exc)[:500]}") from exc
    del engine
    return _Spec("interpreter", data_json, modules)


class EmbeddedPolicyEngine:
    """:class:`kvgov.policy.interfaces.PolicyEngine` evaluating Rego in process with regorus.

    Safe to build, use and drop on any threads (see the module docstring)."""

    def __init__(
        self,
        bundle: PolicyBundle,
        *,
        loader: Callable[[], PolicyBundle] | None = None,
        rvm: bool = True,
    ) -> None:
        """``rvm=False`` forces regorus' interpreter (for comparisons; slower)."""
        self._loader = loader
        self._rvm = rvm
        #: (bundle, spec), swapped as one on reload
        self._state = (bundle, _compile(bundle, rvm=rvm))
        #: reloads started, and the number of the one whose policies are in force
        self._reloads_started = 0
        self._reload_in_force = 0

    @classmethod
    def from_paths(
        cls, policy_dir: Path | None = None, data_file: Path | None = None
    ) -> EmbeddedPolicyEngine:
        def loader() -> PolicyBundle:
            return load_bundle(policy_dir, data_file)

        return cls(loader(), loader=loader)

    @property
    def mode(self) -> str:
        """``rvm`` (bytecode) or ``interpreter`` (the fallback)."""
        return self._state[1].mode

    @property
    def revision(self) -> PolicyRevision:
        return self._state[0].revision

    @property
    def bundle(self) -> PolicyBundle:
        return self._state[0]

    def decide_cached(self, inp: PolicyInput) -> Decision | None:
        return None

    async def decide(self, inp: PolicyInput) -> Decision:
        return self.decide_sync(inp)

    def decide_sync(self, inp: PolicyInput) -> Decision:
        """Evaluate now, on this thread (any thread); never raises."""
        bundle, spec = self._state
        revision = bundle.revision
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
            raw = spec.evaluator()(input_json)
            result: object = None if raw == _UNDEFINED else json.loads(raw)
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

    def _evaluate(self, input_json: str) -> str:
        """The raw decision JSON for an input document (differential tests compare engines)."""
        return self._state[1].evaluator()(input_json)

    async def reload(self) -> PolicyRevision:
        """Load and compile the sources on a worker thread, then put them in force at once.
        Raises PolicyError when they are invalid: the current policies keep answering."""
        if self._loader is None:
            return self.revision
        loader, rvm = self._loader, self._rvm
        self._reloads_started += 1
        number = self._reloads_started

        def load_and_compile() -> tuple[PolicyBundle, _Spec]:
            bundle = loader()
            return bundle, _compile(bundle, rvm=rvm)

        state = await off_loop(load_and_compile)
        if number < self._reload_in_force:  # a reload started later (newer sources) is in force
            return self.revision
        old = self._state[1]
        self._state = state  # the swap: one assignment, on the caller's thread
        self._reload_in_force = number
        old.release()
        bundle, spec = state
        log.info(
            "policy.reloaded",
            extra={
                "policy_revision": bundle.revision.policy,
                "data_revision": bundle.revision.data,
                "mode": spec.mode,
            },
        )
        return bundle.revision

    async def aclose(self) -> None:
        """Drop this thread's VM now; other threads drop theirs when they exit or next build."""
        self._state[1].release()

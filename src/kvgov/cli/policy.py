"""``kvgov policy``: test, evaluate and push the Rego policies.

    kvgov policy test [--engine embedded|opa] [--verbose]
    kvgov policy eval --input FILE|- [--engine embedded|opa|unsafe-allow-all]
    kvgov policy push [--url URL] [--no-tests]

``test`` runs the Rego unit tests (``test_*`` rules of ``*_test.rego``) through the configured
engine (regorus, or the OPA server the policies were pushed to) and prints the counts; exit 1
when one fails. ``eval`` prints the decision JSON for an input document (see docs/policy.md).
``push`` loads the policies (with their tests unless ``--no-tests``) and the data document into
an OPA server. Invalid policies or data stop every command with the file and line.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Annotated, Literal

import typer

from kvgov.cli._common import EXIT_FAILED, EXIT_USAGE, echo, emit_json, fail, settings
from kvgov.types import Environment

EngineOpt = Annotated[
    str | None,
    typer.Option("--engine", "-e", help="Engine to use instead of policy.engine."),
]


def register(app: typer.Typer) -> None:
    group = typer.Typer(
        name="policy", help="Rego policies: test, eval, push.", no_args_is_help=True
    )

    @group.command("test")
    def test(
        ctx: typer.Context,
        engine: EngineOpt = None,
        verbose: Annotated[bool, typer.Option("--verbose", "-v", help="List every test.")] = False,
    ) -> None:
        """Run the Rego unit tests through the configured engine; exit 1 if one fails."""
        from kvgov.policy import testing
        from kvgov.policy.factory import load_configured_bundle

        cfg = settings(ctx)
        chosen = _engine_name(engine or cfg.policy.engine, allow_unsafe=False)
        bundle = load_configured_bundle(cfg)
        if chosen == "opa":
            report = asyncio.run(
                testing.run_opa(
                    bundle,
                    url=cfg.policy.opa_url,
                    token=cfg.opa_token,
                    opa_uids=cfg.policy.opa_uids,
                )
            )
        else:
            report = testing.run_embedded(bundle)
        for result in report.results:
            if verbose or not result.passed:
                status = "PASS" if result.passed else "FAIL"
                line = f"{status} {result.rule}"
                echo(line if result.passed else f"{line}\n     {result.error}")
        echo(
            f"{report.passed} passed, {report.failed} failed "
            f"({len(report.results)} tests, engine: {report.engine}, "
            f"policy {bundle.revision.policy})"
        )
        if not report.ok:
            if not report.results:
                raise fail("no test_* rules found in *_test.rego modules", EXIT_FAILED)
            raise typer.Exit(EXIT_FAILED)

    @group.command("eval")
    def eval_(
        ctx: typer.Context,
        input_path: Annotated[
            str, typer.Option("--input", "-i", help="Input document JSON file, or - for stdin.")
        ],
        engine: EngineOpt = None,
    ) -> None:
        """Print the decision JSON for one input document."""
        from kvgov.policy.factory import build_policy_engine
        from kvgov.policy.interfaces import PolicyInput

        cfg = settings(ctx)
        chosen = _engine_name(engine or cfg.policy.engine, allow_unsafe=True)
        raw = sys.stdin.read() if input_path == "-" else _read_input(Path(input_path))
        try:
            doc = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise fail(f"input is not JSON: line {exc.lineno}: {exc.msg}", EXIT_USAGE) from exc
        if chosen == "unsafe-allow-all" and cfg.environment is Environment.PRODUCTION:
            raise fail("unsafe-allow-all is refused in production", EXIT_USAGE)
        if chosen != cfg.policy.engine:
            policy = cfg.policy.model_copy(update={"engine": chosen})
            cfg = cfg.model_copy(update={"policy": policy})
        policy_engine = build_policy_engine(cfg)

        async def decide() -> dict[str, object]:
            try:
                decision = await policy_engine.decide(PolicyInput.from_document(doc))
            finally:
                await policy_engine.aclose()
            return decision.to_dict()

        emit_json(asyncio.run(decide()))

    @group.command("push")
    def push(
        ctx: typer.Context,
        url: Annotated[
            str | None, typer.Option("--url", help="OPA server (default: policy.opa_url).")
        ] = None,
        tests: Annotated[
            bool, typer.Option("--tests/--no-tests", help="Also push the *_test.rego modules.")
        ] = True,
    ) -> None:
        """Load the policies and the data document into an OPA server."""
        from kvgov.policy.factory import load_configured_bundle
        from kvgov.policy.opa import push_bundle

        cfg = settings(ctx)
        bundle = load_configured_bundle(cfg)
        target = url or cfg.policy.opa_url
        # the configured token is the pod's OPA's: it goes to policy.opa_url only, never to
        # another server named on the command line (which would then hold every pod's key)
        token = cfg.opa_token if _same_url(target, cfg.policy.opa_url) else None
        written = asyncio.run(
            push_bundle(
                bundle,
                url=target,
                token=token,
                include_tests=tests,
                opa_uids=cfg.policy.opa_uids,
            )
        )
        for item in written:
            echo(f"pushed {item}")
        echo(
            f"OPA at {target} now runs policy {bundle.revision.policy} "
            f"with data {bundle.revision.data}"
        )

    app.add_typer(group, name="policy")


def _same_url(a: str, b: str) -> bool:
    return a.rstrip("/") == b.rstrip("/")


EngineName = Literal["embedded", "opa", "unsafe-allow-all"]


def _engine_name(name: str, *, allow_unsafe: bool) -> EngineName:
    if name == "embedded":
        return "embedded"
    if name == "opa":
        return "opa"
    if name == "unsafe-allow-all":
        # policy tests are about the Rego policies: allow-all has none, use the embedded engine
        return "unsafe-allow-all" if allow_unsafe else "embedded"
    raise fail(f"unknown engine {name!r}: use embedded, opa or unsafe-allow-all", EXIT_USAGE)


def _read_input(path: Path) -> str:
    try:
        return path.read_text("utf-8")
    except OSError as exc:
        raise fail(f"cannot read {path}: {exc.strerror or exc}", EXIT_USAGE) from exc

"""Root of the ``kvgov`` CLI. Command groups live one per module and are attached here."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from kvgov import __version__
from kvgov.cli._common import EXIT_ERROR, EXIT_USAGE, CliState
from kvgov.errors import ConfigError, KvgovError, StartupError


def build_app() -> typer.Typer:
    """Build the Typer application. Importing this module does nothing else."""
    app = typer.Typer(
        name="kvgov",
        help="Governance and audit layer for LLM KV cache.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
    )

    @app.callback()
    def _root(
        ctx: typer.Context,
        config: Annotated[
            Path | None,
            typer.Option("--config", "-c", help="TOML settings file (env KVGOV_* overrides it)."),
        ] = None,
    ) -> None:
        ctx.obj = CliState(config_file=config)

    @app.command()
    def version() -> None:
        """Print kvgov's version."""
        typer.echo(f"kvgov {__version__}")

    from kvgov.cli import registry

    registry.register(app)
    return app


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: run the CLI and map kvgov errors to exit codes."""
    app = build_app()
    try:
        app(args=argv, prog_name="kvgov", standalone_mode=True)
    except (ConfigError, StartupError) as exc:
        sys.stderr.write(f"kvgov: {exc.diagnostics()}\n")
        sys.exit(EXIT_USAGE)
    except KvgovError as exc:
        sys.stderr.write(f"kvgov: {exc.diagnostics()}\n")
        sys.exit(EXIT_ERROR)

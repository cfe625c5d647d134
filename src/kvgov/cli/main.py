"""Root of the ``kvgov`` CLI. Command groups live one per module and are attached here."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from kvgov import __version__
from kvgov.cli._common import EXIT_ERROR, EXIT_USAGE, CliState
from kvgov.config import mask_url, url_password_problem, url_secret_parts
from kvgov.errors import ConfigError, KvgovError, StartupError

#: the state of the command being run (its settings), for the error edge in :func:`main`
_STATE: list[CliState] = []


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
            typer.Option(
                "--config",
                "-c",
                help="TOML settings file. Sources, highest first: KVGOV_* environment variables,"
                " this file, the defaults file KVGOV_DEFAULTS_FILE names (the image's), the"
                " built-in defaults.",
            ),
        ] = None,
    ) -> None:
        ctx.obj = CliState(config_file=config)
        _STATE[:] = [ctx.obj]

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
    except Exception as exc:
        if not _from_database(exc):
            raise
        # a connection or URL error: the driver's text may quote the URL, or a piece of a
        # password it misread as the host; one line, with every password piece masked
        sys.stderr.write(f"kvgov: {database_error(exc, _STATE[0] if _STATE else None)}\n")
        sys.exit(EXIT_USAGE)


def _from_database(exc: BaseException) -> bool:
    """Whether ``exc`` came from the database driver or from parsing a database URL."""
    import sqlalchemy.exc

    if isinstance(exc, sqlalchemy.exc.SQLAlchemyError):
        return True
    try:
        import psycopg
    except ImportError:  # pragma: no cover - the postgres extra is not installed
        psycopg = None  # type: ignore[assignment]
    if psycopg is not None and isinstance(exc, psycopg.Error):
        return True
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    # make_url's own ValueError (a port that is not a number: part of a password, often)
    return (
        isinstance(exc, ValueError)
        and tb is not None
        and (tb.tb_frame.f_globals.get("__name__", "").startswith("sqlalchemy."))
    )


def database_error(exc: BaseException, state: CliState | None) -> str:
    """One line about a database error that shows no password: the configured URLs masked,
    the driver's first line with every piece of a password in them replaced by ``***``."""
    import sqlalchemy.exc

    urls: list[str] = []
    if state is not None:
        try:
            cfg = state.settings
            urls = list(dict.fromkeys((cfg.database_url, cfg.migration_database_url)))
        except (KvgovError, OSError):
            urls = []
    if isinstance(exc, sqlalchemy.exc.DBAPIError) and exc.orig is not None:
        reason = str(exc.orig)
    elif isinstance(exc, sqlalchemy.exc.SQLAlchemyError | ValueError) and not isinstance(
        exc, sqlalchemy.exc.DBAPIError
    ):
        reason = "not a valid database URL"
    else:
        reason = str(exc)
    reason = (reason.strip().splitlines() or [type(exc).__name__])[0]
    for url in urls:
        for secret in (url, *url_secret_parts(url)):
            reason = reason.replace(secret, "***")
    where = ", ".join(mask_url(url) for url in urls) or "the configured database"
    line = f"cannot use the database ({where}): {reason}"
    problems = [p for p in map(url_password_problem, urls) if p]
    if problems:
        line += f" (the URL is malformed: {problems[0]})"
    return line

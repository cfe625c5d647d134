"""``kvgov db``: database migrations."""

from __future__ import annotations

import typer

from kvgov.cli._common import echo, settings


def register(app: typer.Typer) -> None:
    group = typer.Typer(help="Ledger database.", no_args_is_help=True)

    @group.command("upgrade")
    def upgrade_cmd(
        ctx: typer.Context,
        revision: str = typer.Argument("head", help="Alembic revision to upgrade to."),
    ) -> None:
        """Create or migrate the ledger schema (safe to run again)."""
        from kvgov.ledger.db import current_revision, upgrade

        url = settings(ctx).database_url
        upgrade(url, revision)
        echo(f"database at revision {current_revision(url)}")

    @group.command("current")
    def current_cmd(ctx: typer.Context) -> None:
        """Print the schema revision the database is at."""
        from kvgov.ledger.db import current_revision

        echo(str(current_revision(settings(ctx).database_url) or "none"))

    app.add_typer(group, name="db")

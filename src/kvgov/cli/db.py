"""``kvgov db``: migrations (their own step in production) and the runtime role's grants."""

from __future__ import annotations

from typing import Annotated

import typer

from kvgov.cli._common import echo, settings


def register(app: typer.Typer) -> None:
    group = typer.Typer(help="Ledger database.", no_args_is_help=True)

    @group.command("upgrade")
    def upgrade_cmd(
        ctx: typer.Context,
        revision: str = typer.Argument("head", help="Alembic revision to upgrade to."),
    ) -> None:
        """Migrate the ledger (as the migration role) and grant database.runtime_role."""
        from kvgov.db.engine import current_revision, migrate

        s = settings(ctx)
        applied = migrate(s, revision)
        for rev in applied:
            echo(f"applied revision {rev}")
        url = s.migration_database_url
        echo(
            f"database at revision {current_revision(url)}"
            + ("" if applied else " (nothing to do)")
        )
        if s.database.runtime_role and url.startswith("postgresql"):
            echo(f"granted the runtime privileges to {s.database.runtime_role}")

    @group.command("current")
    def current_cmd(ctx: typer.Context) -> None:
        """Print the schema revision the database is at."""
        from kvgov.db.engine import current_revision

        echo(str(current_revision(settings(ctx).database_url) or "none"))

    @group.command("grants")
    def grants_cmd(
        ctx: typer.Context,
        role: Annotated[
            str | None,
            typer.Option("--role", help="Runtime role (default: database.runtime_role)."),
        ] = None,
        schema: Annotated[str, typer.Option("--schema", help="Schema of the tables.")] = "public",
        apply: Annotated[
            bool, typer.Option("--apply", help="Grant them now, as the migration role.")
        ] = False,
    ) -> None:
        """Print the SQL that gives the runtime role exactly its privileges (for a DBA)."""
        from kvgov.cli._common import EXIT_USAGE, fail
        from kvgov.db.grants import grant_statements

        s = settings(ctx)
        name = role if role is not None else s.database.runtime_role
        if not name:
            raise fail("name the runtime role: --role R or database.runtime_role", EXIT_USAGE)
        if not apply:
            for statement in grant_statements(name, schema):
                echo(statement)
            return
        from kvgov.db.roles import grant_runtime_role

        for statement in grant_runtime_role(s, name):
            echo(statement)

    app.add_typer(group, name="db")

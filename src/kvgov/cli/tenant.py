"""``kvgov tenant list|retention``: tenants' retention periods.

A tenant's retention bounds how long any of its entries stays cached: every sidecar's sweeper
deletes older entries from every tier, verifies them gone and records ``kv:expired`` (reason
``retention``). Setting it is a ledger event (``tenant:retention:set``), recorded before the
change is written, like ``PUT /v1/tenants/{tenant}/retention``.
"""

from __future__ import annotations

import asyncio
import getpass
from typing import Annotated

import typer

from kvgov.cli._common import EXIT_USAGE, append_events, echo, emit_json, fail, settings, shown


def register(app: typer.Typer) -> None:
    group = typer.Typer(name="tenant", help="Tenants' retention periods.", no_args_is_help=True)

    @group.command("list")
    def list_(
        ctx: typer.Context,
        as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    ) -> None:
        """List the tenants the ledger knows, with their retention."""
        from kvgov.db.engine import make_engine, make_sessionmaker
        from kvgov.db.tenants import TenantRepository

        engine = make_engine(settings(ctx).database_url)
        try:
            with make_sessionmaker(engine)() as session:
                records = TenantRepository(session).all()
        finally:
            engine.dispose()
        if as_json:
            emit_json([{"id": r.id, "retention_s": r.retention_s} for r in records])
            return
        for r in records:
            echo(
                f"{shown(r.id)}\tretention={'-' if r.retention_s is None else f'{r.retention_s}s'}"
            )

    @group.command("retention")
    def retention(
        ctx: typer.Context,
        tenant: Annotated[str, typer.Argument(help="The tenant id.")],
        seconds: Annotated[
            int | None,
            typer.Option("--seconds", "-s", help="Delete this tenant's entries older than this."),
        ] = None,
        clear: Annotated[bool, typer.Option("--clear", help="Remove the retention.")] = False,
    ) -> None:
        """Set (or --clear) how long a tenant's entries may stay cached."""
        from kvgov.db.engine import make_engine, make_sessionmaker
        from kvgov.db.tenants import TenantRepository, check_retention
        from kvgov.errors import KvgovError
        from kvgov.ledger.events import Event
        from kvgov.types import EventKind

        if (seconds is None) == (not clear):
            raise fail("kvgov: give --seconds N or --clear", EXIT_USAGE)
        value = None if clear else seconds
        try:
            check_retention(tenant, value)
        except KvgovError as exc:
            raise fail(f"kvgov: {exc.diagnostics()}", EXIT_USAGE) from None
        s = settings(ctx)
        engine = make_engine(s.database_url)
        try:
            event = Event(
                kind=EventKind.TENANT_RETENTION_SET,
                tenant=tenant,
                principal=f"cli:{getpass.getuser()}",
                attrs={"retention_s": value},
            )
            asyncio.run(append_events(s, engine, event))  # recorded before it is written
            with make_sessionmaker(engine).begin() as session:
                TenantRepository(session).set_retention(tenant, value)
        finally:
            engine.dispose()
        echo(f"{tenant}: retention {'cleared' if value is None else f'{value}s'}")

    app.add_typer(group)

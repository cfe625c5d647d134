"""``kvgov token create|list|revoke``: control-plane bearer tokens.

The token is printed once by ``create`` and never again: only its SHA-256 is stored. Creating
and revoking tokens are ledger events, like the same actions over ``/v1/tokens``.
"""

from __future__ import annotations

import asyncio
import getpass
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Annotated

import typer

from kvgov.cli._common import (
    EXIT_OK,
    EXIT_USAGE,
    append_events,
    echo,
    emit_json,
    fail,
    settings,
    shown,
)

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from kvgov.types import EventKind, Role

_ROLES = "auditor, admin or engine"


def register(app: typer.Typer) -> None:
    group = typer.Typer(
        name="token", help="Manage control-plane bearer tokens.", no_args_is_help=True
    )

    @group.command("create")
    def create(
        ctx: typer.Context,
        role: Annotated[str, typer.Option("--role", "-r", help=f"Role: {_ROLES}.")],
        tenant: Annotated[
            str | None,
            typer.Option(
                "--tenant", "-t", help="Limit the token to one tenant (omit: every tenant)."
            ),
        ] = None,
        name: Annotated[str, typer.Option("--name", "-n", help="A label for the token.")] = "",
        as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    ) -> None:
        """Create a token and print it (shown only this once)."""
        from kvgov.db.tenants import TENANT_ID
        from kvgov.db.tokens import TokenRepository, new_token, new_token_id
        from kvgov.types import EventKind, Role

        try:
            role_value = Role(role)
        except ValueError:
            raise fail(f"kvgov: unknown role {role!r} (use {_ROLES})", EXIT_USAGE) from None
        # a given --tenant is a tenant id: `--tenant "$TENANT"` with $TENANT empty must not
        # quietly widen the token to every tenant (omit the option for that)
        if tenant is not None and not TENANT_ID.fullmatch(tenant):
            raise fail(
                f"kvgov: invalid --tenant {tenant!r}: a tenant id is 1-128 letters,"
                " digits, '.', '_' or '-', starting with a letter or digit (omit --tenant for a"
                " token of every tenant)",
                EXIT_USAGE,
            )
        token_id, raw = new_token_id(), new_token()
        with _session(ctx) as (session, record_event):
            # recorded before it exists, with its digest: the ledger may name a token whose
            # commit failed, it never misses one that exists
            record_event(EventKind.TOKEN_CREATED, token_id, role_value, tenant, raw)
            record, token = TokenRepository(session).create(
                role_value, tenant=tenant, name=name, token_id=token_id, token=raw
            )
            session.commit()
        if as_json:
            emit_json({**_as_dict(record), "token": token})
            return
        echo(f"token id: {shown(record.id)}")
        echo(f"role:     {shown(record.role.value)}")
        echo(f"tenant:   {shown(record.tenant or '(all tenants)')}")
        echo(f"name:     {shown(record.name)}")
        echo("")
        echo(token)
        echo("")
        echo("Store this token now: it is not shown again (only its hash is kept).")

    @group.command("list")
    def list_(
        ctx: typer.Context,
        active: Annotated[bool, typer.Option("--active", help="Hide revoked tokens.")] = False,
        as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    ) -> None:
        """List tokens (never the tokens themselves)."""
        from kvgov.db.tokens import TokenRepository

        with _session(ctx) as (session, _):
            records = TokenRepository(session).all(include_revoked=not active)
        if as_json:
            emit_json([_as_dict(r) for r in records])
            return
        if not records:
            echo("no tokens")
            return
        echo(f"{'ID':36}  {'ROLE':7}  {'TENANT':16}  {'STATE':7}  {'LAST USED':19}  NAME")
        for r in records:
            last = r.last_used_at.strftime("%Y-%m-%d %H:%M:%S") if r.last_used_at else "-"
            state = "active" if r.active else "revoked"
            tenant = shown(r.tenant or "*")
            echo(
                f"{shown(r.id):36}  {shown(r.role.value):7}  {tenant:16}  {state:7}  {last:19}"
                f"  {shown(r.name)}"
            )

    @group.command("revoke")
    def revoke(
        ctx: typer.Context,
        token_id: Annotated[str, typer.Argument(help="Token id (from `kvgov token list`).")],
    ) -> None:
        """Revoke a token at once."""
        from kvgov.db.tokens import TokenRepository
        from kvgov.errors import NotFoundError
        from kvgov.types import EventKind

        with _session(ctx) as (session, record_event):
            repo = TokenRepository(session)
            found = repo.get(token_id)
            session.rollback()  # end the read before the ledger writes (SQLite: one writer)
            if found is None:
                raise fail(f"kvgov: {NotFoundError(f'no token with id {token_id!r}').message}")
            record_event(EventKind.TOKEN_REVOKED, found.id, found.role, found.tenant, None)
            record = repo.revoke(token_id)
            session.commit()
        echo(f"revoked {shown(record.id)}")
        raise typer.Exit(EXIT_OK)

    app.add_typer(group)


def _as_dict(record: object) -> dict[str, object]:
    from dataclasses import asdict, is_dataclass

    if not is_dataclass(record) or isinstance(record, type):
        raise TypeError("expected a token record")
    out = asdict(record)
    out["role"] = str(out["role"])
    out["active"] = out["revoked_at"] is None
    return out


@contextmanager
def _session(
    ctx: typer.Context,
) -> Iterator[tuple[Session, Callable[[EventKind, str, Role, str | None, str | None], None]]]:
    """A session on the ledger plus ``record_event``, which appends a token event to this
    node's chain (durably, before the caller commits its change); a creation passes the new
    token, whose digest the event records."""
    from kvgov.db.engine import make_engine, make_sessionmaker

    s = settings(ctx)
    engine = make_engine(s.database_url)

    def record_event(
        kind: EventKind, token_id: str, role: Role, tenant: str | None, token: str | None
    ) -> None:
        from kvgov.services.tokens import token_event

        principal = f"cli:{getpass.getuser()}"
        event = token_event(kind, token_id, role, tenant, principal, token=token)
        asyncio.run(append_events(s, engine, event))

    try:
        with make_sessionmaker(engine)() as session:
            yield session, record_event
    finally:
        engine.dispose()

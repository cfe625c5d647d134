"""``kvgov provenance``: which cached chunks fed a request, and where a user's chunks went.

``kvgov provenance REQUEST_ID [--tenant T]`` lists the chunks the request loaded, in the order
they were served (request ids are scoped by tenant: an id several tenants used needs
``--tenant``), each with its creator (request, user pseudonym, time) and the policy revision that
admitted it. ``kvgov provenance --user U --tenant T`` answers the reverse: which requests reused
chunks that user U created. Raw user ids are pseudonymised with the sidecar's key before the
query; the ledger never holds them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvgov.cli._common import EXIT_FAILED, echo, emit_json, fail, settings

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from kvgov.config import Settings


def register(app: typer.Typer) -> None:
    @app.command("provenance")
    def provenance_cmd(
        ctx: typer.Context,
        request_id: Annotated[
            str | None, typer.Argument(help="The request whose cached inputs to list.")
        ] = None,
        user: Annotated[
            str | None, typer.Option("--user", "-u", help="Reverse query: this user's chunks.")
        ] = None,
        tenant: Annotated[
            str | None,
            typer.Option(
                "--tenant",
                "-t",
                help="Tenant of REQUEST_ID (needed when several tenants used the id) or of --user.",
            ),
        ] = None,
        as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    ) -> None:
        """Show the cached chunks that fed REQUEST_ID (or, with --user, where they went)."""
        from kvgov.db.engine import make_engine, make_sessionmaker

        if (request_id is None) == (user is None):
            raise fail("kvgov: give a REQUEST_ID, or --user with --tenant", 2)
        if user is not None and not tenant:
            raise fail("kvgov: --user needs --tenant", 2)
        s = settings(ctx)
        engine = make_engine(s.database_url)
        try:
            with make_sessionmaker(engine)() as session:
                if request_id is not None:
                    data = _forward(session, request_id, tenant)
                else:
                    data = _reverse(session, s, tenant or "", user or "")
        finally:
            engine.dispose()
        if as_json:
            emit_json(data)
        else:
            _print(data)
        if request_id is not None and not data["chunks"]:
            raise typer.Exit(EXIT_FAILED)


def _forward(session: Session, request_id: str, tenant: str | None) -> dict[str, Any]:
    from kvgov.services.provenance import provenance, request_tenants

    tenants = request_tenants(session, request_id)
    if tenant is None and len(tenants) > 1:
        used = ", ".join(t or "(none)" for t in tenants)
        raise fail(f"kvgov: request id {request_id!r} was used by tenants {used}: give --tenant", 2)
    if tenant is None and tenants:
        tenant = tenants[0]
    chunks = []
    for i, row in enumerate(provenance(session, request_id, tenant)):
        entry = row.entry
        chunks.append(
            {
                "position": i,
                "key_digest": row.key_digest,
                "served_at": row.served_at.isoformat(),
                "tier": row.tier,
                "bytes": row.nbytes,
                "created_by_request": entry.created_request_id if entry else None,
                "created_by_user": entry.owner if entry else None,
                "created_at": entry.created_at.isoformat() if entry else None,
                "tenant": entry.tenant if entry else None,
                "sensitivity": str(entry.sensitivity) if entry and entry.sensitivity else None,
                "policy_revision": entry.policy_revision if entry else None,
                "state": str(entry.state) if entry else None,
            }
        )
    return {"request_id": request_id, "tenant": tenant, "chunks": chunks}


def _reverse(session: Session, s: Settings, tenant: str, user: str) -> dict[str, Any]:
    from kvgov.ledger.pseudonym import Pseudonymizer
    from kvgov.services.provenance import user_reuse

    pseudonym = Pseudonymizer.from_file(s.pseudonym_key_path).user(tenant, user)
    return user_reuse(session, tenant, pseudonym).model_dump(mode="json")


def _print(data: dict[str, Any]) -> None:
    if "chunks" in data:
        chunks = data["chunks"]
        echo(
            f"request {data['request_id']} of tenant {data['tenant']}: "
            f"{len(chunks)} cached chunk(s) loaded"
        )
        for c in chunks:
            echo(
                f"  #{c['position']} {str(c['key_digest'])[:16]}  from request "
                f"{c['created_by_request']} by user {str(c['created_by_user'])[:12]} at "
                f"{c['created_at']}  [{c['sensitivity']}, policy {c['policy_revision']}]"
            )
        return
    echo(f"user {data['user'][:12]} in {data['tenant']}: chunks reused by")
    for r in data["requests"]:
        echo(f"  {r['request_id']}: {r['chunks']} chunk(s)")

"""``kvgov provenance``: which cached chunks fed a request, and where a user's chunks went.

``kvgov provenance REQUEST_ID [--tenant T]`` lists the chunks the request loaded, in the order
they were served (request ids are scoped by tenant: an id several tenants used needs
``--tenant``, exit 2), each with its creator (request, user pseudonym, time) and the policy
revision that admitted it; ``--json`` prints the
:class:`~kvgov.services.provenance.RequestProvenance` that ``GET /v1/requests/{id}/provenance``
returns, field for field. Exit 1 when the request is unknown or loaded no cached chunk.
``kvgov provenance --user U --tenant T`` answers the reverse: which requests reused chunks that
user U created (:class:`~kvgov.services.provenance.UserReuse`). Raw user ids are pseudonymised
with the sidecar's key before the query; the ledger never holds them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from kvgov.cli._common import EXIT_FAILED, echo, emit_json, fail, settings, shown
from kvgov.cli.userid import UserFileOpt, user_id

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from kvgov.config import Settings
    from kvgov.services.provenance import RequestProvenance, UserReuse


def register(app: typer.Typer) -> None:
    @app.command("provenance")
    def provenance_cmd(  # noqa: PLR0917 - one parameter per CLI option
        ctx: typer.Context,
        request_id: Annotated[
            str | None, typer.Argument(help="The request whose cached inputs to list.")
        ] = None,
        user: Annotated[
            str | None, typer.Option("--user", "-u", help="Reverse query: this user's chunks.")
        ] = None,
        user_file: UserFileOpt = None,
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

        user = user_id(user, user_file)
        if (request_id is None) == (user is None):
            raise fail("kvgov: give a REQUEST_ID, or --user with --tenant", 2)
        if user is not None and not tenant:
            raise fail("kvgov: --user needs --tenant", 2)
        s = settings(ctx)
        engine = make_engine(s.database_url)
        answer: RequestProvenance | UserReuse
        try:
            with make_sessionmaker(engine)() as session:
                if request_id is not None:
                    answer = _forward(session, request_id, tenant)
                    loaded_nothing = not answer.chunks
                else:
                    answer = _reverse(session, s, tenant or "", user or "")
                    loaded_nothing = False
        finally:
            engine.dispose()
        if as_json:
            emit_json(answer.model_dump(mode="json"))
        else:
            _print(answer)
        if loaded_nothing:
            raise typer.Exit(EXIT_FAILED)


def _forward(session: Session, request_id: str, tenant: str | None) -> RequestProvenance:
    from kvgov.errors import AmbiguousRequestError, NotFoundError
    from kvgov.services.provenance import request_provenance

    try:
        return request_provenance(session, request_id, tenant)
    except AmbiguousRequestError as exc:
        used = ", ".join(t or "(none)" for t in exc.tenants)
        raise fail(
            f"kvgov: request id {request_id!r} was used by tenants {used}: give --tenant", 2
        ) from exc
    except NotFoundError as exc:
        raise fail(f"kvgov: {exc.message}", EXIT_FAILED) from exc


def _reverse(session: Session, s: Settings, tenant: str, user: str) -> UserReuse:
    from sqlalchemy import Engine

    from kvgov.ledger.keypin import pinned_pseudonymizer
    from kvgov.services.provenance import user_reuse

    bind = session.get_bind()
    engine = bind if isinstance(bind, Engine) else None
    pseudonym = pinned_pseudonymizer(s, engine).user(tenant, user)
    return user_reuse(session, tenant, pseudonym)


def _print(answer: RequestProvenance | UserReuse) -> None:
    from kvgov.services.provenance import RequestProvenance

    if isinstance(answer, RequestProvenance):
        echo(
            f"request {shown(answer.request_id)} of tenant {shown(answer.tenant)}: "
            f"{len(answer.chunks)} cached chunk(s) loaded"
        )
        for c in answer.chunks:
            made = c.created
            echo(
                f"  #{c.position} {shown(str(c.key_digest)[:16])}  from request "
                f"{shown(made.request_id if made else None)} by user "
                f"{shown(str(made.user if made else None)[:12])} at "
                f"{made.created_at.isoformat() if made else None}  "
                f"[{shown(c.sensitivity)}, policy {shown(made.policy_revision if made else None)}]"
            )
        return
    echo(f"user {shown(answer.user[:12])} in {shown(answer.tenant)}: chunks reused by")
    for r in answer.requests:
        echo(f"  {shown(r.request_id)}: {r.chunks} chunk(s)")

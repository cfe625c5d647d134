"""The runtime role's privileges on the ledger database (Postgres), table by table.

Migrations run as the owner of the schema; sidecars and the CLI connect as a runtime role that
can read and append but can never alter a table, drop or disable a trigger, truncate, or
update or delete a row of the chained tables (``docs/database.md``).
:data:`kvgov.db.grants.RUNTIME_PRIVILEGES` is that role's whole allowance: UPDATE only where
the code updates, DELETE nowhere (kvgov never deletes a row). ``kvgov db upgrade`` applies it
after migrating (``grants.apply_grants``, under the migration lock) and ``kvgov db grants``
prints it for a DBA; a production sidecar checks its own role against it before it serves
(:func:`runtime_problems`), and refuses a schema that is not at its revision
(:func:`check_schema`).
"""

from __future__ import annotations

from sqlalchemy import Connection, text
from sqlalchemy.exc import ProgrammingError, SQLAlchemyError

from kvgov.config import Settings
from kvgov.db.engine import (
    MigrationLimits,
    error_reason,
    head_revision,
    known_revisions,
    make_engine,
    migration_connection,
    redact_url,
    revision_of,
)
from kvgov.db.grants import RUNTIME_PRIVILEGES, apply_grants
from kvgov.errors import ConfigError, LedgerError, StartupError
from kvgov.logging import get_logger

log = get_logger(__name__)


def grant_runtime_role(settings: Settings, role: str) -> list[str]:
    """``kvgov db grants --apply``: :func:`apply_grants` as the migration role, under the
    migration lock (concurrent GRANTs on one table can fail); the statements run."""
    if not settings.is_postgres:
        raise ConfigError("database roles and grants need a Postgres ledger")
    url = settings.migration_database_url
    try:
        with migration_connection(url, MigrationLimits.of(settings)) as conn:
            return apply_grants(conn, role)
    except SQLAlchemyError as exc:
        raise LedgerError(
            f"granting {role!r} on {redact_url(url)} failed: {error_reason(exc, url)}"
        ) from None


def runtime_problems(conn: Connection, runtime_role: str) -> list[str]:
    """Why the connection's role is not a safe runtime role (empty when it is): a superuser, a
    role that owns a ledger table (or may act as its owner) and so could switch the guard off,
    a role missing a privilege the code needs, or one that is not ``runtime_role``."""
    who = conn.execute(
        text("SELECT current_user, rolsuper FROM pg_roles WHERE rolname = current_user")
    ).one()
    user, superuser = str(who[0]), bool(who[1])
    if superuser:
        return [f"the database role {user!r} is a superuser"]
    problems: list[str] = []
    owned = conn.execute(
        text(
            "SELECT c.relname FROM pg_class AS c WHERE c.oid = ANY("
            "  SELECT to_regclass(t) FROM unnest(CAST(:tables AS text[])) AS t)"
            " AND pg_has_role(current_user, c.relowner, 'MEMBER') ORDER BY 1"
        ),
        {"tables": list(RUNTIME_PRIVILEGES)},
    ).scalars()
    owns = list(owned)
    if owns:
        problems.append(
            f"the database role {user!r} owns (or may act as the owner of) {', '.join(owns)}:"
            " it could disable the ledger's append-only guard"
        )
    missing = conn.execute(
        text(
            "SELECT p.t || ' ' || p.priv FROM unnest(CAST(:tables AS text[]),"
            " CAST(:privs AS text[])) AS p(t, priv)"
            " WHERE NOT COALESCE(has_table_privilege(to_regclass(p.t), p.priv), false)"
        ),
        {
            "tables": [t for t, privs in RUNTIME_PRIVILEGES.items() for _ in privs],
            "privs": [p for privs in RUNTIME_PRIVILEGES.values() for p in privs],
        },
    ).scalars()
    lacks = list(missing)
    if lacks:
        problems.append(f"the database role {user!r} lacks {', '.join(lacks)}")
    if runtime_role and user != runtime_role:
        member = conn.execute(
            text("SELECT pg_has_role(current_user, oid, 'USAGE') FROM pg_roles WHERE rolname = :r"),
            {"r": runtime_role},
        ).scalar()
        if not member:
            problems.append(
                f"the database role {user!r} is not database.runtime_role {runtime_role!r}"
                " nor a member of it"
            )
    return problems


UPGRADE_HINT = (
    "run `kvgov db upgrade` with this release, as the migration role (database.migration_url"
    " or migration_url_file), before starting its sidecars: a production sidecar never migrates"
    " (docs/operations.md, 'Upgrades')"
)


def check_schema(settings: Settings) -> str | None:
    """A production sidecar's start (it never migrates): the ledger database must be at this
    kvgov's head revision, or at a newer one that a later release's ``kvgov db upgrade``
    applied (logged), and the runtime URL's role must be a safe runtime role
    (:func:`runtime_problems`). Raises :class:`StartupError` naming what
    is wrong; returns the database's revision."""
    url = settings.database_url
    code = head_revision()
    engine = make_engine(url, pool_size=1)
    try:
        with engine.connect() as conn:
            postgres = conn.dialect.name == "postgresql"
            problems = runtime_problems(conn, settings.database.runtime_role) if postgres else []
            try:
                with conn.begin_nested():
                    current = revision_of(conn)
            except ProgrammingError:  # alembic_version not readable: a problem reported below
                current = code
    except SQLAlchemyError as exc:
        raise StartupError(
            f"cannot check the ledger database {redact_url(url)}: {error_reason(exc, url)}"
        ) from None
    finally:
        engine.dispose()
    if current != code:
        if current is None or current in known_revisions():
            raise StartupError(
                f"the ledger database is at revision {current or 'none (no schema)'}, this kvgov"
                f" needs revision {code}",
                hint=UPGRADE_HINT,
            )
        log.warning("ledger.schema.newer", extra={"database": current, "code": code})
    if problems:
        raise StartupError(
            "unsafe database role for a production sidecar: " + "; ".join(problems),
            hint="connect sidecars as the runtime role (database.url or url_file); `kvgov db"
            " upgrade` grants database.runtime_role its privileges, `kvgov db grants` prints"
            " the SQL (docs/database.md)",
        )
    return current

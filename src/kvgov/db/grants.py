"""The runtime role's grants, table by table (Postgres): what ``kvgov db upgrade`` applies under
the migration lock and ``kvgov db grants`` prints for a DBA. Why each grant: ``docs/database.md``.
Checks of a running role against them: :mod:`kvgov.db.roles`.
"""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import Connection, text

from kvgov.errors import ConfigError

#: every table kvgov creates, with what the runtime role may do to it
RUNTIME_PRIVILEGES: dict[str, tuple[str, ...]] = {
    # the chained evidence: appended, never changed (the append-only triggers stop the
    # owner's accidents; the runtime role has no privilege to try)
    "ledger_events": ("SELECT", "INSERT"),
    "checkpoints": ("SELECT", "INSERT"),
    "chains": ("SELECT", "INSERT"),
    "chain_seals": ("SELECT", "INSERT"),
    # the fleet's pseudonym key id: the first start records it, nothing changes it (0008)
    "key_pins": ("SELECT", "INSERT"),
    # erasure sets payload and salt to NULL (the chained digest stays)
    "event_payloads": ("SELECT", "INSERT", "UPDATE"),
    # the writer's index upserts; purges mark users erased
    "cache_entries": ("SELECT", "INSERT", "UPDATE"),
    "requests": ("SELECT", "INSERT", "UPDATE"),
    "user_refs": ("SELECT", "INSERT", "UPDATE"),
    "policy_decisions": ("SELECT", "INSERT"),
    # each writer moves its chain's journal mark in its batch's transaction
    "ledger_journal_marks": ("SELECT", "INSERT", "UPDATE"),
    # wrapped data keys: new versions, state changes, destruction (wrapped set to NULL)
    "data_keys": ("SELECT", "INSERT", "UPDATE"),
    # the purge state machine: steps are claimed with FOR UPDATE (which needs UPDATE)
    "purge_jobs": ("SELECT", "INSERT", "UPDATE"),
    "purge_steps": ("SELECT", "INSERT", "UPDATE"),
    "purge_receipts": ("SELECT", "INSERT"),
    # heartbeats; API tokens are revoked and stamped with their last use
    "sidecars": ("SELECT", "INSERT", "UPDATE"),
    "api_tokens": ("SELECT", "INSERT", "UPDATE"),
    # dashboard sign-in adds a session, sign-out (and expiry) deletes it: nothing updates one
    "dashboard_sessions": ("SELECT", "INSERT", "DELETE"),
    # retention set by operators (kvgov tenant retention, the API), read by the sweepers
    "tenants": ("SELECT", "INSERT", "UPDATE"),
    # a production sidecar reads the schema's revision before it starts
    "alembic_version": ("SELECT",),
}

#: sequences behind SERIAL columns (new purge steps draw their ids)
RUNTIME_SEQUENCES: dict[str, str] = {"purge_steps_id_seq": "purge_steps"}


def quote_ident(name: str) -> str:
    """``name`` as a quoted SQL identifier."""
    return '"' + name.replace('"', '""') + '"'


def grant_statements(
    role: str, schema: str = "public", tables: Iterable[str] | None = None
) -> list[str]:
    """The SQL that gives ``role`` exactly the runtime privileges (and nothing else) on the
    ``tables`` that exist (all by default). Each table's privileges are revoked first, so
    running it again after kvgov narrows a grant takes the old privilege away."""
    r, s = quote_ident(role), quote_ident(schema)
    present = set(RUNTIME_PRIVILEGES if tables is None else tables)
    out = [f"GRANT USAGE ON SCHEMA {s} TO {r};"]
    for table, privileges in RUNTIME_PRIVILEGES.items():
        if table not in present:
            continue
        name = f"{s}.{quote_ident(table)}"
        out.append(f"REVOKE ALL ON TABLE {name} FROM {r};")
        out.append(f"GRANT {', '.join(privileges)} ON TABLE {name} TO {r};")
    for sequence, table in RUNTIME_SEQUENCES.items():
        if table in present:
            out.append(f"GRANT USAGE, SELECT ON SEQUENCE {s}.{quote_ident(sequence)} TO {r};")
    return out


def apply_grants(conn: Connection, role: str) -> list[str]:
    """Grant the runtime privileges to ``role`` on the tables of the connection's schema, in
    the caller's transaction; return the statements run. The role must exist."""
    exists = conn.execute(text("SELECT 1 FROM pg_roles WHERE rolname = :r"), {"r": role}).first()
    if exists is None:
        raise ConfigError(
            f"database.runtime_role {role!r} does not exist",
            hint="create it first (docs/database.md, 'Roles'), or leave runtime_role empty",
        )
    schema = str(conn.execute(text("SELECT current_schema()")).scalar_one())
    tables = conn.execute(
        text("SELECT tablename FROM pg_tables WHERE schemaname = :s"), {"s": schema}
    ).scalars()
    statements = grant_statements(role, schema, set(tables))
    for statement in statements:
        conn.exec_driver_sql(statement)
    return statements

"""Append-only guard: triggers reject UPDATE and DELETE on the chained log and its checkpoints.

``ledger_events``, ``checkpoints`` and ``chains`` only ever grow. The guard holds against the
application's own connection (a bug or a compromised sidecar); an attacker with superuser
rights can switch it off, and that is what the hash chain and the signed checkpoints detect.
Postgres also refuses TRUNCATE.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-21 10:10:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLES = ("ledger_events", "checkpoints", "chains")

PG_FUNCTION = """
CREATE OR REPLACE FUNCTION kvgov_append_only() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'kvgov: % on % is refused: the ledger is append-only', TG_OP, TG_TABLE_NAME
        USING ERRCODE = 'P0001', HINT = 'ledger rows are never changed; erase payloads instead';
END;
$$
"""


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    if dialect == "postgresql":
        op.execute(PG_FUNCTION)
        for table in TABLES:
            op.execute(
                f"CREATE TRIGGER {table}_append_only BEFORE UPDATE OR DELETE ON {table} "
                "FOR EACH ROW EXECUTE FUNCTION kvgov_append_only()"
            )
            op.execute(
                f"CREATE TRIGGER {table}_no_truncate BEFORE TRUNCATE ON {table} "
                "FOR EACH STATEMENT EXECUTE FUNCTION kvgov_append_only()"
            )
    elif dialect == "sqlite":
        for table in TABLES:
            for action in ("UPDATE", "DELETE"):
                op.execute(
                    f"CREATE TRIGGER {table}_no_{action.lower()} BEFORE {action} ON {table} "
                    f"BEGIN SELECT RAISE(ABORT, 'kvgov: {action} on {table} is refused: "
                    "the ledger is append-only'); END"
                )
    else:
        raise NotImplementedError(f"no append-only guard for {dialect}")


def downgrade() -> None:
    dialect = op.get_bind().dialect.name
    if dialect == "postgresql":
        for table in TABLES:
            op.execute(f"DROP TRIGGER IF EXISTS {table}_append_only ON {table}")
            op.execute(f"DROP TRIGGER IF EXISTS {table}_no_truncate ON {table}")
        op.execute("DROP FUNCTION IF EXISTS kvgov_append_only()")
    elif dialect == "sqlite":
        for table in TABLES:
            for action in ("update", "delete"):
                op.execute(f"DROP TRIGGER IF EXISTS {table}_no_{action}")

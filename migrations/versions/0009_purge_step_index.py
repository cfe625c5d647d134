"""An index on the purge id of ``purge:step`` events: a receipt reads its own purge's.

Before a purge's receipt is signed, its steps are checked against their chained ``purge:step``
events (``kvgov.ledger.purge_trail``). Those were found through the (tenant, kind) index, so
each receipt read every step event of the tenant, one set per purge (user erasure) it ever
ran. ``ix_ledger_events_purge_id`` is a partial expression index over the purge id in
``attrs``, on the ``purge:step`` rows alone; the query names the same expression
(``kvgov.db.purge_index``, which the model's index uses too).

A plain CREATE INDEX: ``CREATE INDEX CONCURRENTLY`` cannot run in the migration's transaction.
On Postgres it holds a SHARE lock on ``ledger_events`` while it reads the table: writers'
INSERTs wait (reads do not), and the migration's ``statement_timeout`` bounds it. A DBA may
build the same index CONCURRENTLY beforehand (``docs/database.md``, "Upgrade notes"): an index
of that name is kept, unless Postgres marks it invalid (a concurrent build that failed), which
is dropped and built again. SQLite cannot reflect expression indexes: a later batch migration
that recreates ``ledger_events`` there must create this index again.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-28 12:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

INDEX = "ix_ledger_events_purge_id"
TABLE = "ledger_events"
EXPRESSION = {
    "postgresql": "(attrs ->> 'purge_id')",
    "sqlite": "json_extract(attrs, '$.purge_id')",
}


def upgrade() -> None:
    bind = op.get_bind()
    dialect = bind.dialect.name
    if dialect not in EXPRESSION:
        raise NotImplementedError(f"no purge id index for {dialect}")
    if dialect == "postgresql":
        invalid = bind.execute(
            sa.text(
                "SELECT NOT i.indisvalid FROM pg_index AS i"
                " JOIN pg_class AS c ON c.oid = i.indexrelid"
                " WHERE c.relname = :name AND c.relnamespace = to_regnamespace(current_schema())"
            ),
            {"name": INDEX},
        ).scalar()
        if invalid:
            op.execute(f"DROP INDEX {INDEX}")
    op.execute(
        f"CREATE INDEX IF NOT EXISTS {INDEX} ON {TABLE} ({EXPRESSION[dialect]})"
        " WHERE kind = 'purge:step'"
    )


def downgrade() -> None:
    op.execute(f"DROP INDEX IF EXISTS {INDEX}")

"""Chain hash format: the chain's hash columns hold 64 lowercase hex characters, nothing else.

``ledger_events.hash`` and ``prev_hash``, ``checkpoints.head_hash`` and
``chain_seals.head_hash`` were plain ``VARCHAR(64)``, and the runtime role (every sidecar pod)
may INSERT into all three tables. One ``ledger_events`` row with ``hash = 'z' * 64`` at a live
chain's head stopped its writer for good: the foreign seal it wrote for the row decoded the hash
with ``bytes.fromhex``, the ``ValueError`` was read as the database refusing the writer's events,
and every restart failed the same way in its open (review r13, F2). The code now copes with
such a row (``kvgov.ledger.chain.link_target``); this migration, owner-installed so the runtime
role can neither drop nor disable it, makes the database refuse new ones, with SQLSTATE 23514
(``check_violation``, what a CHECK constraint raises: an ``IntegrityError`` to the driver).

Postgres: a trigger per table, ``AFTER INSERT OR UPDATE ... FOR EACH ROW WHEN (col !~
'^[0-9a-f]{64}$' OR ...)``, rather than a ``CHECK ... NOT VALID``:

* rows already there are not checked (as ``NOT VALID``): the upgrade never fails on a ledger
  that already holds a junk row, and takes no scan of the table; ``kvgov audit verify`` reports
  such a row (``malformed``, or ``bad_signature`` for a seal or checkpoint);
* SQLAlchemy 2.1 cannot reflect a ``NOT VALID`` check constraint (its Postgres reflection hands
  ``dialect_options`` to ``CheckConstraint``, which refuses it), so ``alembic check`` (the
  schema drift check) failed on every migrated database; a trigger is not reflected;
* ``AFTER`` and ``WHEN``: the condition is evaluated in the executor for each row (as a CHECK
  would be) and the function runs only for a bad row; a ``BEFORE INSERT`` row trigger would
  turn off COPY's multi-row inserts, which the writer's large batches use.

SQLite: a ``BEFORE INSERT`` trigger per table refusing the same rows, with the same words (an
UPDATE is already refused by the append-only triggers of 0002, 0006 and 0013). SQLite has no
roles: these hold against the application's own statements, not against whoever can write the
file. 0013 recreated ``checkpoints`` on SQLite; this runs after it, so its trigger stays.

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-29 10:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: the chain's hash columns, per table (every hash the chain code decodes with ``fromhex``)
COLUMNS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("ledger_events", ("hash", "prev_hash")),
    ("checkpoints", ("head_hash",)),
    ("chain_seals", ("head_hash",)),
)
#: what each column must match on Postgres (``kvgov.ledger.chain.is_chain_hash``)
PG_PATTERN = "^[0-9a-f]{64}$"
MESSAGE = "kvgov: a chain hash is 64 lowercase hex characters (hex SHA-256)"
PG_FUNCTION_NAME = "kvgov_chain_hash_format"

PG_FUNCTION = f"""
CREATE OR REPLACE FUNCTION {PG_FUNCTION_NAME}() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '{MESSAGE}: row of % refused', TG_TABLE_NAME USING ERRCODE = 'check_violation',
        HINT = 'only a ledger writer writes these rows; someone else is inserting them';
END;
$$
"""


def trigger_name(table: str) -> str:
    """The trigger on ``table`` (the same name on Postgres and SQLite)."""
    return f"{table}_hash_format"


def _pg_bad(column: str) -> str:
    """Postgres: ``NEW.column`` is not a chain hash (a NULL is left to NOT NULL)."""
    return f"NEW.{column} !~ '{PG_PATTERN}'"


def _sqlite_bad(column: str) -> str:
    """SQLite: ``NEW.column`` is not 64 lowercase hex characters (GLOB is case-sensitive; a
    NULL is left to the column's NOT NULL; SQLite stores any type in any column)."""
    col = f"NEW.{column}"
    return (
        f"({col} IS NOT NULL AND (typeof({col}) <> 'text' OR length({col}) <> 64"
        f" OR {col} GLOB '*[^0-9a-f]*'))"
    )


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    if dialect == "postgresql":
        op.execute(PG_FUNCTION)
        for table, columns in COLUMNS:
            bad = " OR ".join(_pg_bad(c) for c in columns)
            op.execute(
                f"CREATE TRIGGER {trigger_name(table)} AFTER INSERT OR UPDATE ON {table}"
                f" FOR EACH ROW WHEN ({bad}) EXECUTE FUNCTION {PG_FUNCTION_NAME}()"
            )
    elif dialect == "sqlite":
        for table, columns in COLUMNS:
            bad = " OR ".join(_sqlite_bad(c) for c in columns)
            op.execute(
                f"CREATE TRIGGER {trigger_name(table)} BEFORE INSERT ON {table}"
                f" FOR EACH ROW WHEN {bad} BEGIN SELECT RAISE(ABORT, '{MESSAGE}'); END"
            )
    else:
        raise NotImplementedError(f"no chain hash format guard for {dialect}")


def downgrade() -> None:
    dialect = op.get_bind().dialect.name
    if dialect == "postgresql":
        for table, _ in COLUMNS:
            op.execute(f"DROP TRIGGER IF EXISTS {trigger_name(table)} ON {table}")
        op.execute(f"DROP FUNCTION IF EXISTS {PG_FUNCTION_NAME}()")
    elif dialect == "sqlite":
        for table, _ in COLUMNS:
            op.execute(f"DROP TRIGGER IF EXISTS {trigger_name(table)}")

"""Checkpoint keys: ``checkpoints`` is keyed ``(chain_id, seq, nonce)``.

The runtime role may INSERT into ``checkpoints``, whose primary key was ``(chain_id, seq)``: a
key computable from the head that role reads. A junk row under the head's key took the honest
checkpoint's place: the writer and ``kvgov audit checkpoint`` saw the head as signed and signed
nothing, so it stayed unsigned by a real checkpoint. Now a checkpoint is inserted ``ON CONFLICT
DO NOTHING`` under the plain nonce ``''`` and, when a row took that key first, under a random
one (``kvgov.ledger.seals.store``), and only a checkpoint that verifies under the chain's key
counts (``docs/ledger.md``, "Seal keys").

Existing rows get the plain nonce. A build without this migration inserts without naming the
column, so its rows get ``''`` too (the server default) during a rolling upgrade.

Postgres changes the constraint in place (an ACCESS EXCLUSIVE lock on ``checkpoints`` while its
primary key index is rebuilt: the table holds one row per checkpoint, small). SQLite recreates
the table (batch mode), which drops its triggers: migration 0002's append-only guard is created
again, under the same names and words.

Revision ID: 0013
Revises: 0011
Create Date: 2026-11-29 10:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLE = "checkpoints"
PK = f"pk_{TABLE}"


def _sqlite_guard() -> None:
    """Migration 0002's append-only triggers on ``checkpoints`` (batch mode dropped them)."""
    for action in ("UPDATE", "DELETE"):
        op.execute(f"DROP TRIGGER IF EXISTS {TABLE}_no_{action.lower()}")
        op.execute(
            f"CREATE TRIGGER {TABLE}_no_{action.lower()} BEFORE {action} ON {TABLE} "
            f"BEGIN SELECT RAISE(ABORT, 'kvgov: {action} on {TABLE} is refused: "
            "the ledger is append-only'); END"
        )


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    nonce = sa.Column("nonce", sa.String(length=16), server_default="", nullable=False)
    if dialect == "postgresql":
        op.add_column(TABLE, nonce)
        op.drop_constraint(PK, TABLE, type_="primary")
        op.create_primary_key(PK, TABLE, ["chain_id", "seq", "nonce"])
    elif dialect == "sqlite":
        with op.batch_alter_table(TABLE, recreate="always") as batch:
            batch.add_column(nonce)
            batch.drop_constraint(PK, type_="primary")
            batch.create_primary_key(PK, ["chain_id", "seq", "nonce"])
        _sqlite_guard()
    else:
        raise NotImplementedError(f"no checkpoint key migration for {dialect}")


def downgrade() -> None:
    """Back to ``(chain_id, seq)``: refused while two checkpoints share a head's position (a
    junk row and the honest one; the append-only guard keeps either from being removed)."""
    dialect = op.get_bind().dialect.name
    shared = op.get_bind().execute(
        sa.text(f"SELECT count(*) FROM {TABLE} WHERE nonce <> ''")
    ).scalar()
    if shared:
        raise RuntimeError(
            f"kvgov: {shared} checkpoints were written under a random nonce (their plain key "
            "was taken): the old primary key cannot hold them"
        )
    if dialect == "postgresql":
        op.drop_constraint(PK, TABLE, type_="primary")
        op.create_primary_key(PK, TABLE, ["chain_id", "seq"])
        op.drop_column(TABLE, "nonce")
    elif dialect == "sqlite":
        with op.batch_alter_table(TABLE, recreate="always") as batch:
            batch.drop_constraint(PK, type_="primary")
            batch.create_primary_key(PK, ["chain_id", "seq"])
            batch.drop_column("nonce")
        _sqlite_guard()

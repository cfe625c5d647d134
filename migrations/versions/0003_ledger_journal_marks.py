"""Journal marks: how far each sidecar's local ledger journal has reached its chain.

A sidecar acknowledges a put once its ledger event is fsynced to a local journal
(``kvgov.ledger.journal``) and commits the journal to Postgres in large batches behind it. The
batch that commits journal records also moves this mark, in the same transaction, so after a
crash the journal is replayed from exactly the first record the chain does not hold: no event
lost, none written twice.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-21 16:20:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "ledger_journal_marks",
        sa.Column("chain_id", sa.String(length=255), nullable=False),
        sa.Column("applied_upto", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["chain_id"],
            ["chains.chain_id"],
            name=op.f("fk_ledger_journal_marks_chain_id_chains"),
        ),
        sa.PrimaryKeyConstraint("chain_id", name=op.f("pk_ledger_journal_marks")),
    )


def downgrade() -> None:
    op.drop_table("ledger_journal_marks")

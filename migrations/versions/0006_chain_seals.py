"""Chain seals: each chain's signed genesis and its writer sessions' signed opens and closes.

The runtime role may insert into ``chains`` and ``ledger_events``, and the chain hash is
unkeyed: with the runtime credentials alone, a chain could be registered under a trusted node's
public key, or events appended after a writer's last checkpoint, and both would verify. A seal
is an Ed25519 signature by the chain's key (``kvgov.ledger.seals``): verification now fails a
chain without a signed genesis and events written while no writer session held the chain open.
Append-only, like the other chained tables (the guard of migration 0002).

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-26 10:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLE = "chain_seals"


def upgrade() -> None:
    op.create_table(
        TABLE,
        sa.Column("chain_id", sa.String(length=255), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("session", sa.String(length=64), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("head_hash", sa.String(length=64), nullable=False),
        sa.Column("exclusive", sa.Boolean(), nullable=False),
        sa.Column("signed_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("signature", sa.LargeBinary(), nullable=False),
        sa.Column("public_key", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(
            ["chain_id"], ["chains.chain_id"], name=op.f("fk_chain_seals_chain_id_chains")
        ),
        sa.PrimaryKeyConstraint("chain_id", "kind", "session", name=op.f("pk_chain_seals")),
    )
    dialect = op.get_bind().dialect.name
    if dialect == "postgresql":  # kvgov_append_only() is migration 0002's
        op.execute(
            f"CREATE TRIGGER {TABLE}_append_only BEFORE UPDATE OR DELETE ON {TABLE} "
            "FOR EACH ROW EXECUTE FUNCTION kvgov_append_only()"
        )
        op.execute(
            f"CREATE TRIGGER {TABLE}_no_truncate BEFORE TRUNCATE ON {TABLE} "
            "FOR EACH STATEMENT EXECUTE FUNCTION kvgov_append_only()"
        )
    elif dialect == "sqlite":
        for action in ("UPDATE", "DELETE"):
            op.execute(
                f"CREATE TRIGGER {TABLE}_no_{action.lower()} BEFORE {action} ON {TABLE} "
                f"BEGIN SELECT RAISE(ABORT, 'kvgov: {action} on {TABLE} is refused: "
                "the ledger is append-only'); END"
            )
    else:
        raise NotImplementedError(f"no append-only guard for {dialect}")


def downgrade() -> None:
    dialect = op.get_bind().dialect.name
    if dialect == "postgresql":
        op.execute(f"DROP TRIGGER IF EXISTS {TABLE}_append_only ON {TABLE}")
        op.execute(f"DROP TRIGGER IF EXISTS {TABLE}_no_truncate ON {TABLE}")
    elif dialect == "sqlite":
        for action in ("update", "delete"):
            op.execute(f"DROP TRIGGER IF EXISTS {TABLE}_no_{action}")
    op.drop_table(TABLE)

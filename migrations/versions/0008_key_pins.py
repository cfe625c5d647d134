"""Key pins: the ledger records which pseudonym key the fleet uses, once.

The ledger holds keyed pseudonyms, never user ids, and nothing in it said which key made them:
a pod or a CLI host with another pseudonym key (a mis-mounted Secret, a key a tool generated)
recorded users under pseudonyms no purge could name, and a purge run with the real key
completed, signed, having found nothing of theirs. ``key_pins`` holds the pseudonym key's id
(a keyed one-way fingerprint, :mod:`kvgov.ledger.keypin`); every sidecar start and every CLI
command that computes pseudonyms compares its own key's id with it and refuses on a mismatch.
The first start on a fresh ledger records it.

The runtime role may insert (the first start pins) and read, never update or delete (its
grants), and the append-only guard of migration 0002 refuses UPDATE, DELETE and TRUNCATE even to
the owner: re-pinning is a deliberate owner's act (``docs/ledger.md``, 'Pseudonym key pin').

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-26 23:40:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLE = "key_pins"


def upgrade() -> None:
    op.create_table(
        TABLE,
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("fingerprint", sa.String(length=64), nullable=False),
        sa.Column("pinned_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_key_pins")),
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
                "a key pin is never changed'); END"
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

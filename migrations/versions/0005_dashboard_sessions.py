"""Dashboard sessions live on the server: sign-out revokes them.

The dashboard's cookie was only HMAC-signed, so deleting it in the browser was all sign-out
did: a copy of the cookie kept working until it expired. Now each sign-in adds a row keyed by
the SHA-256 of a random session id (the id itself is only in the cookie), every request checks
it, and sign-out deletes it.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-25 16:10:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "dashboard_sessions",
        sa.Column("id_hash", sa.String(length=64), nullable=False),
        sa.Column("token_id", sa.String(length=36), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id_hash", name=op.f("pk_dashboard_sessions")),
    )
    with op.batch_alter_table("dashboard_sessions", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_dashboard_sessions_expires_at"), ["expires_at"], unique=False
        )
        batch_op.create_index(
            batch_op.f("ix_dashboard_sessions_token_id"), ["token_id"], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table("dashboard_sessions", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_dashboard_sessions_token_id"))
        batch_op.drop_index(batch_op.f("ix_dashboard_sessions_expires_at"))
    op.drop_table("dashboard_sessions")

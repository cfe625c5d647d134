"""Request ids are scoped by tenant: ``requests`` is keyed by (request_id, tenant).

Request ids come from the engines, and two tenants may use the same one. Keyed by the id alone,
the first tenant's row stood for both, and provenance of "request R" mixed both tenants'
chunks. A request seen without a tenant is stored with tenant ``''``. Rows the global key
folded together are split again from the chained events: every (request id, tenant) pair the
ledger holds gets its row.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-25 16:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.execute("UPDATE requests SET tenant = '' WHERE tenant IS NULL")
    with op.batch_alter_table("requests", schema=None) as batch_op:
        batch_op.alter_column("tenant", existing_type=sa.String(length=128), nullable=False)
        batch_op.drop_constraint(batch_op.f("pk_requests"), type_="primary")
        batch_op.create_primary_key(batch_op.f("pk_requests"), ["request_id", "tenant"])
    op.execute(
        "INSERT INTO requests (request_id, tenant, first_seen_at, last_seen_at)"
        " SELECT request_id, COALESCE(tenant, ''), MIN(occurred_at), MAX(occurred_at)"
        " FROM ledger_events WHERE request_id IS NOT NULL"
        " GROUP BY request_id, COALESCE(tenant, '')"
        " ON CONFLICT (request_id, tenant) DO NOTHING"
    )


def downgrade() -> None:
    # keep one row per request id (the first tenant that used it), as before
    op.execute(
        "DELETE FROM requests WHERE EXISTS (SELECT 1 FROM requests AS r"
        " WHERE r.request_id = requests.request_id AND r.tenant < requests.tenant)"
    )
    with op.batch_alter_table("requests", schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f("pk_requests"), type_="primary")
        batch_op.create_primary_key(batch_op.f("pk_requests"), ["request_id"])
        batch_op.alter_column("tenant", existing_type=sa.String(length=128), nullable=True)
    op.execute("UPDATE requests SET tenant = NULL WHERE tenant = ''")

"""Cache entry claim: a put takes a row squatted under another tenant.

Migration 0011's owner trigger refuses any change of a ``cache_entries`` row's key digest or
tenant. The runtime role may still INSERT a row, so whoever holds its credentials could insert
the row of a digest some tenant had not put yet under another tenant; the real tenant's put then
only filled an empty tenant and kept the live row's life, and its entry was listed, counted and
retained as the other tenant's, owned by the squatter.

The writer now claims such a row at the put (``kvgov.ledger.indexes._CLAIMED``): one whose
tenant differs from the put's and that no chained event names with its own tenant (the writer
inserts a row in the transaction that chains its first event, under that event's tenant, so
only a squatter leaves one). This trigger function allows exactly that change, with a
``WARNING`` in the database's log, and still refuses every other:

* any change of a row's key digest;
* clearing a row's tenant;
* any change of a tenant a chained event names with the row's key digest (an honest row).

The function reads ``ledger_events`` on a fixed search path, the temporary schema last: a
temporary table of the runtime role's own named ``ledger_events`` cannot stand in for the
chain. SQLite (no roles) keeps 0011's rule: the application never claims a row there.

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-27 08:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op
from sqlalchemy import text

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

MESSAGE = "kvgov: the key digest and tenant of a cache entry never change"
HINT = "purge scope stands on the chained put events; the row is not moved or re-keyed"

PG_FUNCTION = f"""
CREATE OR REPLACE FUNCTION kvgov_cache_entry_identity() RETURNS trigger
LANGUAGE plpgsql SET search_path = {{schema}}, pg_temp AS $$
BEGIN
    IF NEW.key_digest IS DISTINCT FROM OLD.key_digest OR NEW.tenant IS NULL OR EXISTS (
        SELECT 1 FROM ledger_events e
        WHERE e.key_digest = OLD.key_digest AND e.tenant = OLD.tenant
    ) THEN
        RAISE EXCEPTION '{MESSAGE} (entry %)', OLD.key_digest USING ERRCODE = 'P0001',
            HINT = '{HINT}';
    END IF;
    RAISE WARNING 'kvgov: cache entry % was under tenant %, which no chained event names'
        ' (inserted by the runtime role before the first put): claimed for tenant %',
        OLD.key_digest, OLD.tenant, NEW.tenant;
    RETURN NEW;
END;
$$
"""

#: migration 0011's function, for the downgrade
PG_FUNCTION_0011 = f"""
CREATE OR REPLACE FUNCTION kvgov_cache_entry_identity() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '{MESSAGE} (entry %)', OLD.key_digest USING ERRCODE = 'P0001',
        HINT = '{HINT}';
END;
$$
"""


def _schema() -> str:
    """The schema the tables live in (the migration's current schema), quoted."""
    name = op.get_bind().execute(text("SELECT quote_ident(current_schema())")).scalar_one()
    return str(name)


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(PG_FUNCTION.format(schema=_schema()))


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(PG_FUNCTION_0011)

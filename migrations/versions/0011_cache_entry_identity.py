"""Cache entry identity: a ``cache_entries`` row's key digest and tenant never change.

The runtime role may UPDATE ``cache_entries`` (the writer's entry upserts: new lives, tiers,
states). Whoever holds its credentials could move a row to another tenant (``UPDATE
cache_entries SET tenant = ...``) or re-key it (``SET key_digest = ...``), and a purge that
trusted the row then missed the entry while the sidecar kept serving it (review r10, F4).
Purge scope now stands on the chained put events, which that role can only append to
(``kvgov.ledger.repository.user_entries``); this owner-installed trigger, which the runtime
role cannot drop or disable, is the defence in depth: it refuses

* any change of a row's key digest;
* any change of a row's tenant once it has one (the writer fills an empty tenant, as it always
  did, and never writes another: a digest's tenant is fixed by its key).

A trigger, not a column-level grant: the previous release's writer names ``tenant`` in every
UPDATE of an existing row (with the value the row already has), so narrowing the grant would
make its ledger batches fail during a rolling upgrade (``docs/operations.md``, "Upgrades");
the trigger fires only on a real change. SQLite (no roles) gets the same rule, with the same
words, against the application's own statements.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-27 06:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLE = "cache_entries"
TRIGGER = f"{TABLE}_identity"
MESSAGE = "kvgov: the key digest and tenant of a cache entry never change"
#: the rows the rule refuses (``IS DISTINCT FROM`` on Postgres, ``IS NOT`` on SQLite)
_CHANGED = (
    "NEW.key_digest {ne} OLD.key_digest OR (OLD.tenant IS NOT NULL AND NEW.tenant {ne} OLD.tenant)"
)

PG_FUNCTION = f"""
CREATE OR REPLACE FUNCTION kvgov_cache_entry_identity() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '{MESSAGE} (entry %)', OLD.key_digest USING ERRCODE = 'P0001',
        HINT = 'purge scope stands on the chained put events; the row is not moved or re-keyed';
END;
$$
"""


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    # UPDATE OF: the trigger fires only for statements that name the columns (the writer's
    # upserts name tenant, to fill an empty one); WHEN: only for a real change
    if dialect == "postgresql":
        op.execute(PG_FUNCTION)
        op.execute(
            f"CREATE TRIGGER {TRIGGER} BEFORE UPDATE OF key_digest, tenant ON {TABLE}"
            f" FOR EACH ROW WHEN ({_CHANGED.format(ne='IS DISTINCT FROM')})"
            " EXECUTE FUNCTION kvgov_cache_entry_identity()"
        )
    elif dialect == "sqlite":
        op.execute(
            f"CREATE TRIGGER {TRIGGER} BEFORE UPDATE OF key_digest, tenant ON {TABLE}"
            f" FOR EACH ROW WHEN {_CHANGED.format(ne='IS NOT')}"
            f" BEGIN SELECT RAISE(ABORT, '{MESSAGE}'); END"
        )
    else:
        raise NotImplementedError(f"no cache entry identity guard for {dialect}")


def downgrade() -> None:
    dialect = op.get_bind().dialect.name
    if dialect == "postgresql":
        op.execute(f"DROP TRIGGER IF EXISTS {TRIGGER} ON {TABLE}")
        op.execute("DROP FUNCTION IF EXISTS kvgov_cache_entry_identity()")
    elif dialect == "sqlite":
        op.execute(f"DROP TRIGGER IF EXISTS {TRIGGER}")

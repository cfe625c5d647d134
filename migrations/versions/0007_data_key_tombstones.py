"""Data key tombstones: a destroyed (crypto-shredded) data key stays destroyed.

A shred sets a ``data_keys`` row to ``state='destroyed', wrapped=NULL``. The runtime role may
UPDATE ``data_keys`` (new versions, rotation, shredding), so with a copy of the wrapped DEK
taken before the purge (a SELECT, a backup, a lagging replica) it could write the bytes back
and every sidecar would open ciphertext a signed purge receipt lists as destroyed. On Postgres
an owner-installed trigger, which the runtime role cannot drop or disable, now refuses:

* any change to a destroyed row but its usage counter (a sidecar may still flush the chunks it
  sealed before it learned of the shred): no new state, no wrapped bytes, no new
  ``destroyed_at``, no new identity;
* a row whose state and wrapped bytes disagree: ``destroyed`` if and only if ``wrapped`` is
  NULL (so a live row loses its bytes only by being destroyed, and a retired row without bytes,
  what a shred racing a rotation used to leave, cannot be written);
* a change of a row's identity (key id, version, tenant, user): the wrap AAD binds them;
* DELETE of a destroyed row and TRUNCATE: with the tombstone gone, an INSERT could bring the
  same key id and version back. Nothing in kvgov deletes data keys.

A live row's ``wrapped`` may still change to other bytes (a KEK provider's re-wrap in place,
e.g. Vault Transit ``rewrap``): those must unwrap under the row's own AAD, so they can only
hold the same key. Rows already left ``retired`` with no wrapped bytes are marked destroyed
first (on SQLite too, which has no roles and gets no trigger).

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-27 10:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLE = "data_keys"

PG_FUNCTION = """
CREATE OR REPLACE FUNCTION kvgov_data_key_tombstone() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'TRUNCATE' THEN
        RAISE EXCEPTION 'kvgov: TRUNCATE on data_keys is refused: destroyed keys stay recorded'
            USING ERRCODE = 'P0001';
    END IF;
    IF TG_OP = 'DELETE' THEN
        IF OLD.state = 'destroyed' OR OLD.wrapped IS NULL THEN
            RAISE EXCEPTION 'kvgov: DELETE of destroyed data key % v% is refused', OLD.key_id,
                OLD.version USING ERRCODE = 'P0001',
                HINT = 'a crypto-shredded key stays recorded as destroyed';
        END IF;
        RETURN OLD;
    END IF;
    IF (NEW.state = 'destroyed') IS DISTINCT FROM (NEW.wrapped IS NULL) THEN
        RAISE EXCEPTION 'kvgov: data key % v%: state % with% wrapped bytes is refused',
            NEW.key_id, NEW.version, NEW.state,
            CASE WHEN NEW.wrapped IS NULL THEN 'out' ELSE '' END
            USING ERRCODE = 'P0001',
            HINT = 'a key is destroyed exactly when its wrapped bytes are gone';
    END IF;
    IF TG_OP = 'UPDATE' THEN
        IF (NEW.key_id, NEW.version, NEW.tenant, NEW."user")
                IS DISTINCT FROM (OLD.key_id, OLD.version, OLD.tenant, OLD."user") THEN
            RAISE EXCEPTION 'kvgov: data key % v%: its identity never changes', OLD.key_id,
                OLD.version USING ERRCODE = 'P0001';
        END IF;
        IF (OLD.state = 'destroyed' OR OLD.wrapped IS NULL)
                AND (NEW.state, NEW.wrapped, NEW.kek_id, NEW.created_at, NEW.destroyed_at)
                IS DISTINCT FROM
                (OLD.state, OLD.wrapped, OLD.kek_id, OLD.created_at, OLD.destroyed_at) THEN
            RAISE EXCEPTION 'kvgov: data key % v% was destroyed: it stays destroyed',
                OLD.key_id, OLD.version USING ERRCODE = 'P0001',
                HINT = 'crypto-shredding is not undone; a new version is a new key';
        END IF;
    END IF;
    RETURN NEW;
END;
$$
"""


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    # what a shred racing a rotation could leave: no wrapped bytes, yet 'retired' (or 'active');
    # CURRENT_TIMESTAMP is UTC on both (SQLite's text form is what its DateTime reads back)
    op.execute(
        "UPDATE data_keys SET state = 'destroyed',"
        " destroyed_at = COALESCE(destroyed_at, CURRENT_TIMESTAMP)"
        " WHERE wrapped IS NULL AND state <> 'destroyed'"
    )
    if dialect == "postgresql":
        op.execute(PG_FUNCTION)
        op.execute(
            f"CREATE TRIGGER {TABLE}_tombstones BEFORE INSERT OR UPDATE OR DELETE ON {TABLE} "
            "FOR EACH ROW EXECUTE FUNCTION kvgov_data_key_tombstone()"
        )
        op.execute(
            f"CREATE TRIGGER {TABLE}_no_truncate BEFORE TRUNCATE ON {TABLE} "
            "FOR EACH STATEMENT EXECUTE FUNCTION kvgov_data_key_tombstone()"
        )
    elif dialect != "sqlite":
        raise NotImplementedError(f"no data key tombstone guard for {dialect}")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"DROP TRIGGER IF EXISTS {TABLE}_tombstones ON {TABLE}")
        op.execute(f"DROP TRIGGER IF EXISTS {TABLE}_no_truncate ON {TABLE}")
        op.execute("DROP FUNCTION IF EXISTS kvgov_data_key_tombstone()")

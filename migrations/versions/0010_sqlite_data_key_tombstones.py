"""SQLite data key tombstones: a destroyed data key stays destroyed on SQLite too.

Migration 0007 installed the guard on Postgres only; on SQLite (a single embedded node) an
UPDATE could write a shredded key's wrapped bytes back, and a DELETE of the tombstone followed
by an INSERT could bring its id and version back with them. These triggers refuse what 0007's
``kvgov_data_key_tombstone()`` refuses, with the same words:

* an INSERT or UPDATE leaving a row whose state and wrapped bytes disagree (``destroyed`` if
  and only if ``wrapped`` is NULL);
* an UPDATE of a row's identity (key id, version, tenant, user): the wrap AAD binds them;
* an UPDATE of a destroyed row (``state = 'destroyed'`` or no wrapped bytes) changing anything
  but its usage counter (state, wrapped bytes, KEK id, ``created_at``, ``destroyed_at``);
* a DELETE of a destroyed row (SQLite has no TRUNCATE; its truncate optimisation of a ``DELETE``
  without ``WHERE`` is off while a DELETE trigger exists, so the rows are checked one by one);
* and SQLite's own way around them: an INSERT (``INSERT OR REPLACE``, ``REPLACE``) over a
  destroyed row's key id and version. REPLACE deletes the row in the way without firing DELETE
  triggers (unless ``recursive_triggers`` is on); on Postgres the primary key refuses that
  INSERT, and an upsert (``ON CONFLICT DO UPDATE``) is an UPDATE on both.

SQLite has no roles: whoever can write the database file can drop these triggers. They hold
against the application's own statements (a bug, an injected statement, a copied wrapped DEK
written back through the runtime's connection), as on Postgres they also hold against the
runtime role. Rows left ``retired`` without wrapped bytes are marked destroyed first, as 0007
did (idempotent).

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-28 10:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLE = "data_keys"

#: a row whose state and wrapped bytes disagree (``IS NOT``: SQLite's IS DISTINCT FROM)
_DISAGREE = "(NEW.state = 'destroyed') IS NOT (NEW.wrapped IS NULL)"
_DESTROYED = "(OLD.state = 'destroyed' OR OLD.wrapped IS NULL)"
_STATE_MSG = (
    "kvgov: data key: state and wrapped bytes disagree: a key is destroyed exactly when its"
    " wrapped bytes are gone"
)
_STAYS_MSG = (
    "kvgov: data key was destroyed: it stays destroyed (crypto-shredding is not undone; a new"
    " version is a new key)"
)

#: (trigger name suffix, timing and event, WHEN condition, message)
TRIGGERS: tuple[tuple[str, str, str, str], ...] = (
    ("insert_state", "BEFORE INSERT", _DISAGREE, _STATE_MSG),
    (
        "insert_over_tombstone",
        "BEFORE INSERT",
        f"EXISTS (SELECT 1 FROM {TABLE} AS t WHERE t.key_id = NEW.key_id"
        " AND t.version = NEW.version AND (t.state = 'destroyed' OR t.wrapped IS NULL))",
        _STAYS_MSG,
    ),
    ("update_state", "BEFORE UPDATE", _DISAGREE, _STATE_MSG),
    (
        "update_identity",
        "BEFORE UPDATE",
        "NEW.key_id IS NOT OLD.key_id OR NEW.version IS NOT OLD.version"
        ' OR NEW.tenant IS NOT OLD.tenant OR NEW."user" IS NOT OLD."user"',
        "kvgov: data key: its identity never changes",
    ),
    (
        "update_destroyed",
        "BEFORE UPDATE",
        f"{_DESTROYED} AND (NEW.state IS NOT OLD.state OR NEW.wrapped IS NOT OLD.wrapped"
        " OR NEW.kek_id IS NOT OLD.kek_id OR NEW.created_at IS NOT OLD.created_at"
        " OR NEW.destroyed_at IS NOT OLD.destroyed_at)",
        _STAYS_MSG,
    ),
    (
        "delete_destroyed",
        "BEFORE DELETE",
        _DESTROYED,
        "kvgov: DELETE of destroyed data key is refused: a crypto-shredded key stays recorded"
        " as destroyed",
    ),
)


def trigger_names() -> list[str]:
    """The SQLite triggers this migration installs."""
    return [f"{TABLE}_tombstone_{name}" for name, *_ in TRIGGERS]


def upgrade() -> None:
    if op.get_bind().dialect.name != "sqlite":
        return  # Postgres: migration 0007's trigger; other dialects: 0007 refused them
    # what a shred racing a rotation could leave, as 0007 (no trigger could refuse it since)
    op.execute(
        f"UPDATE {TABLE} SET state = 'destroyed',"
        " destroyed_at = COALESCE(destroyed_at, CURRENT_TIMESTAMP)"
        " WHERE wrapped IS NULL AND state <> 'destroyed'"
    )
    # and the other way round: a row marked destroyed whose bytes survived is shredded now
    # (once the triggers are in, nothing could scrub it; erasure is what it was marked for)
    op.execute(f"UPDATE {TABLE} SET wrapped = NULL WHERE state = 'destroyed' AND wrapped IS NOT NULL")
    for (_, event, when, message), name in zip(TRIGGERS, trigger_names(), strict=True):
        op.execute(
            f"CREATE TRIGGER {name} {event} ON {TABLE} FOR EACH ROW WHEN {when} "
            f"BEGIN SELECT RAISE(ABORT, '{message}'); END"
        )


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        for name in trigger_names():
            op.execute(f"DROP TRIGGER IF EXISTS {name}")

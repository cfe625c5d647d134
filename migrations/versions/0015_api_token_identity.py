"""API token identity: a token row's identity, role, scope and revocation never change.

The runtime role (every sidecar pod's, every CLI host's ``database.url_file``) may INSERT and
UPDATE ``api_tokens``: the API creates and revokes tokens, and stamps their last use. Whoever
held its credentials could also un-revoke a revoked token (``SET revoked_at = NULL``), turn an
auditor into a global admin (``SET role = 'admin', tenant = NULL``), or put their own token's
hash on another admin's id, and the API believed the row (review r15, F3). This owner-installed
trigger, which the runtime role cannot drop or disable, refuses an UPDATE that changes

* a row's ``id``, ``name``, ``token_hash``, ``role``, ``tenant`` or ``created_at``;
* its ``revoked_at`` once set (revoking, NULL to a timestamp, stays allowed; nothing else).

``last_used_at`` stays writable. The revocation also stands on the ledger now: the API refuses
a token for which a ``token:revoked`` event is chained, and checks the row against its chained
``token:created`` event (``kvgov.db.tokens.judge``); this migration indexes those events by
their token id (``ix_ledger_events_token_id``, a partial expression index over the token
events alone, like 0009's; the query builds the same expression, ``kvgov.db.token_index``).

A trigger, not column grants: the API's INSERT needs every column, and the revocation rule
(NULL to a timestamp, once) is not a privilege. The trigger function reads no table, so it
needs no fixed search path. Like 0002's and 0011's guards it holds for the owner too (the
owner may drop it; ``api_tokens`` then answers to the ledger alone).

SQLite (no roles) gets the same rule, with the same words, against the application's own
statements, plus a refusal of an INSERT whose id or hash a row already has: ``INSERT OR
REPLACE`` would delete that row without firing an UPDATE (or DELETE) trigger and put a new one
in its place. On Postgres the primary key and the unique hash refuse that INSERT; an upsert
(``ON CONFLICT DO UPDATE``) is an UPDATE on both.

The index is a plain CREATE INDEX, as 0009's (``docs/database.md``, "Upgrade notes"): it holds
a SHARE lock on ``ledger_events`` while it reads the table, which the migration's
``statement_timeout`` bounds; a DBA may build it CONCURRENTLY beforehand.

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-30 10:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLE = "api_tokens"
TRIGGER = f"{TABLE}_identity"
#: SQLite only: an INSERT (``INSERT OR REPLACE``) over an existing token's id or hash
INSERT_TRIGGER = f"{TABLE}_no_replace"
FUNCTION = "kvgov_api_token_identity"
MESSAGE = "kvgov: the identity, role, tenant and revocation of an API token never change"
HINT = "revoke the token and create another; a revocation is final (its token:revoked is chained)"
#: the columns fixed once written (``revoked_at`` has a rule of its own)
FIXED = ("id", "name", "token_hash", "role", "tenant", "created_at")
#: the rows the rule refuses (``IS DISTINCT FROM`` on Postgres, ``IS NOT`` on SQLite)
_CHANGED = " OR ".join(
    [f"NEW.{c} {{ne}} OLD.{c}" for c in FIXED]
    + ["(OLD.revoked_at IS NOT NULL AND NEW.revoked_at {ne} OLD.revoked_at)"]
)
_WATCHED = ", ".join([*FIXED, "revoked_at"])

PG_FUNCTION = f"""
CREATE OR REPLACE FUNCTION {FUNCTION}() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '{MESSAGE} (token %)', OLD.id USING ERRCODE = 'P0001', HINT = '{HINT}';
END;
$$
"""

INDEX = "ix_ledger_events_token_id"
EVENTS = "ledger_events"
EXPRESSION = {
    "postgresql": "(attrs ->> 'token_id')",
    "sqlite": "json_extract(attrs, '$.token_id')",
}
#: the index's predicate (``kvgov.db.token_index.is_token_event`` renders the same)
PREDICATE = "kind IN ('token:created', 'token:revoked')"


def _create_index(dialect: str) -> None:
    """0009's way: keep a valid index of that name a DBA built beforehand, rebuild an invalid
    one (a concurrent build that failed)."""
    bind = op.get_bind()
    if dialect == "postgresql":
        invalid = bind.execute(
            sa.text(
                "SELECT NOT i.indisvalid FROM pg_index AS i"
                " JOIN pg_class AS c ON c.oid = i.indexrelid"
                " WHERE c.relname = :name AND c.relnamespace = to_regnamespace(current_schema())"
            ),
            {"name": INDEX},
        ).scalar()
        if invalid:
            op.execute(f"DROP INDEX {INDEX}")
    op.execute(
        f"CREATE INDEX IF NOT EXISTS {INDEX} ON {EVENTS} ({EXPRESSION[dialect]})"
        f" WHERE {PREDICATE}"
    )


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    if dialect not in EXPRESSION:
        raise NotImplementedError(f"no API token identity guard for {dialect}")
    # UPDATE OF: a statement that names none of these columns (the last-use stamp) is not
    # looked at; WHEN: only a real change is refused
    if dialect == "postgresql":
        op.execute(PG_FUNCTION)
        op.execute(
            f"CREATE TRIGGER {TRIGGER} BEFORE UPDATE OF {_WATCHED} ON {TABLE}"
            f" FOR EACH ROW WHEN ({_CHANGED.format(ne='IS DISTINCT FROM')})"
            f" EXECUTE FUNCTION {FUNCTION}()"
        )
    else:
        op.execute(
            f"CREATE TRIGGER {TRIGGER} BEFORE UPDATE OF {_WATCHED} ON {TABLE}"
            f" FOR EACH ROW WHEN {_CHANGED.format(ne='IS NOT')}"
            f" BEGIN SELECT RAISE(ABORT, '{MESSAGE}'); END"
        )
        op.execute(
            f"CREATE TRIGGER {INSERT_TRIGGER} BEFORE INSERT ON {TABLE} FOR EACH ROW WHEN EXISTS"
            f" (SELECT 1 FROM {TABLE} AS t WHERE t.id = NEW.id OR t.token_hash = NEW.token_hash)"
            f" BEGIN SELECT RAISE(ABORT, '{MESSAGE}'); END"
        )
    _create_index(dialect)


def downgrade() -> None:
    dialect = op.get_bind().dialect.name
    op.execute(f"DROP INDEX IF EXISTS {INDEX}")
    if dialect == "postgresql":
        op.execute(f"DROP TRIGGER IF EXISTS {TRIGGER} ON {TABLE}")
        op.execute(f"DROP FUNCTION IF EXISTS {FUNCTION}()")
    elif dialect == "sqlite":
        op.execute(f"DROP TRIGGER IF EXISTS {TRIGGER}")
        op.execute(f"DROP TRIGGER IF EXISTS {INSERT_TRIGGER}")

"""The index that finds one API token's chained ``token:created``/``token:revoked`` events
(migration 0015).

The API checks a token's row against the ledger at each request (:func:`kvgov.db.tokens.
judge`): a chained ``token:revoked`` event revokes the token whatever its row says, and the
row's role, tenant and hash must be those its ``token:created`` event recorded.
``ix_ledger_events_token_id`` indexes the token id in ``attrs``, on the token events alone (a
partial index, like :mod:`kvgov.db.purge_index`'s). A planner uses an expression index only for
a query that names the same expression and whose conditions imply the index's predicate, so the
model's index and the query build both from here, with the kinds as SQL literals (bound ones
would not prove the predicate to a generic Postgres plan). Migration 0015 writes the same SQL.
"""

from __future__ import annotations

from sqlalchemy import String, literal_column
from sqlalchemy.sql.elements import ColumnElement

from kvgov.db.jsonattr import AttrText
from kvgov.types import EventKind

#: the index's name (the model's, the migration's, and what a query plan names)
TOKEN_ID_INDEX = "ix_ledger_events_token_id"  # noqa: S105 - an index name, not a secret
#: the attrs key a token event names its token by
TOKEN_ID_KEY = "token_id"  # noqa: S105 - an attrs key, not a secret
#: the kinds the index covers, in the order the predicate names them
TOKEN_KINDS = (EventKind.TOKEN_CREATED, EventKind.TOKEN_REVOKED)


class token_id_of(AttrText):  # noqa: N801 (a SQL function, named like func.x)
    """``attrs``' ``token_id`` as text: ``(attrs ->> 'token_id')`` on Postgres,
    ``json_extract(attrs, '$.token_id')`` on SQLite. NULL where there is none."""

    name = "token_id_of"
    attr_key = TOKEN_ID_KEY
    inherit_cache = True


def is_token_event(kind: ColumnElement[str]) -> ColumnElement[bool]:
    """``kind IN ('token:created', 'token:revoked')`` with the kinds as literals: the index's
    predicate."""
    return kind.in_([literal_column(f"'{k.value}'", String()) for k in TOKEN_KINDS])

"""The index that finds one purge's chained ``purge:step`` events (migration 0009).

A tenant's ``purge:step`` events grow with its purges (one per user erasure), and the receipt's
cross-check (:mod:`kvgov.ledger.purge_trail`) reads one purge's. ``ix_ledger_events_purge_id``
indexes the purge id in ``attrs``, on the ``purge:step`` rows alone (a partial index). A planner
uses an expression index only for a query that names the same expression and whose conditions
imply the index's predicate, so the model's index and the query build both from here:
:func:`purge_id_of` and :func:`is_purge_step`, whose constants are SQL literals (a bound kind
would not prove the predicate to a generic Postgres plan). Migration 0009 writes the same SQL.
"""

from __future__ import annotations

from sqlalchemy import String, literal_column
from sqlalchemy.sql.elements import ColumnElement

from kvgov.db.jsonattr import AttrText
from kvgov.types import EventKind

#: the index's name (the model's, the migration's, and what a query plan names)
PURGE_ID_INDEX = "ix_ledger_events_purge_id"
#: the attrs key a purge:step event names its purge by
PURGE_ID_KEY = "purge_id"


class purge_id_of(AttrText):  # noqa: N801 (a SQL function, named like func.x)
    """``attrs``' ``purge_id`` as text: ``(attrs ->> 'purge_id')`` on Postgres,
    ``json_extract(attrs, '$.purge_id')`` on SQLite (kvgov's two dialects; elsewhere it renders
    as a ``purge_id_of()`` call the database will not know). NULL where there is none."""

    name = "purge_id_of"
    attr_key = PURGE_ID_KEY
    inherit_cache = True


def is_purge_step(kind: ColumnElement[str]) -> ColumnElement[bool]:
    """``kind = 'purge:step'`` with the kind as a literal: the index's predicate."""
    return kind == literal_column(f"'{EventKind.PURGE_STEP.value}'", String())

"""Postgres fast paths of the ledger writer: rows as COPY text, one COPY write per batch, and
the chain lock with the head read in one round trip.

Plain functions over the raw psycopg connection under a SQLAlchemy ``Connection`` (inside the
caller's transaction); driver errors are mapped onto SQLAlchemy's, like any statement's, so
the writer's retry logic sees one error tree. Nothing here commits.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, exc

from kvgov.errors import LedgerError
from kvgov.ledger.chain import format_time

#: the ``ledger_events`` columns, in the order of a chained row (and of the COPY)
EVENT_COLUMNS = [
    "chain_id",
    "seq",
    "prev_hash",
    "hash",
    "encoding_version",
    "occurred_at",
    "kind",
    "tenant",
    "actor",
    "request_id",
    "key_digest",
    "tier",
    "nbytes",
    "outcome",
    "reason",
    "decision_id",
    "policy_revision",
    "principal",
    "attrs",
    "payload_digest",
]

#: characters COPY's text format escapes (NUL is refused before)
COPY_SPECIAL = re.compile(r"[\\\t\n\r]")
_COPY_NULL = "\\N"
_COPY_ESCAPES = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"})
_WHEN = EVENT_COLUMNS.index("occurred_at")
_COPY_SQL = f"COPY ledger_events ({', '.join(EVENT_COLUMNS)}) FROM STDIN"
_LOCK_CHAIN = "SELECT chain_id FROM chains WHERE chain_id = %s FOR UPDATE"
_HEAD = "SELECT seq, hash FROM ledger_events WHERE chain_id = %s ORDER BY seq DESC LIMIT 1"


def copy_line(row: tuple[Any, ...], when: str, plain: bool) -> str:
    """One row in COPY's text format (tab-separated, ``\\N`` for NULL, backslash escapes);
    ``occurred_at`` as ``when`` (ISO 8601 with ``Z``, which Postgres reads exactly). ``plain``:
    no text value holds a character that needs escaping (:data:`COPY_SPECIAL`)."""
    if plain:
        values = [_COPY_NULL if v is None else v if type(v) is str else str(v) for v in row]
    else:
        values = [
            _COPY_NULL if v is None else v.translate(_COPY_ESCAPES) if type(v) is str else str(v)
            for v in row
        ]
    values[_WHEN] = when
    return "\t".join(values)


def copy_text(rows: Sequence[tuple[Any, ...]], plain: Sequence[bool]) -> str:
    """The rows as the data of ``COPY ledger_events (...) FROM STDIN`` (text format)."""
    lines = [copy_line(row, format_time(row[_WHEN]), p) for row, p in zip(rows, plain, strict=True)]
    lines.append("")
    return "\n".join(lines)


def _raw(conn: Connection) -> Any:
    raw = conn.connection.driver_connection
    if raw is None:  # pragma: no cover - a live connection always has one
        raise LedgerError("no driver connection")
    return raw


def copy_rows(conn: Connection, data: str) -> None:
    """COPY the batch in one write: few driver calls, so few GIL hand-offs."""
    import psycopg

    try:
        with _raw(conn).cursor() as cur, cur.copy(_COPY_SQL) as copy:
            copy.write(data.encode())
    except psycopg.OperationalError as err:
        raise exc.OperationalError(_COPY_SQL, None, err) from err
    except psycopg.Error as err:
        raise exc.DatabaseError(_COPY_SQL, None, err) from err


def read_head_pipelined(conn: Connection, chain_id: str) -> tuple[bool, Any]:
    """BEGIN, the chain-row lock and the head query in one round trip (libpq pipeline): (the
    chain exists, its last (seq, hash) row or None). The head query runs after the lock is
    granted, on a snapshot of its own (READ COMMITTED), so it sees what the previous holder
    of the lock committed."""
    import psycopg

    raw = _raw(conn)
    try:
        with raw.pipeline():
            lock = raw.execute(_LOCK_CHAIN, (chain_id,))
            head = raw.execute(_HEAD, (chain_id,))
        return lock.fetchone() is not None, head.fetchone()
    except psycopg.OperationalError as err:
        raise exc.OperationalError(_HEAD, None, err) from err
    except psycopg.Error as err:
        raise exc.DatabaseError(_HEAD, None, err) from err


def executemany_pipelined(
    conn: Connection, statements: Sequence[tuple[str, Sequence[Sequence[Any]]]]
) -> None:
    """Run each ``(sql, rows)`` as an executemany, all in one libpq pipeline: one round trip
    for the lot, and each statement prepared once per connection."""
    if not statements:
        return
    import psycopg

    raw = _raw(conn)
    sql = ""
    try:
        with raw.pipeline(), raw.cursor() as cur:
            for sql, rows in statements:
                cur.executemany(sql, rows)
    except psycopg.OperationalError as err:
        raise exc.OperationalError(sql, None, err) from err
    except psycopg.IntegrityError as err:
        raise exc.IntegrityError(sql, None, err) from err
    except psycopg.Error as err:
        raise exc.DatabaseError(sql, None, err) from err

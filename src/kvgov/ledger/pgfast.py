"""Postgres fast paths of the ledger writer: rows as COPY text, one COPY write per batch, the
chain lock with the head read in one round trip, and small batches written whole (but for the
COMMIT) in one round trip.

Plain functions over the raw psycopg connection under a SQLAlchemy ``Connection`` (inside the
caller's transaction); driver errors are mapped onto SQLAlchemy's, like any statement's, so
the writer's retry logic sees one error tree. Nothing here commits.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, exc

from kvgov.errors import LedgerError
from kvgov.ledger.chain import format_time

if TYPE_CHECKING:
    import psycopg

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
#: class (first key) of the transaction-level advisory locks that serialise a chain's
#: committers: the bytes ``kvch``; the second key is the chain id's ``hashtext``
CHAIN_LOCK_CLASS = int.from_bytes(b"kvch", "big")
#: lock the chain (returns its row if it is registered). An advisory lock, not ``FOR UPDATE``:
#: a row lock needs UPDATE privilege on ``chains``, which the runtime role must not have
_LOCK_CHAIN = (
    "SELECT c.chain_id FROM chains AS c,"  # noqa: S608 - constants
    f" pg_advisory_xact_lock({CHAIN_LOCK_CLASS}, hashtext(c.chain_id)) AS l"
    " WHERE c.chain_id = %s"
)
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


def _raw(conn: Connection) -> psycopg.Connection[Any]:
    """The psycopg connection under ``conn`` (the engine's driver on Postgres)."""
    raw: psycopg.Connection[Any] | None = conn.connection.driver_connection
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
    """BEGIN, the chain lock and the head query in one round trip (libpq pipeline): (the
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


def _map_error(err: Exception, sql: str) -> Exception:
    """A psycopg error as SQLAlchemy's (what the writer's retry and split logic catch)."""
    import psycopg

    if isinstance(err, psycopg.OperationalError):
        return exc.OperationalError(sql, None, err)
    if isinstance(err, psycopg.IntegrityError):
        return exc.IntegrityError(sql, None, err)
    return exc.DatabaseError(sql, None, err)


def execute_pipelined(conn: Connection, statements: Sequence[tuple[str, Sequence[Any]]]) -> None:
    """Run each ``(sql, params)`` once, all in one libpq pipeline: one round trip for the lot
    (psycopg prepares a statement it has seen a few times on the connection)."""
    if not statements:
        return
    import psycopg

    raw = _raw(conn)
    sql = ""
    try:
        with raw.pipeline(), raw.cursor() as cur:
            for sql, params in statements:
                cur.execute(sql, params)
    except psycopg.Error as err:
        raise _map_error(err, sql) from err


# -- small batches: the whole transaction but its COMMIT in one round trip --------------------
#
# COPY cannot run in a pipeline, so a batch written with it costs four round trips (BEGIN, lock
# and head; COPY; index upserts; COMMIT), each with its own Python work in psycopg, and so does
# every statement in them. For a small batch that overhead is most of the commit. So a small
# batch is two statements in one pipeline: the chain lock, then ONE statement that checks the
# head and writes everything: the rows, as the parameter of an INSERT ... SELECT that splits
# the COPY text the sequencer already formatted, and the index upserts as data-modifying CTEs.
#
# The batch was chained on the head the sequencer expected. The second statement runs after the
# lock is granted, on a snapshot taken then (READ COMMITTED), and fails unless the chain's head
# is that head: a statement is atomic, so nothing of it is written. The caller then rolls back
# and takes the general path, which re-chains on the real head.

#: batches up to this many events take :func:`write_small_batch` (larger ones COPY, which is
#: cheaper per row on the server)
SMALL_BATCH_MAX = 256

#: the head check: 0 when the chain's last row is (``seq``, ``hash``) (seq 0 and the given
#: genesis hash for an empty chain), else an error. The failing branch casts text naming the
#: real head to int: it depends on a column, so the planner cannot fold it (a constant 1/0
#: would fail every time), and the message says what was found
_CHECK_HEAD = (
    "(SELECT CASE WHEN COALESCE(h.seq, 0) = %s AND COALESCE(h.hash, %s) = %s THEN 0"
    " ELSE ('kvgov: chain head moved, now at seq ' || COALESCE(h.seq, 0))::int END"
    " FROM (SELECT 1) AS one LEFT JOIN LATERAL (SELECT seq, hash FROM ledger_events"
    " WHERE chain_id = %s ORDER BY seq DESC LIMIT 1) AS h ON true)"
)
#: COPY text with no escapes but ``\N`` (every row ``plain``), split back into the columns of
#: :data:`EVENT_COLUMNS`; ``attrs`` is cast from its text as is (``json`` keeps it verbatim)
_NOT_NULL = {"chain_id", "seq", "prev_hash", "hash", "encoding_version", "occurred_at", "kind"}
_NULLABLE = frozenset(EVENT_COLUMNS) - {*_NOT_NULL, "attrs"}
_CASTS = {"seq": "bigint", "encoding_version": "smallint", "occurred_at": "timestamptz"}
_CASTS |= {"nbytes": "bigint", "attrs": "json"}


def _field(i: int, name: str) -> str:
    value = f"f[{i + 1}]"
    if name in _NULLABLE:
        value = f"NULLIF({value}, '{_COPY_NULL}')"
    cast = _CASTS.get(name)
    return f"({value})::{cast}" if cast else value


#: the rows, written only if the head check (a one-time filter, evaluated before any row) is 0.
#: Parameters: chain id, COPY text, then the check's
_SPLIT_ROWS = (
    "(SELECT string_to_array(line, E'\\t') AS f"
    " FROM unnest(string_to_array(%s, E'\\n')) AS line WHERE line <> '') AS r"
)
_SELECT_FIELDS = ", ".join(_field(i, c) for i, c in enumerate(EVENT_COLUMNS) if c != "chain_id")
_INSERT_CHECKED = (
    f"INSERT INTO ledger_events ({', '.join(EVENT_COLUMNS)})"  # noqa: S608 - constants
    f" SELECT %s, {_SELECT_FIELDS} FROM {_SPLIT_ROWS} WHERE {_CHECK_HEAD} = 0"
)
_batch_sql_cache: dict[tuple[str, ...], str] = {}


def _batch_sql(index_sql: tuple[str, ...]) -> str:
    """The index statements as CTEs of the checked insert (a data-modifying CTE runs whether
    or not anything reads it). Each touches other rows (a batch folds its changes per key, and
    its upserts of one table are of distinct keys), so none depends on another's effect."""
    sql = _batch_sql_cache.get(index_sql)
    if sql is None:
        ctes = ", ".join(f"i{n} AS ({s})" for n, s in enumerate(index_sql))
        sql = f"WITH {ctes} {_INSERT_CHECKED}" if ctes else _INSERT_CHECKED
        if len(_batch_sql_cache) < 256:
            _batch_sql_cache[index_sql] = sql
    return sql


def write_small_batch(
    conn: Connection,
    chain_id: str,
    *,
    expected: tuple[int, str],
    genesis: str,
    copy: str,
    statements: Sequence[tuple[str, Sequence[Any]]],
) -> bool:
    """In one round trip: lock the chain, then, if its head is ``expected``, insert the rows
    (``copy``: their COPY text, every row plain) and apply the index ``statements``
    (INSERTs without RETURNING). Returns False, with the transaction rolled back (locks
    released, nothing written), if the database refused any of it: a moved head, or a row or
    index change (the general path then re-chains, or meets the refusal again and reports
    it). A lost connection raises, mapped like any statement's error."""
    import psycopg

    params: list[Any] = []
    for _, p in statements:
        params.extend(p)
    params += (chain_id, copy, expected[0], genesis, expected[1], chain_id)
    sql = _batch_sql(tuple([s for s, _ in statements]))
    raw = _raw(conn)
    try:
        with raw.pipeline(), raw.cursor() as cur:
            cur.execute(_LOCK_CHAIN, (chain_id,))
            cur.execute(sql, params)
    except psycopg.OperationalError as err:
        raise _map_error(err, sql) from err
    except psycopg.Error:
        # the driver connection's transaction is aborted: end it. The caller's SQLAlchemy
        # transaction goes on, on the driver's next (implicitly begun) transaction
        raw.rollback()
        return False
    return True

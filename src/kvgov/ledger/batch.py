"""One writer batch, applied in one transaction: chain the events and update the indexes.

:func:`prepare` turns an :class:`~kvgov.ledger.events.Event` into plain row values (refusing
what the database could not store faithfully); :func:`apply_batch` then, inside the caller's
transaction, locks the chain, reads its head, assigns ``seq`` and hashes in order, inserts the
events (COPY on Postgres, a multi-row insert elsewhere), their payloads, and applies the
index changes the events carry (cache entries, requests, user references, policy decisions).
The caller commits; nothing here does.
"""

from __future__ import annotations

import json
import os
from collections.abc import Set
from dataclasses import dataclass, field
from datetime import UTC
from itertools import repeat
from operator import attrgetter
from typing import Any, Protocol

from sqlalchemy import Connection, select, update

from kvgov.boundedjson import MAX_JSON_BYTES, check_bounds
from kvgov.db.models import (
    DECISION_ID,
    DIGEST,
    PSEUDONYM,
    REQUEST_ID,
    REVISION,
    TENANT,
    Chain,
    EventPayload,
    JournalMark,
    LedgerEvent,
    table,
)
from kvgov.errors import LedgerError
from kvgov.ledger.chain import (
    ENCODING_VERSION,
    GENESIS_HASH,
    canonical_json,
    event_prefix,
    format_time,
    is_chain_hash,
    link_encoded,
    link_target,
    normalize_json,
    payload_digest,
)
from kvgov.ledger.events import EVENT_TEXT_FIELDS, Appended, Event
from kvgov.ledger.indexes import apply_indexes, pg_index_statements, plan_indexes
from kvgov.ledger.pgfast import (
    COPY_SPECIAL,
    EVENT_COLUMNS,
    SMALL_BATCH_MAX,
    copy_line,
    copy_rows,
    copy_text,
    read_head_pipelined,
    write_small_batch,
)
from kvgov.logging import get_logger

log = get_logger(__name__)

_SALT_BYTES = 16
_ATTRS = EVENT_COLUMNS.index("attrs")


@dataclass(slots=True)
class Prepared:
    """An event reduced to the values the batch writes (no seq or hash yet)."""

    event: Event
    attrs: dict[str, Any]
    #: ``canonical_json(attrs)``: hashed, and stored verbatim on Postgres
    attrs_json: str
    payload: dict[str, Any] | None
    salt: bytes | None
    payload_digest: str | None
    #: no text value needs escaping in COPY's text format (no backslash, tab, CR or LF)
    copy_plain: bool = False


_SCALARS = (str, int, float, bool, type(None))
_STR = frozenset({str})
#: ``map(isinstance, values, _ALL_SCALARS)`` checks each value against _SCALARS
_ALL_SCALARS = repeat(_SCALARS)


#: the widest text each event field (and entry-change field) may hold: the database's columns.
#: An event that does not fit is refused here, before any journal acknowledges it: once
#: acknowledged, a put is served, and the database refusing its record later would leave the
#: entry stored but unrecorded (issue 14, found by ``tests/security/test_key_tricks.py``).
_EVENT_WIDTHS = (
    ("tenant", TENANT),
    ("actor", PSEUDONYM),
    ("request_id", REQUEST_ID),
    ("key_digest", DIGEST),
    ("tier", 64),
    ("decision_id", DECISION_ID),
    ("policy_revision", REVISION),
    ("principal", 256),
)
_ENTRY_WIDTHS = (
    ("key_digest", DIGEST),
    ("tenant", TENANT),
    ("owner", PSEUDONYM),
    ("scope_user", PSEUDONYM),
    ("model", 256),
    ("key_id", 256),
    ("request_id", REQUEST_ID),
    ("decision_id", DECISION_ID),
    ("policy_revision", REVISION),
)
#: the entry change's texts that have a column width, read in one call
_ENTRY_TEXTS = attrgetter(*(name for name, _ in _ENTRY_WIDTHS))
#: no text this long can be too wide for any column (a digest or a pseudonym is exactly this
#: long: the usual event is checked with one ``max``, not field by field)
_NARROWEST = min(width for _, width in _EVENT_WIDTHS + _ENTRY_WIDTHS)


def _check_widths(event: Event, longest: int) -> None:
    """Refuse a text wider than its column; ``longest``: the longest of the event's texts."""
    if longest > _NARROWEST:
        for name, width in _EVENT_WIDTHS:
            value = getattr(event, name)
            if value is not None and len(value) > width:
                raise LedgerError(f"event field {name} is longer than {width} characters")
    e = event.entry
    if e is None:
        return
    # (map/filter, not a generator: a generator's every step is a Python call, per event)
    if max(map(len, filter(None, _ENTRY_TEXTS(e))), default=0) > _NARROWEST:
        for name, width in _ENTRY_WIDTHS:
            value = getattr(e, name)
            if value is not None and len(value) > width:
                raise LedgerError(f"entry field {name} is longer than {width} characters")


def prepare(event: Event) -> Prepared:
    """Check and normalise one event. Raises :class:`LedgerError` for what cannot be stored."""
    e = event
    # EVENT_TEXT_FIELDS, read one by one: on the event loop for every journaled event, and
    # attribute reads cost half of an attrgetter's call (measured, Python 3.11)
    texts = [
        t
        for t in (
            e.tenant,
            e.actor,
            e.request_id,
            e.key_digest,
            e.tier,
            e.reason,
            e.decision_id,
            e.policy_revision,
            e.principal,
        )
        if t is not None
    ]
    joined = "".join(texts)
    _check_widths(event, max(map(len, texts), default=0))
    if "\x00" in joined:
        for name in EVENT_TEXT_FIELDS:
            value = getattr(event, name)
            if value is not None and "\x00" in value:
                raise LedgerError(f"event field {name} contains a NUL character")
    occurred = e.occurred_at
    if occurred.tzinfo is not UTC and occurred.utcoffset() is None:
        raise LedgerError("event occurred_at must be timezone-aware")
    given = e.attrs
    if not given:
        attrs: dict[str, Any] = {}
        attrs_json = "{}"
    else:
        attrs_json = canonical_json(given)
        if "\\u0000" in attrs_json:
            raise LedgerError("event attrs contain a NUL character")
        if set(map(type, given)) <= _STR and all(map(isinstance, given.values(), _ALL_SCALARS)):
            attrs = dict(given)  # flat: reads back exactly as written
            if len(attrs_json) * 4 > MAX_JSON_BYTES:  # (one level: only its size may be past)
                _check_json_bounds("attrs", attrs_json)
        else:
            _check_json_bounds("attrs", attrs_json)
            attrs = json.loads(attrs_json)
            if canonical_json(attrs) != attrs_json:  # e.g. int keys, which JSON makes strings
                raise LedgerError("event attrs do not survive a JSON round trip (keys must be str)")
    payload: dict[str, Any] | None = None
    salt: bytes | None = None
    digest: str | None = None
    if e.payload is not None:
        payload = normalize_json(e.payload)
        _check_json_bounds("payload", canonical_json(payload))
        salt = os.urandom(_SALT_BYTES)
        digest = payload_digest(salt, payload)
    plain = COPY_SPECIAL.search(joined) is None and COPY_SPECIAL.search(attrs_json) is None
    return Prepared(event, attrs, attrs_json, payload, salt, digest, plain)


def _check_json_bounds(name: str, text: str) -> None:
    """Refuse an event whose JSON would not read back (:mod:`kvgov.boundedjson`): every
    reader would take its row for a forged one (review r14)."""
    problem = check_bounds(text)
    if problem is not None:
        raise LedgerError(f"event {name} {problem}: it would not read back from the ledger")


def read_head(conn: Connection, chain_id: str) -> tuple[int, str]:
    """Lock the chain (Postgres: an advisory lock on its id) and return its last (seq, hash).

    The hash is the one a row appended next links to, which seals and checkpoints sign: a
    head whose stored hash is malformed (no writer wrote it: someone with the runtime role,
    before migration 0014 refused it) is returned as its
    :func:`~kvgov.ledger.chain.link_target`, and logged (``ledger.chain.malformed_head``,
    error). Nothing downstream then parses a hash that is not hex, so the chain's writer keeps
    writing and its restarts start (review r13, F2); ``audit verify`` names the row."""
    if conn.dialect.name == "postgresql":
        found, row = read_head_pipelined(conn, chain_id)
    else:
        chains = table(Chain)
        found = (
            conn.execute(
                select(chains.c.chain_id).where(chains.c.chain_id == chain_id).with_for_update()
            ).first()
            is not None
        )
        events = table(LedgerEvent)
        row = conn.execute(
            select(events.c.seq, events.c.hash)
            .where(events.c.chain_id == chain_id)
            .order_by(events.c.seq.desc())
            .limit(1)
        ).first()
    if not found:
        raise LedgerError(f"chain {chain_id!r} is not registered")
    if row is None:
        return 0, GENESIS_HASH
    seq, stored = int(row[0]), str(row[1])
    if not is_chain_hash(stored):
        log.error("ledger.chain.malformed_head", extra={"chain_id": chain_id, "seq": seq})
        return seq, link_target(stored)
    return seq, stored


Head = tuple[int, str]
Rows = list[tuple[Any, ...]]
#: position runs ``(first, last)`` of a chain that its live writer did not write
Disclaimed = list[tuple[int, int]]


class HeadCheck(Protocol):
    """A live writer's check of the head it reads under the chain lock
    (:class:`kvgov.ledger.writing.foreign.ForeignWatch`): rows it did not write are named by a
    signed seal in the caller's transaction (:meth:`check`, before anything of the writer's
    own), and taken as known once that transaction committed (:meth:`settle`)."""

    @property
    def known(self) -> Head:
        """The head the writer last wrote or accounted for."""
        ...

    @property
    def every_transaction(self) -> bool:
        """Check every transaction, not only those that find the head moved (no pre-chained
        fast path): a short-lived writer beside a live one (``kvgov token``)."""
        ...

    @property
    def lease_s(self) -> int | None:
        """A neighbour writer's lease (the CLI's: its sessions' ids sign it, and it renews
        them, ``kvgov.ledger.seals.keep_open``); None: a chain's own writer."""
        ...

    @property
    def session(self) -> str | None:
        """The writer session the transaction's rows go under (after :meth:`check`: one it
        resumed in that transaction, until it rolls back)."""
        ...

    def check(self, conn: Connection, head: Head) -> Disclaimed: ...

    def settle(self, head: Head, disclaimed: Disclaimed) -> None: ...

    def key_taken(self) -> None:
        """A key of the writer's own seal was found taken (counted; the seal went under
        another)."""
        ...


#: the journal mark moved by a small batch (a data-modifying CTE of its one statement)
_MOVE_MARK = (
    "UPDATE ledger_journal_marks SET applied_upto = %s WHERE chain_id = %s AND applied_upto < %s"
)


@dataclass(slots=True)
class Applied:
    appended: list[Appended]
    #: user pseudonyms this batch inserted into ``user_refs`` (cache them once committed)
    new_users: set[str]
    #: the chain's head after this batch
    head: Head = (0, GENESIS_HASH)
    #: True when the batch had to be chained here (no or stale pre-chained rows)
    rechained: bool = True
    #: rows before the batch its writer did not write, named by a foreign seal in the same
    #: transaction (:class:`HeadCheck`)
    foreign: Disclaimed = field(default_factory=list)


def apply_batch(
    conn: Connection,
    chain_id: str,
    batch: list[Prepared],
    known_users: Set[str] = frozenset(),
    *,
    chained: tuple[Head, Rows] | None = None,
    attempts: list[tuple[Rows, bool]] | None = None,
    copy: str | None = None,
    mark: int = 0,
    check: HeadCheck | None = None,
) -> Applied:
    """Append ``batch`` to the chain inside the caller's transaction; return the positions.

    ``chained`` is the batch already chained (by :func:`chain_rows`) on top of an expected
    head: used as is when the chain's head in the database is that head, recomputed
    otherwise (``copy`` is their COPY text, used with them). ``known_users`` are pseudonyms
    already in ``user_refs`` (skipped). The rows about to be written are appended to
    ``attempts`` (for :func:`find_committed`). ``mark``: the last local-journal position the
    batch holds (0: none); the chain's journal mark moves to it in the same transaction.
    ``check``: the live writer's :class:`HeadCheck`, given the head read under the lock before
    any row is written (rows it did not write are sealed as foreign first).

    On Postgres a small pre-chained batch first tries :func:`_apply_small`: everything in one
    round trip, if the head is the expected one. It is not tried when the batch was chained on
    another head than the one the writer knows it left (a re-chain after a refused event, or
    someone else's rows): the head would not match, and the general path reads it anyway."""
    fast = (
        check is None
        or chained is None
        or (chained[0] == check.known and not check.every_transaction)
    )
    if fast and chained is not None and copy is not None and conn.dialect.name == "postgresql":
        applied = _apply_small(
            conn,
            chain_id,
            batch,
            known_users,
            chained=chained,
            attempts=attempts,
            copy=copy,
            mark=mark,
        )
        if applied is not None:
            return applied
    head = read_head(conn, chain_id)
    # the head the writer knows it left, compared with the one just read: a re-chain after a
    # refused event keeps them equal; rows someone else appended do not (no extra query)
    foreign = check.check(conn, head) if check is not None else []
    rechained = chained is None or chained[0] != head
    if chained is not None and not rechained:
        rows = chained[1]
    else:
        rows, _ = chain_rows(chain_id, head, batch)
        copy = None
    if attempts is not None:
        attempts.append((rows, rechained))
    applied = write_rows(conn, chain_id, batch, rows, known_users, copy=copy)
    if mark:
        marks = table(JournalMark)
        conn.execute(
            update(marks)
            .where(marks.c.chain_id == chain_id, marks.c.applied_upto < mark)
            .values(applied_upto=mark)
        )
    applied.rechained = rechained
    applied.foreign = foreign
    if rows:
        applied.head = (rows[-1][1], rows[-1][3])
    else:
        applied.head = head
    return applied


def _apply_small(
    conn: Connection,
    chain_id: str,
    batch: list[Prepared],
    known_users: Set[str],
    *,
    chained: tuple[Head, Rows],
    attempts: list[tuple[Rows, bool]] | None,
    copy: str,
    mark: int = 0,
) -> Applied | None:
    """The batch written as chained, in one round trip (see :func:`write_small_batch`), or
    None, with nothing written, if it is not small and plain, or the head moved, or the
    database refused something (the caller then takes the general path)."""
    expected, rows = chained
    if not rows or len(rows) > SMALL_BATCH_MAX:
        return None
    for item in batch:
        # payloads go in a table of their own (rare: keep them on the general path); escaped
        # COPY text is not what the pipelined INSERT splits
        if item.payload is not None or not item.copy_plain:
            return None
    seqs = [r[1] for r in rows]
    index = plan_indexes(chain_id, batch, seqs, known_users)
    statements: list[tuple[str, tuple[Any, ...]]] = list(pg_index_statements(index))
    if mark:
        statements.append((_MOVE_MARK, (mark, chain_id, mark)))
    if attempts is not None:
        attempts.append((rows, False))
    if not write_small_batch(
        conn, chain_id, expected=expected, genesis=GENESIS_HASH, copy=copy, statements=statements
    ):
        return None
    last = rows[-1]
    appended = [Appended(chain_id, n) for n in seqs]
    return Applied(appended, set(index.users), head=(last[1], last[3]), rechained=False)


def find_committed(
    conn: Connection, chain_id: str, attempts: list[tuple[Rows, bool]]
) -> Applied | None:
    """After a failed attempt: whether one of the ``attempts`` (rows written by earlier tries
    of this batch) is in the chain after all, its COMMIT's reply lost with the connection.

    Locks the chain like :func:`apply_batch`, so an attempt still committing is waited for.
    A batch is one transaction: its first and last rows, with their hashes, being where it
    put them means all of it is. Returns the batch as committed (its positions), or None."""
    head = read_head(conn, chain_id)
    events = table(LedgerEvent)
    for rows, rechained in attempts:
        if not rows or head[0] < rows[-1][1]:
            continue
        first, last = rows[0], rows[-1]
        found = {
            int(seq): str(digest)
            for seq, digest in conn.execute(
                select(events.c.seq, events.c.hash).where(
                    events.c.chain_id == chain_id, events.c.seq.in_([first[1], last[1]])
                )
            )
        }
        if found.get(first[1]) == first[3] and found.get(last[1]) == last[3]:
            moved = head != (last[1], last[3])
            # the head the batch left, not the chain's: rows after it are someone else's,
            # which the writer's next transaction reads (and checks) as a moved head
            return Applied(
                [Appended(chain_id, r[1]) for r in rows],
                set(),  # not known: those users are upserted again later, harmlessly
                head=(last[1], last[3]),
                rechained=rechained or moved,
            )
    return None


def chain_rows(
    chain_id: str, head: Head, batch: list[Prepared], copy_lines: list[str] | None = None
) -> tuple[Rows, Head]:
    """Assign seqs and hashes to ``batch`` after ``head``: the ``ledger_events`` rows (in the
    order of the table's columns) and the new head. Pure computation. With ``copy_lines``,
    also append each row as a line of COPY text (see :func:`copy_text`)."""
    seq, prev = head[0], link_target(head[1])  # a chain hash (read_head's already is)
    prefix = event_prefix(chain_id)
    rows: Rows = []
    for item in batch:
        e = item.event
        seq += 1
        when = format_time(e.occurred_at)
        # the chained fields after the time, in the order both the hash encoding and
        # EVENT_COLUMNS take them
        tail = (
            str(e.kind),
            e.tenant,
            e.actor,
            e.request_id,
            e.key_digest,
            e.tier,
            e.nbytes,
            None if e.outcome is None else str(e.outcome),
            e.reason,
            e.decision_id,
            e.policy_revision,
            e.principal,
            item.attrs_json,
            item.payload_digest,
        )
        digest = link_encoded(prefix, seq, prev, when, *tail)
        row = (chain_id, seq, prev, digest, ENCODING_VERSION, e.occurred_at, *tail)
        rows.append(row)
        if copy_lines is not None:
            copy_lines.append(copy_line(row, when, item.copy_plain))
        prev = digest
    return rows, (seq, prev)


def write_rows(
    conn: Connection,
    chain_id: str,
    batch: list[Prepared],
    rows: Rows,
    known_users: Set[str],
    *,
    copy: str | None = None,
) -> Applied:
    """Insert chained rows, their payloads and the index changes they carry. ``copy`` is the
    rows' COPY text when the caller already has it (Postgres)."""
    _insert_events(conn, rows, batch, copy)
    seqs = [r[1] for r in rows]
    payloads = [
        {"chain_id": chain_id, "seq": n, "salt": it.salt, "payload": it.payload}
        for n, it in zip(seqs, batch, strict=True)
        if it.payload is not None
    ]
    if payloads:
        conn.execute(table(EventPayload).insert(), payloads)
    new_users = apply_indexes(conn, chain_id, batch, seqs, known_users)
    return Applied([Appended(chain_id, n) for n in seqs], new_users)


def _insert_events(
    conn: Connection, rows: list[tuple[Any, ...]], batch: list[Prepared], data: str | None
) -> None:
    if conn.dialect.name == "postgresql":
        copy_rows(
            conn, data if data is not None else copy_text(rows, [i.copy_plain for i in batch])
        )
        return
    dicts = []
    for row, item in zip(rows, batch, strict=True):
        values = dict(zip(EVENT_COLUMNS, row, strict=True))
        values["attrs"] = item.attrs
        dicts.append(values)
    conn.execute(table(LedgerEvent).insert(), dicts)

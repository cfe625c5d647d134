"""Start-up and replay: the chain registered (a new one with its signed genesis), the
writer session's signed open, its head and journal mark read, and the journal's records after
the mark read back as events to commit before anything new.

The mark (``ledger_journal_marks.applied_upto``) moves in the same transaction as the events
it covers, so the records after it are exactly the acknowledged events a crash kept from the
database: replayed first, each is committed exactly once. Their commits are awaited by nobody
(their puts were acknowledged before the crash); a failure is logged and the record stays in
the journal for the next start.

The mark is not trusted on its own word: it is a mutable row, and the runtime database role
may UPDATE it. Moved ahead after an unclean stop, it would have the journal skip and delete
acknowledged records the chain never received (``audit verify`` cannot notice a missing event
it never saw); moved back, it would replay records the chain already holds. So before the
journal deletes or skips anything, :func:`check_mark` looks for the records on both sides of
the mark in the chain itself (append-only and hash-linked): the last record at or below the
mark still on disk must be there, the first one after it must not. Records are found by their
chained content (time to the microsecond, kind, texts, attrs), which nobody without the
journal (a 0700 directory) knows ahead of time. Either mismatch refuses the start with
:class:`LedgerError`, the journal left whole for an operator. This costs two indexed lookups
at start, nothing per event.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import Executor

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import Connection, Engine, select

from kvgov.boundedjson import is_undecodable
from kvgov.db.engine import SQLITE_BEGIN_IMMEDIATE, utcnow
from kvgov.db.models import Chain, JournalMark, LedgerEvent, table
from kvgov.errors import LedgerError
from kvgov.ledger.batch import Head, chain_rows, prepare, read_head
from kvgov.ledger.chain import (
    GENESIS_HASH,
    canonical_json,
    format_time,
    key_fingerprint,
    public_key_bytes,
)
from kvgov.ledger.events import Appended, Event
from kvgov.ledger.journal import Journal, decode_event
from kvgov.ledger.pgfast import EVENT_COLUMNS
from kvgov.ledger.seals import open_session
from kvgov.ledger.writing.schedule import Item
from kvgov.ledger.writing.stats import WriterStats
from kvgov.logging import get_logger

log = get_logger(__name__)


def register_chain(
    engine: Engine,
    chain_id: str,
    public_key: bytes,
    *,
    description: str | None,
    journaled: bool,
    signing_key: Ed25519PrivateKey | None = None,
    session: str | None = None,
    exclusive: bool = False,
) -> tuple[Head, int]:
    """Register the chain (or check its key on restart); its head and, when ``journaled``,
    its journal mark (created at 0 on first use; 0 without a journal). With ``signing_key``
    and ``session``, in the same transaction: a new chain's genesis is signed, and the
    session's open (:func:`kvgov.ledger.seals.open_session`)."""
    chains = table(Chain)
    created = None
    # a write lock at BEGIN on SQLite: this transaction reads, then writes (the chain, its
    # seals), and a read lock upgraded while another writer of the file commits fails at once
    with (
        engine.connect().execution_options(**{SQLITE_BEGIN_IMMEDIATE: True}) as conn,
        conn.begin(),
    ):
        found = conn.execute(
            select(chains.c.public_key).where(chains.c.chain_id == chain_id)
        ).first()
        if found is None:
            created = utcnow()
            conn.execute(
                chains.insert().values(
                    chain_id=chain_id,
                    public_key=public_key,
                    created_at=created,
                    description=description,
                )
            )
        elif bytes(found[0]) != public_key:
            raise LedgerError(
                f"chain {chain_id!r} belongs to another signing key "
                f"({key_fingerprint(bytes(found[0]))})",
                hint="a chain's key never changes: use a new ledger.chain_id with a new key",
            )
        mark = 0
        if journaled:
            marks = table(JournalMark)
            found_mark = conn.execute(
                select(marks.c.applied_upto).where(marks.c.chain_id == chain_id)
            ).scalar()
            if found_mark is None:
                conn.execute(marks.insert().values(chain_id=chain_id, applied_upto=0))
            else:
                mark = int(found_mark)
        if signing_key is not None and session is not None:
            if public_key_bytes(signing_key) != public_key:
                raise LedgerError("the signing key does not match the chain's public key")
            head = open_session(
                conn, chain_id, signing_key, session, created=created, exclusive=exclusive
            )
            return head, mark
        return read_head(conn, chain_id), mark


def chain_holds(conn: Connection, chain_id: str, event: Event) -> bool:
    """Whether the chain holds ``event``: a row whose chained fields are the ones the batch
    would write for it (the salted payload digest only by its presence). Looked up by the
    indexed columns (request id, key digest, actor, tenant and kind) and the time, newest
    first; the other fields are compared here, as chained (the stored forms differ by
    dialect)."""
    expected = chain_rows(chain_id, (0, GENESIS_HASH), [prepare(event)])[0][0]
    when, texts, attrs_json, digest = (
        format_time(expected[5]),
        expected[6:18],
        expected[18],
        expected[19],
    )
    events = table(LedgerEvent)
    cols = events.c
    where = [
        cols.chain_id == chain_id,
        cols.kind == str(event.kind),
        cols.occurred_at == event.occurred_at,
    ]
    for col, value in (
        (cols.tenant, event.tenant),
        (cols.actor, event.actor),
        (cols.request_id, event.request_id),
        (cols.key_digest, event.key_digest),
    ):
        where.append(col.is_(None) if value is None else col == value)
    query = (
        select(*(cols[name] for name in _MATCHED), cols.attrs, cols.payload_digest)
        .where(*where)
        .order_by(cols.seq.desc())
    )
    result = conn.execution_options(yield_per=256).execute(query)
    try:
        for row in result:
            if (
                format_time(row[0]) == when
                and tuple(row[1 : len(_MATCHED)]) == texts
                and not is_undecodable(row[-2])  # past the JSON bounds: no writer wrote it
                and canonical_json(row[-2] if row[-2] is not None else {}) == attrs_json
                and (row[-1] is None) == (digest is None)
            ):
                return True
    finally:
        result.close()
    return False


#: the chained columns compared as stored, in the order :func:`chain_rows` lays them out
#: (the event table's columns from the time to the principal)
_MATCHED = tuple(
    EVENT_COLUMNS[EVENT_COLUMNS.index("occurred_at") : EVENT_COLUMNS.index("principal") + 1]
)


def check_mark(
    engine: Engine,
    chain_id: str,
    applied_upto: int,
    held: tuple[int, bytes] | None,
    pending: tuple[int, bytes] | None,
) -> None:
    """Confirm the chain's journal mark against the chain before the journal trusts it
    (a :data:`~kvgov.ledger.journal.MarkCheck`): ``held``, the last record at or below the
    mark still on disk, must be in the chain, and ``pending``, the first after it, must not.
    The mark moves in the same transaction as the events it covers, so a mismatch means the
    row was changed by someone else. Raises :class:`LedgerError` (logged) to refuse the
    start: skipping ``held`` would drop acknowledged events, replaying ``pending`` would
    record events twice."""
    if held is None and pending is None:
        return
    with engine.connect() as conn:
        if held is not None and not chain_holds(conn, chain_id, decode_event(held[1])):
            raise _mark_refused(
                "ledger.journal.mark_ahead",
                chain_id,
                applied_upto,
                held[0],
                "says the chain holds journal record {pos}, but the chain lacks it: starting"
                " would drop acknowledged ledger events from the journal",
            )
        if pending is not None and chain_holds(conn, chain_id, decode_event(pending[1])):
            raise _mark_refused(
                "ledger.journal.mark_behind",
                chain_id,
                applied_upto,
                pending[0],
                "says the chain lacks journal record {pos}, but the chain holds it: starting"
                " would record acknowledged ledger events twice",
            )


def _mark_refused(
    event: str, chain_id: str, applied_upto: int, pos: int, claim: str
) -> LedgerError:
    """The start refused for a journal mark the chain contradicts (logged here)."""
    log.error(
        event,
        extra={"chain_id": chain_id, "applied_upto": applied_upto, "position": pos},
    )
    return LedgerError(
        f"chain {chain_id!r}: the journal mark (applied_upto {applied_upto}) "
        + claim.format(pos=pos),
        hint=(
            "ledger_journal_marks is not moved that way by kvgov (a database role that can"
            " write it changed it?). The journal is left untouched: keep a copy, compare it"
            " with the chain (`kvgov audit journal`) and, as the database owner, set"
            " applied_upto to the last position the chain really holds (the records after it"
            " are then replayed)"
        ),
    )


def read_back(
    journal: Journal, chain_id: str, applied_upto: int, engine: Engine | None = None
) -> list[tuple[Event, int]]:
    """Open ``journal`` (for ``chain_id``: another chain's journal is refused) and decode its
    records after ``applied_upto``, in order, with their positions. With ``engine``, the mark
    is first confirmed against the chain (:func:`check_mark`). Raises :class:`LedgerError`
    for a damaged journal, a record that is not an event or a mark the chain contradicts."""
    check = (
        None if engine is None else functools.partial(check_mark, engine, chain_id, applied_upto)
    )
    return [
        (decode_event(payload), pos)
        for pos, payload in journal.open(applied_upto, chain_id=chain_id, check=check)
    ]


async def replay(
    journal: Journal,
    chain_id: str,
    applied_upto: int,
    *,
    executor: Executor,
    stats: WriterStats,
    engine: Engine | None = None,
) -> list[Item]:
    """The journal's records after ``applied_upto`` as queue items (read on ``executor``),
    each with a commit future nobody awaits (the batcher logs a failure: journaled). With
    ``engine`` the mark is confirmed against the chain first (:func:`check_mark`)."""
    loop = asyncio.get_running_loop()
    records = await loop.run_in_executor(
        executor, read_back, journal, chain_id, applied_upto, engine
    )
    items: list[Item] = []
    for event, pos in records:
        fut: asyncio.Future[Appended] = loop.create_future()
        items.append((event, fut, pos))  # a failed commit is logged by the batcher
    if records:
        stats.journal_replayed += len(records)
        log.warning(
            "ledger.journal.replayed",
            extra={"chain_id": chain_id, "events": len(records), "from_position": records[0][1]},
        )
    return items

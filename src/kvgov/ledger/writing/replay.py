"""Start-up and replay: the chain registered (a new one with its signed genesis), the
writer session's signed open, its head and journal mark read, and the journal's records after
the mark read back as events to commit before anything new.

The mark (``ledger_journal_marks.applied_upto``) moves in the same transaction as the events
it covers, so the records after it are exactly the acknowledged events a crash kept from the
database: replayed first, each is committed exactly once. Their commits are awaited by nobody
(their puts were acknowledged before the crash); a failure is logged and the record stays in
the journal for the next start.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import Engine, select

from kvgov.db.engine import utcnow
from kvgov.db.models import Chain, JournalMark, table
from kvgov.errors import LedgerError
from kvgov.ledger.batch import Head, read_head
from kvgov.ledger.chain import key_fingerprint, public_key_bytes
from kvgov.ledger.events import Appended, Event
from kvgov.ledger.journal import Journal, decode_event
from kvgov.ledger.seals import open_session
from kvgov.ledger.writing.acks import log_unwritten
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
    with engine.connect() as conn, conn.begin():
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


def read_back(journal: Journal, chain_id: str, applied_upto: int) -> list[tuple[Event, int]]:
    """Open ``journal`` (for ``chain_id``: another chain's journal is refused) and decode its
    records after ``applied_upto``, in order, with their positions. Raises
    :class:`LedgerError` for a damaged journal or a record that is not an event."""
    return [
        (decode_event(payload), pos)
        for pos, payload in journal.open(applied_upto, chain_id=chain_id)
    ]


async def replay(
    journal: Journal,
    chain_id: str,
    applied_upto: int,
    *,
    executor: Executor,
    stats: WriterStats,
) -> list[Item]:
    """The journal's records after ``applied_upto`` as queue items (read on ``executor``),
    each with a commit future that logs a failure (nobody awaits it)."""
    loop = asyncio.get_running_loop()
    records = await loop.run_in_executor(executor, read_back, journal, chain_id, applied_upto)
    items: list[Item] = []
    for event, pos in records:
        fut: asyncio.Future[Appended] = loop.create_future()
        fut.add_done_callback(log_unwritten)
        items.append((event, fut, pos))
    if records:
        stats.journal_replayed += len(records)
        log.warning(
            "ledger.journal.replayed",
            extra={"chain_id": chain_id, "events": len(records), "from_position": records[0][1]},
        )
    return items

"""A lost commit reply: the database committed the batch, but the writer saw the connection
fail. The retry must recognise its own batch at the chain head and not write it twice.

The failure is injected where the driver's COMMIT returns: the real COMMIT runs, then (on
Postgres) the connection is closed and the driver's OperationalError raised, as when the
server's reply is lost; SQLAlchemy handles it like any disconnect.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import sqlalchemy as sa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kvgov.db.engine import make_engine, make_sessionmaker, upgrade
from kvgov.db.models import CacheEntry, EventPayload, LedgerEvent
from kvgov.ledger.events import EntryChange, Event
from kvgov.ledger.verify import verify
from kvgov.ledger.writer import LedgerWriter
from kvgov.types import EntryState, EventKind

pytestmark = pytest.mark.postgres

KEY = Ed25519PrivateKey.generate()


class LoseCommitReplies:
    """Makes the next ``n`` COMMITs succeed on the server but fail for the caller."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self.pending = 0
        self.lost = 0
        self._real: Callable[[Any], None] = engine.dialect.do_commit
        engine.dialect.do_commit = self._commit  # type: ignore[method-assign]

    def _commit(self, dbapi_conn: Any) -> None:
        self._real(dbapi_conn)
        if self.pending <= 0:
            return
        self.pending -= 1
        self.lost += 1
        dbapi = self.engine.dialect.loaded_dbapi
        if self.engine.dialect.name == "postgresql":
            dbapi_conn.dbapi_connection.close()  # the pool's proxy: close the socket under it
            raise dbapi.OperationalError("server closed the connection unexpectedly")
        raise dbapi.OperationalError("disk I/O error")


@pytest.fixture
async def engine(db_url: str) -> AsyncIterator[sa.Engine]:
    upgrade(db_url)
    eng = make_engine(db_url)
    yield eng
    eng.dispose()


def event(i: int) -> Event:
    digest = f"{i:064x}"
    return Event(
        kind=EventKind.KV_PUT,
        tenant="acme",
        actor="a" * 32,
        request_id=f"r{i}",
        key_digest=digest,
        nbytes=i,
        payload={"excerpt": f"words {i}"},
        entry=EntryChange(key_digest=digest, state=EntryState.LIVE, tenant="acme", size=i),
    )


def count(engine: sa.Engine, model: type) -> int:
    with make_sessionmaker(engine)() as s:
        return int(s.scalar(sa.select(sa.func.count()).select_from(model)) or 0)


async def test_a_batch_whose_commit_reply_was_lost_is_written_once(engine: sa.Engine) -> None:
    writer = LedgerWriter(engine, chain_id="node-a", signing_key=KEY, batch_max_events=50)
    await writer.start()
    for i in range(3):
        await writer.append(event(i))
    faults = LoseCommitReplies(engine)
    faults.pending = 1
    # one batch of 50 (committed, reply lost), then the rest
    futures = [writer.submit(event(i)) for i in range(3, 120)]
    positions = [(await f).seq for f in futures]
    faults.pending = 1  # a lone event too
    positions.append((await writer.append(event(120))).seq)
    await writer.close()

    assert faults.lost == 2
    assert writer.stats.batch_retries >= 2
    assert positions == list(range(4, 122))
    assert count(engine, LedgerEvent) == 121
    assert count(engine, EventPayload) == 121
    assert count(engine, CacheEntry) == 121
    assert writer.stats.events_written == 121
    report = await asyncio.to_thread(verify, engine)
    assert report.ok, report.to_dict()


async def test_two_lost_replies_in_a_row_still_write_once(engine: sa.Engine) -> None:
    """The retry that finds the batch loses its own COMMIT reply too: the next retry finds
    the first try's batch again and writes nothing."""
    writer = LedgerWriter(engine, chain_id="node-a", signing_key=KEY)
    await writer.start()
    faults = LoseCommitReplies(engine)
    faults.pending = 2  # the first COMMIT's reply is lost; so is the retry's (nothing to commit)
    got = await asyncio.gather(*(writer.submit(event(i)) for i in range(10)))
    assert [a.seq for a in got] == list(range(1, 11))
    await writer.close()
    assert count(engine, LedgerEvent) == 10
    assert (await asyncio.to_thread(verify, engine)).ok

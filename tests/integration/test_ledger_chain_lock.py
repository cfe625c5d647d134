"""A chain's committers are serialised on Postgres by a transaction-level advisory lock on the
chain id, not a row lock on ``chains`` (``FOR UPDATE`` needs UPDATE privilege, which the
runtime role does not have): a second committer of the same chain waits until the first
commits, then chains on the head the first left; another chain does not wait at all."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime

import psycopg
import pytest
import sqlalchemy as sa

from kvgov.db.engine import make_engine, upgrade
from kvgov.db.models import Chain, table
from kvgov.ledger.batch import apply_batch, prepare, read_head
from kvgov.ledger.events import Event
from kvgov.ledger.pgfast import CHAIN_LOCK_CLASS
from kvgov.ledger.verify import verify
from kvgov.types import EventKind, Outcome

pytestmark = pytest.mark.postgres

T0 = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)


def _event(i: int) -> Event:
    return Event(kind=EventKind.KV_GET, tenant="t1", key_digest=f"{i:064x}", outcome=Outcome.OK)


def _waiting_on_chain_locks(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
            " AND classid = %s AND objsubid = 2",
            (CHAIN_LOCK_CLASS,),
        ).fetchone()
    return int(row[0]) if row else 0


def test_a_second_committer_of_a_chain_waits_for_the_first(pg_url: str) -> None:
    upgrade(pg_url)
    engine = make_engine(pg_url)
    dsn = pg_url.replace("postgresql+psycopg://", "postgresql://", 1)
    try:
        with engine.begin() as conn:
            for chain in ("a", "b"):
                conn.execute(
                    table(Chain)
                    .insert()
                    .values(chain_id=chain, public_key=b"k" * 32, created_at=T0)
                )
        first = engine.connect()
        first.begin()
        assert read_head(first, "a")[0] == 0  # and holds chain a's lock until it commits
        with engine.begin() as conn:  # another chain does not wait
            assert [r.seq for r in apply_batch(conn, "b", [prepare(_event(9))]).appended] == [1]

        second: list[int] = []

        def commit_second() -> None:
            with engine.begin() as conn:
                batch = [prepare(_event(i)) for i in (3, 4)]
                second.extend(r.seq for r in apply_batch(conn, "a", batch).appended)

        thread = threading.Thread(target=commit_second)
        thread.start()
        deadline = time.monotonic() + 60
        while _waiting_on_chain_locks(dsn) < 1:
            assert time.monotonic() < deadline, "the second committer never waited on the lock"
            time.sleep(0.05)
        assert second == []
        apply_batch(first, "a", [prepare(_event(i)) for i in (1, 2)])
        first.commit()
        first.close()
        thread.join(60)
        assert second == [3, 4]  # chained on the first's head, after its commit
        with engine.connect() as conn:
            seqs = conn.execute(
                sa.text("SELECT seq FROM ledger_events WHERE chain_id = 'a' ORDER BY seq")
            ).scalars()
            assert list(seqs) == [1, 2, 3, 4]
        assert verify(engine).ok
    finally:
        engine.dispose()

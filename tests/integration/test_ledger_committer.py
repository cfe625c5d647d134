"""The ledger writer's committer alone (``ledger.writing.commit.Committer``) on real SQLite and
Postgres: a chained batch is written in one transaction at the seqs it was chained on; a batch
chained on a stale head is re-chained on the database's real head and the sequencer told to
follow it; a writer closing past its grace period gives up instead of retrying."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
import sqlalchemy as sa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kvgov.db.engine import make_engine, upgrade
from kvgov.errors import LedgerError
from kvgov.ledger.batch import Head, Prepared
from kvgov.ledger.chain import public_key_bytes
from kvgov.ledger.events import Appended, Event
from kvgov.ledger.verify import verify
from kvgov.ledger.writing.commit import Committer
from kvgov.ledger.writing.replay import register_chain
from kvgov.ledger.writing.sequence import Sequencer
from kvgov.ledger.writing.stats import WriterStats
from kvgov.types import EventKind

pytestmark = pytest.mark.postgres

AT = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
KEY = public_key_bytes(Ed25519PrivateKey.generate())


@pytest.fixture
def engine(db_url: str) -> Iterator[sa.Engine]:
    upgrade(db_url)
    eng = make_engine(db_url)
    yield eng
    eng.dispose()


def events(first: int, n: int) -> list[Event | Prepared]:
    return [
        Event(kind=EventKind.KV_GET, key_digest=f"{i:064x}", occurred_at=AT)
        for i in range(first, first + n)
    ]


def parts(engine: sa.Engine) -> tuple[Sequencer, Committer, list[Head], WriterStats]:
    head, _ = register_chain(engine, "node-a", KEY, description=None, journaled=False)
    sequencer = Sequencer("node-a", copy=engine.dialect.name == "postgresql")
    sequencer.start(head)
    followed: list[Head] = []

    def follow(h: Head) -> None:
        followed.append(h)
        sequencer.follow(h)

    stats = WriterStats()
    return (
        sequencer,
        Committer(engine, "node-a", stats, journal=None, follow=follow),
        followed,
        stats,
    )


def test_a_batch_is_written_where_it_was_chained(engine: sa.Engine) -> None:
    sequencer, committer, followed, stats = parts(engine)
    try:
        results = committer.commit_chained(sequencer.sequence(events(0, 3), [0] * 3))
        assert results == [Appended("node-a", s) for s in (1, 2, 3)]
        assert followed == []  # chained by the sequencer, as expected
        assert (committer.head_seq, stats.batches_committed, stats.events_written) == (3, 1, 3)
    finally:
        committer.drop_connection()
    assert verify(engine).ok


def test_a_batch_chained_on_a_stale_head_is_rechained_and_the_sequencer_follows(
    engine: sa.Engine,
) -> None:
    sequencer, committer, followed, _ = parts(engine)
    other_seq, other, _, _ = parts(engine)  # a second writer of the same chain (a restart)
    try:
        other.commit_chained(other_seq.sequence(events(0, 2), [0, 0]))
        stale = sequencer.sequence(events(2, 2), [0, 0])
        assert stale.expected[0] == 0
        assert committer.commit_chained(stale) == [Appended("node-a", 3), Appended("node-a", 4)]
        assert [h[0] for h in followed] == [4]
        nxt = sequencer.sequence(events(4, 1), [0])
        assert nxt.expected == followed[0]
        assert committer.commit_chained(nxt) == [Appended("node-a", 5)]
    finally:
        committer.drop_connection()
        other.drop_connection()
    assert verify(engine).ok


def test_an_aborted_committer_fails_the_batch_without_writing(engine: sa.Engine) -> None:
    sequencer, committer, _, stats = parts(engine)
    committer.abort.set()
    results = committer.commit_chained(sequencer.sequence(events(0, 2), [0, 0]))
    assert all(isinstance(r, LedgerError) for r in results)
    assert (stats.events_written, stats.events_failed) == (0, 2)
    committer.drop_connection()

"""The ledger writer's sequencer alone (``ledger.writing.sequence.Sequencer``): batches are
chained one after another on the head the previous one ended on, exactly as the reference
``chain_rows`` chains them; an event the ledger refuses fails alone, in its own slot; after
the committer re-chained a batch, the next follows the head it reports; on Postgres the rows
come with their COPY text. No database."""

from __future__ import annotations

from datetime import UTC, datetime

from kvgov.errors import LedgerError
from kvgov.ledger.batch import chain_rows, prepare
from kvgov.ledger.chain import GENESIS_HASH
from kvgov.ledger.events import Event
from kvgov.ledger.pgfast import copy_text
from kvgov.ledger.writing.sequence import YIELD_EVERY, Sequencer
from kvgov.types import EventKind

AT = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def event(i: int, **kw: str) -> Event:
    return Event(kind=EventKind.KV_GET, tenant="acme", key_digest=f"{i:064x}", occurred_at=AT, **kw)


def test_batches_chain_on_one_another_as_the_reference_does() -> None:
    seq = Sequencer("node-a", copy=False)
    seq.start((0, GENESIS_HASH))
    first = seq.sequence([event(i) for i in range(3)], [0, 0, 0])
    second = seq.sequence([event(i) for i in range(3, 5)], [0, 0])
    assert first.expected == (0, GENESIS_HASH)
    assert second.expected == (3, first.rows[-1][3])  # the head the first batch ended on
    reference, _ = chain_rows("node-a", (0, GENESIS_HASH), [prepare(event(i)) for i in range(5)])
    assert [r[:4] for r in first.rows + second.rows] == [r[:4] for r in reference]
    assert first.copy is None


def test_a_refused_event_fails_alone_and_positions_stay_aligned() -> None:
    seq = Sequencer("node-a", copy=False)
    seq.start((7, "f" * 64))
    chained = seq.sequence([event(0), event(1, reason="bad\x00"), event(2)], [11, 12, 13])
    assert chained.results[0] is None and chained.results[2] is None
    assert isinstance(chained.results[1], LedgerError)
    assert [i for i, _ in chained.ready] == [0, 2]
    assert chained.positions == [11, 13]
    assert [r[1] for r in chained.rows] == [8, 9]  # the refused event takes no seq


def test_prepared_events_are_taken_as_they_are() -> None:
    seq = Sequencer("node-a", copy=False)
    seq.start((0, GENESIS_HASH))
    prepared = prepare(event(0))
    chained = seq.sequence([prepared, event(1)], [5, 0])
    assert chained.ready[0][1] is prepared
    assert chained.positions == [5, 0]


def test_after_a_rechain_the_next_batch_follows_the_committed_head() -> None:
    seq = Sequencer("node-a", copy=False)
    seq.start((0, GENESIS_HASH))
    seq.sequence([event(0)], [0])  # expected to end on seq 1 ...
    seq.follow((4, "e" * 64))  # ... but the committer re-chained it on a moved head
    nxt = seq.sequence([event(1)], [0])
    assert nxt.expected == (4, "e" * 64)
    assert nxt.rows[0][1:3] == (5, "e" * 64)


def test_on_postgres_the_rows_come_with_their_copy_text() -> None:
    seq = Sequencer("node-a", copy=True)
    seq.start((0, GENESIS_HASH))
    n = YIELD_EVERY + 3  # across the sequencer's chunks
    events = [event(i, reason="tab\there" if i == 1 else "plain") for i in range(n)]
    chained = seq.sequence(list(events), [0] * n)
    plain = [p.copy_plain for _, p in chained.ready]
    assert chained.copy == copy_text(chained.rows, plain)
    assert len(chained.rows) == n

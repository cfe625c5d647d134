"""The cache-entry index across an entry's lives: a re-put of a live entry keeps its creator, a
put after it expired or was deleted starts a new life; provenance names the true creator.

Real SQLite and Postgres, real writer batches (one event per batch and several in one batch).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kvgov.db.engine import make_engine, make_sessionmaker, upgrade
from kvgov.db.models import CacheEntry
from kvgov.ledger.events import EntryChange, Event
from kvgov.ledger.verify import verify
from kvgov.ledger.writer import LedgerWriter
from kvgov.services.provenance import provenance, served_to, user_reuse
from kvgov.types import EntryState, EventKind, Outcome, Scope

pytestmark = pytest.mark.postgres

KEY = Ed25519PrivateKey.generate()
DIGEST = "d" * 64
ALICE, BOB = "a" * 32, "b" * 32
T0 = datetime(2025, 1, 1, tzinfo=UTC)


@pytest.fixture
async def engine(db_url: str) -> AsyncIterator[sa.Engine]:
    upgrade(db_url)
    eng = make_engine(db_url)
    yield eng
    eng.dispose()


def put(who: str, request_id: str, at: int, *, tiers: tuple[str, ...] = ("memory",)) -> Event:
    """A data-plane ``kv:put`` of DIGEST by ``who`` (user-scoped to ``who``) at T0 + ``at`` s."""
    when = T0 + timedelta(seconds=at)
    return Event(
        kind=EventKind.KV_PUT,
        tenant="acme",
        actor=who,
        request_id=request_id,
        key_digest=DIGEST,
        tier=",".join(tiers),
        nbytes=100 + at,
        outcome=Outcome.OK,
        decision_id=f"dec-{request_id}",
        policy_revision=f"rev-{at}",
        occurred_at=when,
        entry=EntryChange(
            key_digest=DIGEST,
            state=EntryState.LIVE,
            tenant="acme",
            owner=who,
            scope_user=who,
            scope=Scope.USER,
            size=100 + at,
            tiers=tiers,
            key_id=f"u:acme:{who}",
            key_version=at,
            expires_at=when + timedelta(hours=1),
            request_id=request_id,
            decision_id=f"dec-{request_id}",
            policy_revision=f"rev-{at}",
        ),
    )


def gone(state: EntryState, at: int) -> Event:
    kind = EventKind.KV_EXPIRED if state is EntryState.EXPIRED else EventKind.KV_DELETE
    return Event(
        kind=kind,
        tenant="acme",
        key_digest=DIGEST,
        outcome=Outcome.OK,
        occurred_at=T0 + timedelta(seconds=at),
        entry=EntryChange(key_digest=DIGEST, state=state),
    )


def get(who: str, request_id: str, at: int) -> Event:
    return Event(
        kind=EventKind.KV_GET,
        tenant="acme",
        actor=who,
        request_id=request_id,
        key_digest=DIGEST,
        tier="memory",
        nbytes=100,
        outcome=Outcome.HIT,
        occurred_at=T0 + timedelta(seconds=at),
    )


async def write(engine: sa.Engine, events: list[Event], *, one_batch: bool) -> None:
    writer = LedgerWriter(engine, chain_id="node-a", signing_key=KEY)
    await writer.start()
    try:
        if one_batch:  # submitted together before the writer task runs: one transaction
            futures = [writer.submit(e) for e in events]
            for fut in futures:
                await fut
            assert writer.stats.batches_committed == 1
        else:
            for event in events:
                await writer.append(event)
    finally:
        await writer.close()
    assert verify(engine).ok


def entry(engine: sa.Engine) -> CacheEntry:
    with make_sessionmaker(engine)() as session:
        row = session.get(CacheEntry, DIGEST)
        assert row is not None
        session.expunge(row)
        return row


@pytest.mark.parametrize("one_batch", [False, True], ids=["batches", "one-batch"])
async def test_a_reput_of_a_live_entry_keeps_its_creator(
    engine: sa.Engine, one_batch: bool
) -> None:
    await write(
        engine, [put(ALICE, "r1", 0), put(BOB, "r2", 5, tiers=("disk",))], one_batch=one_batch
    )
    row = entry(engine)
    # kept from the first put
    assert (row.owner, row.scope_user, row.created_request_id) == (ALICE, ALICE, "r1")
    assert row.created_at == T0
    # refreshed by the re-put
    assert row.state is EntryState.LIVE
    assert (row.tiers, row.size, row.key_id, row.key_version) == (["disk"], 105, f"u:acme:{BOB}", 5)
    assert row.expires_at == T0 + timedelta(seconds=5, hours=1)
    assert (row.decision_id, row.policy_revision) == ("dec-r2", "rev-5")
    assert row.updated_at == T0 + timedelta(seconds=5)


@pytest.mark.parametrize("state", [EntryState.EXPIRED, EntryState.DELETED, EntryState.PURGED])
@pytest.mark.parametrize("one_batch", [False, True], ids=["batches", "one-batch"])
async def test_a_put_after_the_entry_ended_starts_a_new_life(
    engine: sa.Engine, state: EntryState, one_batch: bool
) -> None:
    events = [put(ALICE, "r1", 0), gone(state, 3), put(BOB, "r2", 5)]
    await write(engine, events, one_batch=one_batch)
    row = entry(engine)
    assert row.state is EntryState.LIVE
    assert (row.owner, row.scope_user, row.created_request_id) == (BOB, BOB, "r2")
    assert row.created_at == T0 + timedelta(seconds=5)
    assert (row.tiers, row.key_version) == (["memory"], 5)


async def test_a_reput_across_batches_after_a_new_life_in_one_batch(engine: sa.Engine) -> None:
    # the row exists (live, Alice); one batch ends it and Bob re-creates it, then Alice re-puts
    await write(engine, [put(ALICE, "r1", 0)], one_batch=True)
    await write(engine, [gone(EntryState.DELETED, 1), put(BOB, "r2", 2)], one_batch=True)
    await write(engine, [put(ALICE, "r3", 4)], one_batch=True)
    row = entry(engine)
    assert (row.owner, row.created_request_id, row.created_at) == (
        BOB,
        "r2",
        T0 + timedelta(seconds=2),
    )
    assert row.key_version == 4


async def test_provenance_reports_the_true_creator(engine: sa.Engine) -> None:
    # Alice creates the chunk; Bob's request recomputes and re-puts it while it is live; a
    # third request is served it. The chunk is Alice's, created in r1.
    events = [put(ALICE, "r1", 0), put(BOB, "r2", 5), get(BOB, "r3", 6)]
    await write(engine, events, one_batch=False)
    with make_sessionmaker(engine)() as session:
        [row] = provenance(session, "r3", "acme")
        assert row.entry is not None
        assert (row.entry.owner, row.entry.created_request_id) == (ALICE, "r1")
        reuse = user_reuse(session, "acme", ALICE)
        assert [(e.reused_by, e.created_request_id) for e in reuse.entries] == [(("r3",), "r1")]
        assert [(r.request_id, r.chunks) for r in reuse.requests] == [("r3", 1)]
        assert served_to(session, [e.key_digest for e in reuse.entries]) == {
            reuse.entries[0].key_digest: ["r3"]
        }
        bob = user_reuse(session, "acme", BOB)
        assert (bob.entries, bob.requests) == ((), ())


async def test_a_user_who_re_put_an_entry_sees_it_in_every_user_view(engine: sa.Engine) -> None:
    """Purge scope, the footprint and the entry filter share one definition of "the user's
    entries": after a re-put keeps the first owner, the re-putting user still finds it."""
    from sqlalchemy.orm import Session

    from kvgov.ledger.queries_api import footprint_summary, list_entries
    from kvgov.ledger.repository import LedgerRepository

    await write(engine, [put(ALICE, "r1", 0), put(BOB, "r2", 5)], one_batch=False)
    carol = "c" * 32
    with Session(engine) as session:
        repo = LedgerRepository(session)
        for who in (ALICE, BOB):
            assert [e.key_digest for e in repo.entries(user=who, tenant="acme")] == [DIGEST]
            listed = list_entries(session, tenant="acme", user=who)
            assert [e.key_digest for e in listed] == [DIGEST]
            assert footprint_summary(session, "acme", who).entries_by_state == {"live": 1}
        assert repo.entries(user=carol, tenant="acme") == []
        assert repo.entries(user=BOB, tenant="globex") == []
        assert footprint_summary(session, "acme", carol).entries_by_state == {}

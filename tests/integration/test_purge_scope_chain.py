"""Purge scope stands on the chained put events (review r10, F3 and F4), on SQLite and Postgres.

One definition of "the user's entries" (``kvgov.ledger.repository.user_entries``) serves purge
scope (and its dry-run plan), the footprint and the entry filters: it counts a re-put
(``kv:put:kept``) and does not trust the row's mutable ``tenant``. A digest a chained put names
that no row has is still in scope (deleted from the tiers, evicted). ``cache_entries`` keeps a
row's key digest and tenant (migration 0011's trigger; the writer only fills an empty tenant).
Real writer batches, real databases.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import sqlalchemy as sa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy.orm import Session

from kvgov.db.engine import make_engine, upgrade, utcnow
from kvgov.db.models import CacheEntry
from kvgov.ledger.events import EntryChange, Event
from kvgov.ledger.queries_api import footprint_summary, list_entries
from kvgov.ledger.repository import LedgerRepository
from kvgov.ledger.verify import verify
from kvgov.ledger.writer import LedgerWriter
from kvgov.services.purge.scope import scoped_entries
from kvgov.types import EntryState, EventKind, Outcome, Scope

pytestmark = pytest.mark.postgres

ALICE, BOB = "a" * 32, "b" * 32
#: bob created it, alice re-put it (kv:put:kept)
KEPT = "1" * 64
#: alice put it; its row was inserted first under another tenant (the runtime role may INSERT)
PLANTED = "2" * 64
#: alice put it; no row has the digest (a row re-keyed before migration 0011)
ROWLESS = "3" * 64
#: bob's, which alice only read
READ = "4" * 64


@pytest.fixture
async def engine(db_url: str) -> AsyncIterator[sa.Engine]:
    upgrade(db_url)
    eng = make_engine(db_url)
    yield eng
    eng.dispose()


def _put(who: str, digest: str, *, entry: bool = True) -> Event:
    return Event(
        kind=EventKind.KV_PUT,
        tenant="acme",
        actor=who,
        key_digest=digest,
        outcome=Outcome.OK,
        entry=EntryChange(
            key_digest=digest,
            state=EntryState.LIVE,
            tenant="acme",
            owner=who,
            scope=Scope.TENANT,
            size=100,
            tiers=("memory",),
        )
        if entry
        else None,
    )


def _kept(who: str, digest: str) -> Event:
    """What the data plane records for a put of a live key (``Pipeline._kept``): no entry."""
    return Event(
        kind=EventKind.KV_PUT_KEPT,
        tenant="acme",
        actor=who,
        key_digest=digest,
        outcome=Outcome.OK,
        reason="live",
    )


KEY = Ed25519PrivateKey.generate()


async def _write(engine: sa.Engine, events: list[Event]) -> None:
    writer = LedgerWriter(engine, chain_id="node-a", signing_key=KEY)
    await writer.start()
    try:
        for event in events:
            await writer.append(event)
    finally:
        await writer.close()


def _plant(engine: sa.Engine, digest: str, tenant: str | None) -> None:
    """A row inserted ahead of the put, under ``tenant`` (what the runtime role can INSERT)."""
    now = utcnow()
    with engine.begin() as conn:
        conn.execute(
            sa.insert(CacheEntry.__table__).values(
                key_digest=digest,
                tenant=tenant,
                owner="m" * 32,
                tiers=[],
                state=EntryState.LIVE,
                created_at=now,
                updated_at=now,
            )
        )


async def _seed(engine: sa.Engine) -> None:
    _plant(engine, PLANTED, "elsewhere")
    await _write(
        engine,
        [
            _put(BOB, KEPT),
            _kept(ALICE, KEPT),
            _put(ALICE, PLANTED),
            _put(ALICE, ROWLESS, entry=False),
            _put(BOB, READ),
            Event(kind=EventKind.KV_GET, tenant="acme", actor=ALICE, key_digest=READ),
        ],
    )
    assert verify(engine).ok


async def test_user_scope_counts_kept_re_puts_and_ignores_the_rows_tenant(
    engine: sa.Engine,
) -> None:
    await _seed(engine)
    with Session(engine) as s:
        # on SQLite the writer fills nothing over the planted row's tenant; on Postgres (where
        # another role could plant it) alice's put claims it: no chained event names the row
        # with its tenant (migration 0012, tests/security/test_entry_squatting.py)
        planted = s.get(CacheEntry, PLANTED)
        claimed = engine.dialect.name == "postgresql"
        assert planted is not None
        assert (planted.tenant, planted.owner) == (
            ("acme", ALICE) if claimed else ("elsewhere", "m" * 32)
        )
        scope = {e.key_digest: e.state for e in scoped_entries(s, "acme", ALICE)}
        assert scope == {KEPT: EntryState.LIVE, PLANTED: EntryState.LIVE, ROWLESS: None}
        # the other views of "alice's entries" agree (rows only: the footprint counts rows)
        rows = {KEPT, PLANTED}
        listed = list_entries(s, tenant="acme", user=ALICE)
        assert {e.key_digest for e in listed} == rows
        repo = LedgerRepository(s)
        assert {e.key_digest for e in repo.entries(user=ALICE, tenant="acme")} == rows
        assert footprint_summary(s, "acme", ALICE).entries_by_state == {"live": 2}
        # bob's: what he created (alice's re-put keeps him as owner) and what he put
        assert {e.key_digest for e in scoped_entries(s, "acme", BOB)} == {KEPT, READ}
        # another tenant's user with the same pseudonym spelling is another subject
        assert scoped_entries(s, "globex", ALICE) == []


async def test_tenant_scope_covers_its_chained_puts_whatever_the_rows_say(
    engine: sa.Engine,
) -> None:
    await _seed(engine)
    with Session(engine) as s:
        scope = {e.key_digest: e.state for e in scoped_entries(s, "acme", None)}
        assert scope == {
            KEPT: EntryState.LIVE,
            PLANTED: EntryState.LIVE,
            ROWLESS: None,
            READ: EntryState.LIVE,
        }
        # the planted row's own tenant sees it too (scope errs on deleting more), unless the
        # put claimed the row (Postgres)
        planted = [] if engine.dialect.name == "postgresql" else [PLANTED]
        assert [e.key_digest for e in scoped_entries(s, "elsewhere", None)] == planted


async def test_a_rows_tenant_and_key_digest_never_change(engine: sa.Engine) -> None:
    """Migration 0011's trigger, on both dialects: a change is refused (the owner's statements
    here; on Postgres the runtime role's too, ``tests/security/test_db_privileges.py``); an
    empty tenant may be filled, by the writer's upsert (which names ``tenant``) as before."""
    await _seed(engine)
    for statement in (
        "UPDATE cache_entries SET tenant = 'elsewhere' WHERE key_digest = :d",
        "UPDATE cache_entries SET tenant = NULL WHERE key_digest = :d",
        "UPDATE cache_entries SET key_digest = '5' || substr(key_digest, 2) WHERE key_digest = :d",
    ):
        with pytest.raises(sa.exc.DBAPIError, match="never change"), engine.begin() as conn:
            conn.execute(sa.text(statement), {"d": READ})
    with engine.begin() as conn:  # naming the column with the value it has is no change
        same = "UPDATE cache_entries SET tenant = 'acme', state = 'live' WHERE key_digest = :d"
        assert conn.execute(sa.text(same), {"d": READ}).rowcount == 1
    unknown = "6" * 64
    _plant(engine, unknown, None)  # e.g. an evict recorded before any put, with no tenant
    await _write(engine, [_put(ALICE, unknown)])
    with Session(engine) as s:
        filled = s.get(CacheEntry, unknown)
        assert filled is not None and filled.tenant == "acme"
        assert s.get(CacheEntry, READ) is not None

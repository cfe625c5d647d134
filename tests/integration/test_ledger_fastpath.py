"""The Postgres small-batch path (one round trip: lock, head check, rows and index upserts).

It must store exactly what the general path (COPY, then the index upserts) stores, and a batch
chained on a head that is no longer the chain's must write nothing on it: the attempt is rolled
back and the batch re-chained, with no row lost or duplicated.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy as sa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kvgov.db.engine import make_engine, upgrade
from kvgov.db.models import Chain, table
from kvgov.ledger import batch as batch_mod
from kvgov.ledger.batch import Head, apply_batch, chain_rows, prepare
from kvgov.ledger.chain import GENESIS_HASH
from kvgov.ledger.events import EntryChange, Event
from kvgov.ledger.verify import verify
from kvgov.ledger.writer import LedgerWriter
from kvgov.types import EntryState, EventKind, Outcome, Scope, Sensitivity
from tests.conftest import create_pg_database, drop_pg_database

pytestmark = pytest.mark.postgres

CHAIN = "fast-1"
T0 = datetime(2025, 3, 1, 12, 0, 0, 123456, tzinfo=UTC)
IST = timezone(timedelta(hours=5, minutes=30))


@pytest.fixture
def engines() -> Iterator[tuple[sa.Engine, sa.Engine]]:
    """Two fresh databases: one written by the small-batch path, one by the general path."""
    made = [create_pg_database(), create_pg_database()]
    engines = []
    for _, url in made:
        upgrade(url)
        engines.append(make_engine(url))
    try:
        yield engines[0], engines[1]
    finally:
        for engine in engines:
            engine.dispose()
        for name, _ in made:
            drop_pg_database(name)


def _register(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        conn.execute(
            table(Chain).insert().values(chain_id=CHAIN, public_key=b"k" * 32, created_at=T0)
        )


def _put(i: int, at: datetime, **entry: Any) -> Event:
    key = f"{i:064x}"
    return Event(
        kind=EventKind.KV_PUT,
        tenant="t1",
        actor=f"{i % 3:032x}",
        request_id=f"req-{i // 4}",
        key_digest=key,
        tier="memory",
        nbytes=1 << 20,
        outcome=Outcome.OK,
        principal="engine-1",
        attrs={"model": "m-é", "chunk": i, "nested": {"a": [1, None, "ü"]}},
        entry=EntryChange(
            key_digest=key,
            state=EntryState.LIVE,
            tenant="t1",
            owner=f"{i % 3:032x}",
            tiers=("memory", "disk"),
            size=1 << 20,
            **entry,
        ),
        occurred_at=at,
    )


def _batches() -> list[list[Event]]:
    """Small batches covering what the index upserts fold: new entries, re-puts of live
    entries (keep their life), an ended entry put again (new life), a policy decision, NULLs,
    non-ASCII text, a non-UTC timestamp, and batches the small path must leave to COPY (an
    escaped character, a payload)."""
    at = [T0 + timedelta(milliseconds=i) for i in range(100)]
    first = [_put(i, at[i], scope=Scope.USER, scope_user=f"{9:032x}") for i in range(6)]
    decision = Event(
        kind=EventKind.POLICY_DECISION,
        tenant="t1",
        decision_id="dec-1",
        policy_revision="rev-1",
        attrs={
            "decision_id": "dec-1",
            "allowed": True,
            "reasons": ["ok"],
            "tiers": ["memory"],
            "ttl_s": 60,
            "operation": "put",
        },
        occurred_at=at[10].astimezone(IST),
    )
    second = [
        decision,
        # re-puts of live entries: new tiers and size, same life
        _put(0, at[11], sensitivity=Sensitivity.INTERNAL, model="m", key_id="k", key_version=2),
        _put(1, at[12], expires_at=at[50]),
        Event(kind=EventKind.KV_GET, tenant="t1", actor=f"{1:032x}", occurred_at=at[13]),
        Event(
            kind=EventKind.KV_DELETE,
            tenant="t1",
            key_digest=f"{2:064x}",
            entry=EntryChange(key_digest=f"{2:064x}", state=EntryState.DELETED),
            occurred_at=at[14],
        ),
    ]
    third = [_put(2, at[20]), _put(7, at[21])]  # the deleted entry's new life; a new one
    escaped = [
        _put(8, at[30]),
        Event(kind=EventKind.API_ACCESS, reason="a\\b\tc", occurred_at=at[31]),
    ]
    payload = [Event(kind=EventKind.PURGE_REQUESTED, payload={"who": "x"}, occurred_at=at[40])]
    return [first, second, third, escaped, payload, [_put(3, at[41])]]


def _write(engine: sa.Engine, batches: list[list[Event]]) -> Head:
    head: Head = (0, GENESIS_HASH)
    for events in batches:
        prepared = [prepare(e) for e in events]
        lines: list[str] = []
        rows, new_head = chain_rows(CHAIN, head, prepared, lines)
        lines.append("")
        with engine.begin() as conn:
            applied = apply_batch(
                conn, CHAIN, prepared, chained=(head, rows), copy="\n".join(lines)
            )
        assert applied.head == new_head
        assert not applied.rechained
        head = new_head
    return head


def _dump(engine: sa.Engine) -> dict[str, list[tuple[Any, ...]]]:
    queries = {
        "ledger_events": "SELECT *, attrs::text FROM ledger_events ORDER BY chain_id, seq",
        "event_payloads": "SELECT chain_id, seq, payload::text FROM event_payloads ORDER BY seq",
        "cache_entries": "SELECT *, tiers::text FROM cache_entries ORDER BY key_digest",
        "requests": "SELECT * FROM requests ORDER BY request_id",
        "user_refs": "SELECT * FROM user_refs ORDER BY pseudonym",
        "policy_decisions": "SELECT * FROM policy_decisions ORDER BY decision_id",
    }
    with engine.connect() as conn:
        return {
            name: [tuple(r) for r in conn.execute(sa.text(sql))] for name, sql in queries.items()
        }


def _spy_small_path(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Record what each call of the small-batch path returned (True: it wrote the batch)."""
    calls: list[bool] = []
    real = batch_mod.write_small_batch

    def spy(*args: Any, **kwargs: Any) -> bool:
        calls.append(real(*args, **kwargs))
        return calls[-1]

    monkeypatch.setattr(batch_mod, "write_small_batch", spy)
    return calls


def test_small_batches_store_what_the_general_path_stores(
    engines: tuple[sa.Engine, sa.Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    fast, general = engines
    calls = _spy_small_path(monkeypatch)
    # the same payload salt on both sides, so that both chains hash alike
    monkeypatch.setattr(batch_mod.os, "urandom", lambda n: b"s" * n)
    _register(fast)
    head = _write(fast, _batches())
    # every batch took the small path but the escaped one and the one with a payload
    assert calls == [True, True, True, True]

    monkeypatch.setattr(batch_mod, "SMALL_BATCH_MAX", 0)
    _register(general)
    assert _write(general, _batches()) == head
    assert len(calls) == 4

    got, want = _dump(fast), _dump(general)
    assert got == want
    assert len(got["ledger_events"]) == 17
    # the re-put kept the entry's life, the deleted entry started a new one
    entries = {r[0]: r for r in got["cache_entries"]}
    assert entries[f"{0:064x}"][13] == T0  # created_at of the first put
    assert entries[f"{2:064x}"][13] == T0 + timedelta(milliseconds=20)
    assert got["policy_decisions"][0][4] is True
    for engine in engines:
        assert verify(engine).ok


def test_a_stale_expected_head_is_rolled_back_and_rechained(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer's sequencer chains on the head it expects; something else appends to the
    chain meanwhile. The small path must refuse the stale rows (writing nothing, index rows
    included), and the batch land once, re-chained after the other rows."""
    upgrade(pg_url)
    engine = make_engine(pg_url)
    calls = _spy_small_path(monkeypatch)

    async def scenario() -> None:
        writer = LedgerWriter(engine, chain_id=CHAIN, signing_key=Ed25519PrivateKey.generate())
        await writer.start()
        await asyncio.gather(*(writer.submit(_put(i, T0)) for i in range(3)))
        assert calls and all(calls)
        # another writer's rows on the same chain, behind this writer's back
        with engine.begin() as conn:
            other = [prepare(_put(i, T0 + timedelta(seconds=1))) for i in range(10, 13)]
            apply_batch(conn, CHAIN, other)
        calls.clear()
        done = await asyncio.gather(*(writer.submit(_put(i, T0)) for i in range(20, 24)))
        assert calls == [False]  # the small path tried, found the head moved, wrote nothing
        assert [a.seq for a in done] == [7, 8, 9, 10]
        calls.clear()
        more = await writer.append(_put(30, T0))  # the sequencer follows the real head again
        assert calls == [True]
        assert more.seq == 11
        await writer.close()

    try:
        asyncio.run(scenario())
        with engine.connect() as conn:
            seqs = conn.execute(
                sa.text("SELECT seq FROM ledger_events WHERE chain_id = :c ORDER BY seq"),
                {"c": CHAIN},
            ).scalars()
            assert list(seqs) == list(range(1, 12))
            keys = conn.execute(sa.text("SELECT count(*) FROM cache_entries")).scalar_one()
            assert keys == 3 + 3 + 4 + 1
        report = verify(engine)
        assert report.ok
        assert sum(c.events for c in report.chains) == 11
    finally:
        engine.dispose()


def test_a_refused_event_in_a_small_batch_fails_alone(pg_url: str) -> None:
    """A value the database refuses fails the small path's statement; the general path then
    meets it too and the writer isolates it: the other events are written."""
    upgrade(pg_url)
    engine = make_engine(pg_url)

    async def scenario() -> list[Any]:
        writer = LedgerWriter(engine, chain_id=CHAIN, signing_key=Ed25519PrivateKey.generate())
        await writer.start()
        bad = _put(1, T0, model="m" * 300)  # cache_entries.model is varchar(256)
        futures = [writer.submit(e) for e in (_put(0, T0), bad, _put(2, T0))]
        out = await asyncio.gather(*futures, return_exceptions=True)
        await writer.close()
        return out

    try:
        out = asyncio.run(scenario())
        assert [type(o).__name__ for o in out] == ["Appended", "LedgerError", "Appended"]
        report = verify(engine)
        assert report.ok
        assert sum(c.events for c in report.chains) == 2
    finally:
        engine.dispose()

"""The batched writer against real databases: indexes, backpressure, refusals, restart,
concurrent chains, payload erasure, and that no raw user id reaches any column."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy.orm import Session

from kvgov.db.engine import make_engine, make_sessionmaker, upgrade
from kvgov.db.keystore import SqlKeyStore
from kvgov.db.models import CacheEntry, EventPayload, PolicyDecision, Request, UserRef
from kvgov.errors import LedgerBackpressureError, LedgerError
from kvgov.ledger.events import Appended, EntryChange, Event
from kvgov.ledger.pseudonym import Pseudonymizer
from kvgov.ledger.repository import LedgerRepository
from kvgov.ledger.verify import verify
from kvgov.ledger.writer import LedgerWriter
from kvgov.types import (
    EntryState,
    EventKind,
    KeyState,
    Outcome,
    Scope,
    Sensitivity,
    WrappedKey,
)

pytestmark = pytest.mark.postgres

KEY = Ed25519PrivateKey.generate()


@pytest.fixture
async def engine(db_url: str) -> AsyncIterator[sa.Engine]:
    upgrade(db_url)
    eng = make_engine(db_url)
    yield eng
    eng.dispose()


async def started(engine: sa.Engine, chain_id: str = "node-a", **kw: object) -> LedgerWriter:
    writer = LedgerWriter(engine, chain_id=chain_id, signing_key=KEY, **kw)  # type: ignore[arg-type]
    await writer.start()
    return writer


async def test_events_are_chained_and_indexes_follow(engine: sa.Engine) -> None:
    writer = await started(engine)
    t0 = datetime.now(UTC)
    owner, reader = "a" * 32, "b" * 32
    put = Event(
        kind=EventKind.KV_PUT,
        tenant="acme",
        actor=owner,
        request_id="req-1",
        key_digest="k" * 64,
        tier="memory",
        nbytes=4096,
        outcome=Outcome.OK,
        decision_id="dec-1",
        policy_revision="rev-1",
        principal="engine-1",
        occurred_at=t0,
        entry=EntryChange(
            key_digest="k" * 64,
            state=EntryState.LIVE,
            tenant="acme",
            owner=owner,
            scope_user=owner,
            scope=Scope.USER,
            sensitivity=Sensitivity.PHI,
            model="llama-3",
            size=4096,
            tiers=("memory", "filesystem"),
            key_id="u:acme:" + owner,
            key_version=1,
            expires_at=t0 + timedelta(hours=1),
            request_id="req-1",
            decision_id="dec-1",
            policy_revision="rev-1",
        ),
    )
    decision = Event(
        kind=EventKind.POLICY_DECISION,
        tenant="acme",
        actor=owner,
        request_id="req-1",
        decision_id="dec-1",
        occurred_at=t0,
        attrs={
            "decision_id": "dec-1",
            "policy_revision": "rev-1",
            "data_revision": "data-3",
            "input_digest": "i" * 64,
            "allowed": True,
            "reasons": [],
            "tiers": ["memory", "filesystem"],
            "ttl_s": 3600,
            "scope": "user",
            "operation": "put",
        },
    )
    get = Event(
        kind=EventKind.KV_GET,
        tenant="acme",
        actor=reader,
        request_id="req-2",
        key_digest="k" * 64,
        nbytes=4096,
        outcome=Outcome.HIT,
        occurred_at=t0 + timedelta(seconds=1),
    )
    evict = Event(
        kind=EventKind.KV_EVICT,
        tenant="acme",
        key_digest="k" * 64,
        tier="memory",
        request_id="req-1",
        occurred_at=t0 + timedelta(seconds=2),
        entry=EntryChange(key_digest="k" * 64, state=EntryState.DELETED, tiers=("filesystem",)),
    )
    results = await asyncio.gather(*(writer.submit(e) for e in (decision, put, get)))
    assert results == [Appended("node-a", 1), Appended("node-a", 2), Appended("node-a", 3)]
    assert await writer.append(evict) == Appended("node-a", 4)
    await writer.close()
    assert writer.stats.events_written == 4

    with make_sessionmaker(engine)() as session:
        entry = session.get(CacheEntry, "k" * 64)
        assert entry is not None
        assert entry.state is EntryState.DELETED
        assert entry.tiers == ["filesystem"]  # changed by the evict
        assert (entry.owner, entry.scope, entry.sensitivity) == (owner, Scope.USER, Sensitivity.PHI)
        assert entry.size == 4096 and entry.key_version == 1  # kept from the put
        assert entry.created_at == t0 and entry.updated_at == t0 + timedelta(seconds=2)
        assert entry.expires_at == t0 + timedelta(hours=1)
        assert entry.created_request_id == "req-1"
        req = session.get(Request, ("req-1", "acme"))  # a request is an id in a tenant
        assert req is not None
        assert (req.first_seen_at, req.last_seen_at) == (t0, t0 + timedelta(seconds=2))
        assert (req.tenant, req.actor, req.principal) == ("acme", owner, "engine-1")
        users = {u.pseudonym: u.tenant for u in session.scalars(sa.select(UserRef))}
        assert users == {owner: "acme", reader: "acme"}
        dec = session.get(PolicyDecision, "dec-1")
        assert dec is not None
        assert (dec.allowed, dec.ttl_s, dec.data_revision, dec.seq) == (True, 3600, "data-3", 1)
        assert dec.tiers == ["memory", "filesystem"]

        repo = LedgerRepository(session)
        assert [e.seq for e in repo.events_for_request("req-1")] == [1, 2, 4]
        assert [e.kind for e in repo.events_for_key("k" * 64)] == ["kv:put", "kv:get", "kv:evict"]
        assert [e.key_digest for e in repo.entries(user=owner)] == ["k" * 64]
        assert repo.entries(user=owner, states=[EntryState.LIVE]) == []
        assert repo.entries(tenant="other") == []
        heads = repo.chain_heads()
        assert [(h.chain_id, h.seq, h.checkpoint_seq) for h in heads] == [("node-a", 4, None)]
        assert repo.decision("dec-1") is not None
    assert verify(engine).ok


async def test_restart_resumes_the_chain(engine: sa.Engine) -> None:
    writer = await started(engine)
    for _ in range(3):
        await writer.append(Event(kind=EventKind.SIDECAR_STARTED))
    await writer.close()
    again = await started(engine)
    assert again.head_seq == 3
    assert await again.append(Event(kind=EventKind.SIDECAR_STOPPED)) == Appended("node-a", 4)
    assert await again.write_checkpoint() is not None
    assert await again.write_checkpoint() is None  # head already signed
    await again.close()
    report = verify(engine)
    assert report.ok and report.chains[0].events == 4 and report.chains[0].checkpoints == 1


async def test_a_chain_keeps_its_key(engine: sa.Engine) -> None:
    await (await started(engine)).close()
    other = LedgerWriter(engine, chain_id="node-a", signing_key=Ed25519PrivateKey.generate())
    with pytest.raises(LedgerError, match="another signing key"):
        await other.start()


async def test_backpressure_raises_on_submit_and_waits_in_append(engine: sa.Engine) -> None:
    writer = LedgerWriter(engine, chain_id="node-a", signing_key=KEY, queue_max_events=5)
    futures = [writer.submit(Event(kind=EventKind.KV_MISS)) for _ in range(5)]
    with pytest.raises(LedgerBackpressureError):
        writer.submit(Event(kind=EventKind.KV_MISS))
    assert writer.stats.backpressure_rejections == 1
    assert writer.queue_depth == 5
    await writer.start()
    waiting = [writer.append(Event(kind=EventKind.KV_MISS)) for _ in range(20)]
    appended = await asyncio.gather(*futures, *waiting)
    assert sorted(a.seq for a in appended) == list(range(1, 26))
    await writer.flush()
    assert writer.queue_depth == 0
    await writer.close()
    with pytest.raises(LedgerError):
        writer.submit(Event(kind=EventKind.KV_MISS))
    assert verify(engine).ok


async def test_refused_events_fail_alone_and_are_never_acknowledged(
    engine: sa.Engine, db_url: str
) -> None:
    writer = await started(engine)
    good = [writer.submit(Event(kind=EventKind.KV_MISS, nbytes=i)) for i in range(3)]
    bad = [writer.submit(Event(kind=EventKind.KV_MISS, reason="nul\x00byte"))]
    bad.append(writer.submit(Event(kind=EventKind.KV_MISS, attrs={"x": float("inf")})))
    if db_url.startswith("postgresql"):  # SQLite does not enforce VARCHAR lengths
        bad.append(writer.submit(Event(kind=EventKind.KV_MISS, tenant="t" * 500)))
    good.append(writer.submit(Event(kind=EventKind.KV_MISS, nbytes=99)))
    results = await asyncio.gather(*good, *bad, return_exceptions=True)
    ok, failed = results[: len(good)], results[len(good) :]
    assert all(isinstance(r, Appended) for r in ok), ok
    assert all(isinstance(r, LedgerError) for r in failed)
    await writer.close()
    report = verify(engine)
    assert report.ok
    assert report.chains[0].events == len(good)
    assert writer.stats.events_failed == len(bad)


async def test_two_writers_on_one_database_make_two_verifying_chains(engine: sa.Engine) -> None:
    a = await started(engine, "sidecar-a", batch_max_events=50)
    b = LedgerWriter(
        engine, chain_id="sidecar-b", signing_key=Ed25519PrivateKey.generate(), batch_max_events=50
    )
    await b.start()

    async def load(writer: LedgerWriter, n: int) -> list[Appended]:
        out = []
        for i in range(n // 100):
            batch = [
                writer.submit(Event(kind=EventKind.KV_PUT, tenant="acme", request_id=f"r{i}"))
                for _ in range(100)
            ]
            out += await asyncio.gather(*batch)
        return out

    ra, rb = await asyncio.gather(load(a, 1500), load(b, 1500))
    assert [x.seq for x in ra] == list(range(1, 1501))
    assert [x.seq for x in rb] == list(range(1, 1501))
    assert a.stats.batches_committed > 1 and b.stats.batches_committed > 1
    await a.write_checkpoint()
    await b.write_checkpoint()
    await asyncio.gather(a.close(), b.close())
    report = verify(engine)
    assert report.ok
    assert {(c.chain_id, c.events, c.checkpoints) for c in report.chains} == {
        ("sidecar-a", 1500, 1),
        ("sidecar-b", 1500, 1),
    }


async def test_payload_erasure_keeps_the_chain_verifying(engine: sa.Engine) -> None:
    writer = await started(engine)
    alice, bob = "a" * 32, "b" * 32
    for who in (alice, bob, alice):
        await writer.append(
            Event(
                kind=EventKind.KV_PUT,
                tenant="acme",
                actor=who,
                payload={"prompt_excerpt": f"secret of {who[:4]}", "n": [1, 2.5]},
            )
        )
    await writer.write_checkpoint()
    assert verify(engine).ok
    with make_sessionmaker(engine)() as session:
        assert LedgerRepository(session).erase_payloads(tenant="acme", actor=alice) == 2
        session.commit()
    await writer.append(Event(kind=EventKind.LEDGER_PAYLOAD_ERASED, tenant="acme", actor=alice))
    await writer.close()
    with engine.connect() as conn:
        rows = conn.execute(sa.select(EventPayload).order_by(EventPayload.seq)).all()
    assert [(r.payload is None, r.salt is None, r.erased_at is not None) for r in rows] == [
        (True, True, True),
        (False, False, False),
        (True, True, True),
    ]
    assert verify(engine).ok
    # a kept payload is still protected by its chained digest
    with engine.begin() as conn:
        conn.execute(
            sa.update(EventPayload).where(EventPayload.seq == 2).values(payload={"forged": True})
        )
    report = verify(engine)
    assert not report.ok
    first = report.chains[0].first_bad
    assert first is not None and (first.problem, first.seq) == ("payload_mismatch", 2)


RAW_USERS = ("alice@example.com", "bob.smith@corp.example", "user-8731")


async def test_no_raw_user_id_anywhere_after_a_realistic_workload(engine: sa.Engine) -> None:
    pseudo = Pseudonymizer(b"p" * 32)
    writer = await started(engine)
    keys = SqlKeyStore(engine)
    now = datetime.now(UTC)
    for n, user in enumerate(RAW_USERS):
        me = pseudo.user("acme", user)
        keys.add(
            WrappedKey(
                key_id=f"u:acme:{me}",
                version=1,
                tenant="acme",
                user=me,
                state=KeyState.ACTIVE,
                wrapped=b"w" * 40,
                kek_id="kek-1",
                created_at=now,
            )
        )
        for chunk in range(5):
            cache_key = f"vllm@llama@acme@user={user}@{chunk:08x}"
            digest = pseudo.key_digest(cache_key)
            request_id = f"req-{n}-{chunk}"
            entry = EntryChange(
                key_digest=digest,
                state=EntryState.LIVE,
                tenant="acme",
                owner=me,
                scope_user=me,
                scope=Scope.USER,
                tiers=("memory",),
                key_id=f"u:acme:{me}",
                key_version=1,
            )
            await writer.append(
                Event(
                    kind=EventKind.POLICY_DECISION,
                    tenant="acme",
                    actor=me,
                    request_id=request_id,
                    attrs={"decision_id": f"d-{n}-{chunk}", "allowed": True, "tiers": ["memory"]},
                )
            )
            await writer.append(
                Event(
                    kind=EventKind.KV_PUT,
                    tenant="acme",
                    actor=me,
                    request_id=request_id,
                    key_digest=digest,
                    tier="memory",
                    nbytes=1 << 20,
                    outcome=Outcome.OK,
                    principal="engine-1",
                    attrs={"model": "llama", "chunk": chunk},
                    payload={"excerpt": "the prompt text lives here, erasable"},
                    entry=entry,
                )
            )
            await writer.append(
                Event(
                    kind=EventKind.KV_GET,
                    tenant="acme",
                    actor=me,
                    request_id=request_id,
                    key_digest=digest,
                    outcome=Outcome.HIT,
                )
            )
    keys.destroy("acme", pseudo.user("acme", RAW_USERS[0]))
    await writer.write_checkpoint()
    await writer.close()

    inspector = sa.inspect(engine)
    seen = 0
    with engine.connect() as conn:
        for name in inspector.get_table_names():
            for row in conn.execute(sa.text(f"SELECT * FROM {name}")):
                for value in row:
                    text = _as_text(value)
                    seen += 1
                    for user in RAW_USERS:
                        assert user not in text, f"raw user id in {name}"
                        assert user.split("@")[0] not in text, f"user name in {name}"
    assert seen > 1000
    assert verify(engine).ok


def _as_text(value: object) -> str:
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).decode("latin-1")
    if isinstance(value, dict | list):
        return json.dumps(value)
    return str(value)


async def test_sessions_see_committed_events(engine: sa.Engine) -> None:
    writer = await started(engine)
    await writer.append(Event(kind=EventKind.ENGINE_CONNECTED, principal="engine-7"))
    with Session(engine) as session:  # another connection sees it once acknowledged
        heads = LedgerRepository(session).chain_heads()
        assert [(h.chain_id, h.seq) for h in heads] == [("node-a", 1)]
    await writer.close()


async def test_refusals_inside_a_busy_stream_keep_the_chain_whole(
    engine: sa.Engine, db_url: str
) -> None:
    """Batches are chained ahead of the commit; a refused event makes the committer re-chain
    and the sequencer follow, without gaps or forks."""
    writer = await started(engine, batch_max_events=300)
    postgres = db_url.startswith("postgresql")

    def event(i: int) -> Event:
        if i % 701 == 700:  # refused by the database (Postgres) or by prepare (NUL)
            return Event(kind=EventKind.KV_MISS, tenant="t" * 500 if postgres else "nul\x00")
        return Event(kind=EventKind.KV_MISS, nbytes=i, request_id=f"r{i % 37}")

    results = await asyncio.gather(
        *(writer.submit(event(i)) for i in range(4000)), return_exceptions=True
    )
    await writer.close()
    good = [r for r in results if isinstance(r, Appended)]
    refused = [r for r in results if isinstance(r, LedgerError)]
    assert len(refused) == 5 and len(good) == 3995
    assert sorted(a.seq for a in good) == list(range(1, 3996))
    report = verify(engine)
    assert report.ok and report.chains[0].events == 3995


async def test_two_writers_sharing_one_chain_id_keep_it_whole(engine: sa.Engine) -> None:
    """A CLI command appending with the sidecar's chain id while the sidecar writes: the chain
    lock and the head check make them take turns instead of forking the chain."""
    sidecar = await started(engine, batch_max_events=100)
    cli = await started(engine, batch_max_events=100)

    async def load(writer: LedgerWriter, tag: str) -> list[Appended]:
        out: list[Appended] = []
        for _ in range(10):
            batch = [writer.submit(Event(kind=EventKind.KV_MISS, reason=tag)) for _ in range(50)]
            out += await asyncio.gather(*batch)
        return out

    a, b = await asyncio.gather(load(sidecar, "sidecar"), load(cli, "cli"))
    await asyncio.gather(sidecar.close(), cli.close())
    assert sorted(x.seq for x in a + b) == list(range(1, 1001))
    report = verify(engine)
    assert report.ok and [c.events for c in report.chains] == [1000]


async def test_text_that_copy_must_escape_round_trips(engine: sa.Engine) -> None:
    """Backslashes, tabs, newlines and carriage returns in any text column or in attrs (the
    COPY text format escapes them on Postgres), unicode, empty strings and NULLs read back
    exactly and the chain verifies."""
    writer = await started(engine)
    tricky = "tab\there, nl\nthere, cr\rand \\N and \\\\ and \\. and ünïcødé 😀"
    events = [
        Event(
            kind=EventKind.KV_DENIED,
            tenant=tricky,
            actor="",
            request_id="r\\1",
            key_digest="k\t1",
            tier=None,
            reason=tricky,
            principal="\\.",
            nbytes=None,
            attrs={"why": tricky, "nested": {"list": [tricky, 1, 2.5, None, True]}},
        ),
        Event(kind=EventKind.KV_GET, tenant="plain", reason="\\N", attrs={"a": "\\N"}),
    ]
    for event in events:
        await writer.append(event)
    await writer.close()
    with make_sessionmaker(engine)() as session:
        rows = LedgerRepository(session).events_for_request("r\\1")
        assert len(rows) == 1
        row = rows[0]
        assert (row.tenant, row.actor, row.key_digest, row.tier) == (tricky, "", "k\t1", None)
        assert (row.reason, row.principal, row.nbytes) == (tricky, "\\.", None)
        assert row.attrs == {"why": tricky, "nested": {"list": [tricky, 1, 2.5, None, True]}}
        other = session.scalars(
            sa.select(sa.text("reason"))
            .select_from(sa.table("ledger_events"))
            .where(sa.text("tenant = 'plain'"))
        ).one()
        assert other == "\\N"
    assert verify(engine).ok

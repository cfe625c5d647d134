"""Attack (erasure): values a purge erased while this sidecar was down, left on its disk.

A purge's tier steps go to the sidecars alive when it is created; a sidecar that was down (a
restarting container keeps its ``emptyDir``) kept the erased user's values in its filesystem
tier. At its next start it loaded only live entries into its index, so nothing would serve,
expire or delete those files: the bytes stayed on disk for good, readable under a tenant key
that a user purge does not shred. Now a sidecar deletes, at start, every value in a local tier
that no live entry names (``upkeep.reconcile``), and records each deletion in the ledger
(``kv:delete``, reason ``orphan``, durable before it serves), so an auditor sees that erased
data lingered on a disk and when it was removed; the chain still verifies.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy import select, update
from sqlalchemy.orm import Session
from typer.testing import CliRunner

from kvgov.cli.main import build_app
from kvgov.config import Settings
from kvgov.connectors.tiers.chain import TierChain
from kvgov.connectors.tiers.filesystem import FilesystemTier
from kvgov.db.models import CacheEntry, LedgerEvent
from kvgov.ledger.chain import generate_signing_key_file
from kvgov.ledger.events import InMemoryEventSink
from kvgov.proxy.app import build_sidecar
from kvgov.proxy.dataplane import upkeep
from kvgov.proxy.dataplane.index import EntryIndex, EntryMeta
from kvgov.proxy.dataplane.records import LedgerEntry, Recorder
from kvgov.types import EntryState, EventKind, Outcome, Scope
from kvgov.wire import RequestContext, WireClient
from tests.security import doors
from tests.security.doors import key, run

pytestmark = pytest.mark.postgres

ALICE = RequestContext(request_id="r-a", tenant="acme", user="alice")
BOB = RequestContext(request_id="r-b", tenant="acme", user="bob")
TIERS = {"chain": ["filesystem"]}


def _client(port: int | None) -> WireClient:
    return WireClient(f"tcp://127.0.0.1:{port}", engine_id="x", token="tok-acme", timeout=5)


def _orphan_events(sc: Any) -> list[LedgerEvent]:
    with Session(sc.engine) as s:
        return list(
            s.scalars(
                select(LedgerEvent)
                .where(LedgerEvent.kind == EventKind.KV_DELETE, LedgerEvent.reason == "orphan")
                .order_by(LedgerEvent.seq)
            ).all()
        )


def _cli_verify(settings: Settings, *peers: Settings) -> tuple[int, dict[str, Any]]:
    """``kvgov audit verify`` as an operator runs it, pinning the sidecar's signing key (and
    those of the ``peers`` that wrote to the same ledger)."""
    env = {"KVGOV_DATABASE__URL": settings.database_url, "KVGOV_DATA_DIR": str(settings.data_dir)}
    pins = [arg for s in (settings, *peers) for arg in ("--trust-key", str(s.signing_key_path))]
    result = CliRunner().invoke(build_app(), ["audit", "verify", "--json", *pins], env=env)
    return result.exit_code, json.loads(result.stdout)


async def test_values_erased_while_the_sidecar_was_down_are_gone_at_its_next_start(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    erased, kept = key(0x61, "acme", "alice"), key(0x62, "acme", "bob")
    value = os.urandom(20_000)
    async with doors.tiered_sidecar(tmp_path, prod_db, TIERS) as sc:
        c = _client(sc.server.tcp_port)
        try:
            assert (await run(c.put, erased, value, ALICE)).ok
            assert (await run(c.put, kept, value, BOB)).ok
        finally:
            c.close()
        digest = sc.pipeline.pseudonymizer.key_digest
        gone, stays = digest(erased), digest(kept)
        fs = sc.pipeline.tiers.tier("filesystem")
        assert isinstance(fs, FilesystemTier)
        paths = {d: fs.path_of(d) for d in (gone, stays)}
        size = (await fs.info(gone) or pytest.fail("not stored")).size
        engine = sc.engine
        assert engine is not None
        url = engine.url
        assert _orphan_events(sc) == []
    assert all(p.exists() for p in paths.values())
    # while it is down, alice's entry is purged elsewhere: her rows say so, her file is here
    from kvgov.db.engine import make_engine

    db = make_engine(url.render_as_string(hide_password=False))
    try:
        with Session(db) as session, session.begin():
            session.execute(
                update(CacheEntry)
                .where(CacheEntry.key_digest == gone)
                .values(state=EntryState.PURGED)
            )
    finally:
        db.dispose()
    async with doors.tiered_sidecar(tmp_path, prod_db, TIERS) as sc:
        assert not paths[gone].exists(), "an erased value is still on this sidecar's disk"
        assert paths[stays].exists()
        # the deletion is in the ledger (durable before the sidecar served): the orphaned
        # digest and only it, on the filesystem tier, with what the ledger knew of it
        recorded = _orphan_events(sc)
        assert [e.key_digest for e in recorded] == [gone]
        (event,) = recorded
        assert event.tier == "filesystem"
        assert event.tenant == "acme"
        assert event.outcome == Outcome.OK
        assert event.nbytes == size
        assert event.principal == f"sidecar:{sc.settings.chain_id}"
        assert event.actor is None and event.request_id is None
        assert event.attrs == {"entry_state": "purged", "removed_here": True}
        row_text = json.dumps(
            {c.name: getattr(event, c.name) for c in LedgerEvent.__table__.columns}, default=str
        )
        for raw in (erased, "alice", "bob", "@user%"):
            assert raw not in row_text, f"raw {raw!r} in the ledger"
        with Session(sc.engine) as s:  # the purged row stays purged; the live one live
            states = dict(
                s.execute(
                    select(CacheEntry.key_digest, CacheEntry.state).where(
                        CacheEntry.key_digest.in_([gone, stays])
                    )
                ).all()
            )
        assert states == {gone: EntryState.PURGED, stays: EntryState.LIVE}
        c = _client(sc.server.tcp_port)
        try:  # the live entry is untouched and still served
            got = await run(c.get, kept, BOB)
            assert got is not None and got[0] == value
            assert await run(c.get, erased, ALICE) is None
        finally:
            c.close()
        settings = sc.settings
    code, report = await run(_cli_verify, settings)
    assert code == 0, report
    assert report["ok"] is True


async def test_many_orphans_are_recorded_one_each_up_to_a_cap_then_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(upkeep, "RECONCILE_CHUNK", 2)
    monkeypatch.setattr(upkeep, "RECONCILE_RECORDED_MAX", 3)
    fs = await FilesystemTier.open(tmp_path / "fs", fsync=False)
    tiers = TierChain([fs])
    try:
        digests = [f"{i:02x}" * 16 for i in range(6)]
        for d in digests:
            await fs.put(d, b"x" * 100)
        index = EntryIndex()
        live = digests[0]
        index.set(
            live,
            EntryMeta(
                tenant="acme",
                owner=None,
                scope_user=None,
                scope=Scope.TENANT,
                sensitivity=None,
                model=None,
                size=100,
                tiers=("filesystem",),
                key_id=None,
                key_version=None,
                expires_at=None,
            ),
        )
        sink = InMemoryEventSink()
        looked_up: list[str] = []

        def lookup(batch: Any) -> dict[str, LedgerEntry]:
            looked_up.extend(batch)
            return {digests[1]: LedgerEntry("acme", EntryState.DELETED)}

        removed = await upkeep.reconcile(
            index, tiers, Recorder(sink), lookup=lookup, principal="sidecar:t"
        )
        assert removed == {"filesystem": 5}
        assert [d async for d in fs.iter_keys()] == [live]
        listed = [e for e in sink.events if e.key_digest is not None]
        assert len(listed) == 3 and {e.key_digest for e in listed} <= set(digests[1:])
        assert sorted(looked_up) == sorted(e.key_digest for e in listed)
        assert all(e.kind is EventKind.KV_DELETE and e.reason == "orphan" for e in sink.events)
        assert all(e.tier == "filesystem" and e.entry is None for e in sink.events)
        known = {e.key_digest: (e.tenant, e.attrs["entry_state"]) for e in listed}
        for d, got in known.items():
            assert got == (("acme", "deleted") if d == digests[1] else (None, None))
        (summary,) = [e for e in sink.events if e.key_digest is None]
        assert summary.attrs == {"orphans": 2}
        assert summary.nbytes == 200
        assert summary is sink.events[-1]
    finally:
        await tiers.close()


# -- a Redis several sidecars share -------------------------------------------------------------

#: idle long past ``upkeep.SHARED_ORPHAN_MIN_IDLE_S``: untouched since before the purge
LONG_IDLE_S = 7_200


def _redis(url: str) -> Any:
    import redis

    return redis.Redis.from_url(url)


def _age(client: Any, rkey: str, idle_s: int = LONG_IDLE_S) -> None:
    """Make a Redis value look untouched for ``idle_s`` seconds (``RESTORE ... IDLETIME``: the
    same bytes and expiry, the LRU clock set back), as it is when nothing read it since."""
    expire_ms = int(client.execute_command("PEXPIRETIME", rkey))
    assert expire_ms != -2, f"{rkey} is not there"
    payload = client.dump(rkey)
    client.restore(
        rkey, max(expire_ms, 0), payload, replace=True, absttl=expire_ms > 0, idletime=idle_s
    )
    assert int(client.object("idletime", rkey)) >= idle_s


def _fleet_peer(settings: Settings, where: Path, **tiers: Any) -> Settings:
    """Another sidecar of ``settings``'s fleet: its own data dir (under ``where``) and chain,
    the fleet's pseudonym key; ``tiers`` overrides tier settings."""
    peer = settings.model_copy(
        update={
            "data_dir": where / "data",
            "ledger": settings.ledger.model_copy(
                update={"pseudonym_key_path": settings.pseudonym_key_path}
            ),
            "tiers": settings.tiers.model_copy(update=tiers),
        }
    )
    peer.data_dir.mkdir(parents=True)
    generate_signing_key_file(peer.signing_key_path)  # its own chain's key, provisioned
    return peer


@contextmanager
def _entry_index_locked(db: doors.ProdDatabase) -> Iterator[psycopg.Connection[Any]]:
    """Hold ``cache_entries`` so no ledger writer can commit a put's row (a slow or stalled
    database: reads go on). Yields the connection holding it (it reads the table too)."""
    with psycopg.connect(db.superuser_dsn) as conn:
        conn.execute("LOCK TABLE cache_entries IN EXCLUSIVE MODE")
        try:
            yield conn
        finally:
            conn.rollback()


@pytest.mark.redis
async def test_values_erased_from_a_shared_redis_while_its_sidecars_were_down_are_gone_at_start(
    tmp_path: Path, prod_db: doors.ProdDatabase, redis_url: str, redis_prefix: str
) -> None:
    """A Redis tier shared by two sidecars. While they were down (or could not reach Redis),
    alice's entries were purged: their rows say so, their values stayed in Redis, where
    nothing would serve, expire (before their TTL) or delete them. At the next start of a
    sidecar they are deleted and recorded; what another sidecar is putting right then (its
    value stored, its row not committed yet: here held back by a locked entry index), a live
    entry's value and whatever is not a kvgov value under the prefix are kept."""
    tiers = {"chain": ["redis"], "redis_url": redis_url, "redis_prefix": redis_prefix}
    erased, kept, reput, fresh = (
        key(0x71, "acme"),
        key(0x72, "acme"),
        key(0x73, "acme"),
        key(0x74, "acme"),
    )
    value = os.urandom(20_000)
    s1 = doors.tiered_settings(tmp_path / "s1", prod_db, tiers)
    async with doors.tiered_sidecar(tmp_path / "s1", prod_db, tiers) as sc:
        c = _client(sc.server.tcp_port)
        try:
            for k in (erased, kept, reput):
                assert (await run(c.put, k, value, ALICE)).ok
        finally:
            c.close()
        digest = sc.pipeline.pseudonymizer.key_digest
        gone, stays, again, new = (digest(k) for k in (erased, kept, reput, fresh))
        assert sc.engine is not None
        url = sc.engine.url.render_as_string(hide_password=False)
    client = _redis(redis_url)
    try:
        sizes = {d: int(client.strlen(redis_prefix + d)) for d in (gone, stays, again)}
        assert all(sizes.values()), "not stored in Redis"
        # while they are down, alice's entries are purged elsewhere: the rows say so
        from kvgov.db.engine import make_engine

        db = make_engine(url)
        try:
            with Session(db) as session, session.begin():
                session.execute(
                    update(CacheEntry)
                    .where(CacheEntry.key_digest.in_([gone, again]))
                    .values(state=EntryState.PURGED)
                )
        finally:
            db.dispose()
        other = await build_sidecar(_fleet_peer(s1, tmp_path / "s2"))
        await other.start()
        try:
            # time passes: nothing touched the values since; a value of a put that crashed
            # before it was recorded (no row at all) and a foreign key under the prefix too
            lost, foreign = "ab" * 32, "not-a-kvgov-value"
            client.set(redis_prefix + lost, b"x" * 1234, ex=3600)
            client.set(redis_prefix + foreign, b"y", ex=3600)
            for d in (gone, stays, again, lost, foreign):
                _age(client, redis_prefix + d)
            with _entry_index_locked(prod_db) as locked:
                # the other sidecar puts again a key whose row says purged, and a new one:
                # acknowledged (journaled), values in Redis, rows not committed
                c2 = _client(other.server.tcp_port)
                try:
                    assert (await run(c2.put, reput, value, BOB)).ok
                    assert (await run(c2.put, fresh, value, BOB)).ok
                finally:
                    c2.close()
                in_progress = {d: client.get(redis_prefix + d) for d in (again, new)}
                assert all(in_progress.values()), "the other sidecar stored nothing"
                rows = dict(
                    locked.execute(
                        "SELECT key_digest, state FROM cache_entries WHERE key_digest = ANY(%s)",
                        ([again, new],),
                    ).fetchall()
                )
                assert rows == {again: "purged"}, "the puts' rows committed: no race to show"
                async with doors.tiered_sidecar(tmp_path / "s1", prod_db, tiers) as sc:
                    left = {d for d in (gone, lost) if client.exists(redis_prefix + d)}
                    assert not left, "an erased value is still in the shared Redis"
                    for d in (stays, foreign):
                        assert client.exists(redis_prefix + d), "a value that is not an orphan"
                    for d, stored in in_progress.items():  # the other sidecar's puts
                        assert client.get(redis_prefix + d) == stored, "a put in progress lost"
                    recorded = _orphan_events(sc)
                    principal = f"sidecar:{sc.settings.chain_id}"
            # the other sidecar's rows commit: its entries are live and served
            assert other.writer is not None
            await other.writer.flush()
            c2 = _client(other.server.tcp_port)
            try:
                for k in (reput, fresh):
                    got = await run(c2.get, k, BOB)
                    assert got is not None and got[0] == value
            finally:
                c2.close()
        finally:
            await other.stop()
    finally:
        client.close()
    # each deletion is in the ledger: the orphaned digests and only them, on the redis tier
    by_digest = {e.key_digest: e for e in recorded}
    assert set(by_digest) == {gone, lost}
    for e in recorded:
        assert e.tier == "redis" and e.outcome == Outcome.OK and e.principal == principal
        assert e.actor is None and e.request_id is None
    assert by_digest[gone].tenant == "acme"
    assert by_digest[gone].nbytes == sizes[gone]
    assert by_digest[gone].attrs == {"entry_state": "purged", "removed_here": True}
    assert by_digest[lost].tenant is None
    assert by_digest[lost].nbytes == 1234
    assert by_digest[lost].attrs == {"entry_state": None, "removed_here": True}


def _meta(tiers: tuple[str, ...] = ("redis",)) -> EntryMeta:
    return EntryMeta(
        tenant="acme",
        owner=None,
        scope_user=None,
        scope=Scope.TENANT,
        sensitivity=None,
        model=None,
        size=100,
        tiers=tiers,
        key_id=None,
        key_version=None,
        expires_at=None,
    )


@pytest.mark.redis
async def test_a_shared_redis_keeps_what_may_be_another_sidecars_and_counts_past_a_cap(
    redis_url: str, redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only a value named by a key digest, with no live row in the ledger as it is now, that
    nothing touched for a while, is an orphan; each deletion is recorded up to the cap, then
    counted."""
    from kvgov.connectors.tiers.redis import RedisTier

    monkeypatch.setattr(upkeep, "RECONCILE_CHUNK", 2)
    monkeypatch.setattr(upkeep, "RECONCILE_RECORDED_MAX", 3)
    tier = await RedisTier.connect(redis_url, prefix=redis_prefix)
    tiers = TierChain([tier])
    client = _redis(redis_url)
    try:
        d = [f"{i:02x}" * 32 for i in range(10)]
        in_index, put_since, purged, deleted = d[0], d[1], d[2], d[3]
        no_row = d[4:8]
        young_purged, young_no_row = d[8], d[9]
        foreign = "session:not-a-digest"
        for k in [*d, foreign]:
            await tier.put(k, b"x" * 100)
        for k in [*d[:8], foreign]:
            _age(client, redis_prefix + k)
        index = EntryIndex()
        index.set(in_index, _meta())
        rows = {
            # live since this sidecar loaded its index: another sidecar put it
            put_since: LedgerEntry("acme", EntryState.LIVE),
            purged: LedgerEntry("acme", EntryState.PURGED),
            deleted: LedgerEntry("acme", EntryState.DELETED),
            young_purged: LedgerEntry("acme", EntryState.PURGED),
        }
        looked_up: list[str] = []

        def lookup(batch: Any) -> dict[str, LedgerEntry]:
            looked_up.extend(batch)
            return {k: rows[k] for k in batch if k in rows}

        sink = InMemoryEventSink()
        removed = await upkeep.reconcile(
            index, tiers, Recorder(sink), lookup=lookup, principal="sidecar:t"
        )
        orphans = {purged, deleted, *no_row}
        assert removed == {"redis": len(orphans)}
        left = {k async for k in tier.iter_keys()}
        assert left == {in_index, put_since, young_purged, young_no_row, foreign}
        # every digest the index does not name is looked up (the ledger as it is now)
        assert sorted(looked_up) == sorted(set(d) - {in_index})
        listed = [e for e in sink.events if e.key_digest is not None]
        assert len(listed) == 3 and {e.key_digest for e in listed} <= orphans
        for e in sink.events:
            assert e.kind is EventKind.KV_DELETE and e.reason == "orphan" and e.tier == "redis"
            assert e.entry is None and e.principal == "sidecar:t"
        for e in listed:
            state = rows[e.key_digest].state if e.key_digest in rows else None
            assert e.attrs == {"entry_state": state, "removed_here": True}
            assert e.nbytes == 100
        (summary,) = [e for e in sink.events if e.key_digest is None]
        assert summary.attrs == {"orphans": len(orphans) - 3}
        assert summary.nbytes == 100 * (len(orphans) - 3)
        assert summary is sink.events[-1]
        # a second sidecar reconciling the same Redis finds nothing more to delete or record
        again = InMemoryEventSink()
        assert await upkeep.reconcile(index, tiers, Recorder(again), lookup=lookup) == {}
        assert again.events == []
    finally:
        client.close()
        await tiers.close()


@pytest.mark.redis
async def test_a_redis_that_cannot_tell_idle_time_keeps_everything(
    redis_url: str, redis_prefix: str
) -> None:
    """A Redis that tracks no idle time (an LFU ``maxmemory-policy``) or refuses ``OBJECT``
    (a managed Redis's ACL, here a user without it): nothing can tell an orphan from a put in
    progress, so nothing is deleted."""
    from urllib.parse import urlsplit, urlunsplit

    from kvgov.connectors.tiers.redis import RedisTier

    client = _redis(redis_url)
    user, password = f"kvgov-test-{os.urandom(4).hex()}", os.urandom(12).hex()
    client.execute_command(
        "ACL", "SETUSER", user, "on", f">{password}", f"~{redis_prefix}*", "+@all", "-object"
    )
    parts = urlsplit(redis_url)
    restricted = urlunsplit(
        parts._replace(netloc=f"{user}:{password}@{parts.hostname}:{parts.port}")
    )
    tier = await RedisTier.connect(restricted, prefix=redis_prefix)
    tiers = TierChain([tier])
    try:
        orphan = "cd" * 32
        await tier.put(orphan, b"x" * 100)
        _age(client, redis_prefix + orphan)
        sink = InMemoryEventSink()
        removed = await upkeep.reconcile(
            EntryIndex(), tiers, Recorder(sink), lookup=lambda batch: {}, principal="sidecar:t"
        )
        assert removed == {}
        assert sink.events == []
        assert await tier.contains(orphan)
    finally:
        await tiers.close()
        client.execute_command("ACL", "DELUSER", user)
        client.close()

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
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, update
from sqlalchemy.orm import Session
from typer.testing import CliRunner

from kvgov.cli.main import build_app
from kvgov.config import Settings
from kvgov.connectors.tiers.chain import TierChain
from kvgov.connectors.tiers.filesystem import FilesystemTier
from kvgov.db.models import CacheEntry, LedgerEvent
from kvgov.ledger.events import InMemoryEventSink
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


def _cli_verify(settings: Settings) -> tuple[int, dict[str, Any]]:
    """``kvgov audit verify`` as an operator runs it, pinning the sidecar's signing key."""
    env = {"KVGOV_DATABASE__URL": settings.database_url, "KVGOV_DATA_DIR": str(settings.data_dir)}
    result = CliRunner().invoke(
        build_app(),
        ["audit", "verify", "--json", "--trust-key", str(settings.signing_key_path)],
        env=env,
    )
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

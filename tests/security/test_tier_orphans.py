"""Attack (erasure): values a purge erased while this sidecar was down, left on its disk.

A purge's tier steps go to the sidecars alive when it is created; a sidecar that was down (a
restarting container keeps its ``emptyDir``) kept the erased user's values in its filesystem
tier. At its next start it loaded only live entries into its index, so nothing would serve,
expire or delete those files: the bytes stayed on disk for good, readable under a tenant key
that a user purge does not shred. Now a sidecar deletes, at start, every value in a local tier
that no live entry names (``upkeep.reconcile``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from sqlalchemy import update
from sqlalchemy.orm import Session

from kvgov.connectors.tiers.filesystem import FilesystemTier
from kvgov.db.models import CacheEntry
from kvgov.types import EntryState
from kvgov.wire import RequestContext, WireClient
from tests.security import doors
from tests.security.doors import key, run

pytestmark = pytest.mark.postgres

ALICE = RequestContext(request_id="r-a", tenant="acme", user="alice")
BOB = RequestContext(request_id="r-b", tenant="acme", user="bob")
TIERS = {"chain": ["filesystem"]}


def _client(port: int | None) -> WireClient:
    return WireClient(f"tcp://127.0.0.1:{port}", engine_id="x", token="tok-acme", timeout=5)


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
        engine = sc.engine
        assert engine is not None
        url = engine.url
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
        c = _client(sc.server.tcp_port)
        try:  # the live entry is untouched and still served
            got = await run(c.get, kept, BOB)
            assert got is not None and got[0] == value
            assert await run(c.get, erased, ALICE) is None
        finally:
            c.close()

"""A ``cache_entries`` row inserted under another tenant before the real tenant's first put.

Attack (last session's list): migration 0011's owner trigger refuses any change of a row's key
digest or tenant, but whoever holds the runtime database role may still INSERT a row. Knowing
(or guessing) the digest of a chunk acme has not put yet, they insert its row under globex.
When acme's engine then puts the chunk, the writer's upsert only fills an empty tenant, and a
put of a live row keeps that row's life: the row stayed globex's, owned by the squatter. acme's
entry was then listed, counted and retained as globex's, never under acme.

Now the put wins: a row whose tenant no chained event names (nothing but the squatter's INSERT
put it there) takes the put's tenant and starts a new life with the put's owner (migration
0012 lets the trigger allow exactly that change, and logs a warning in the database). A row
whose tenant the chain does name still never changes, whoever asks.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime
from pathlib import Path

import psycopg
import pytest
from psycopg import errors as pg_errors
from sqlalchemy.orm import Session

from kvgov.db.models import CacheEntry
from kvgov.ledger.repository import LedgerRepository
from kvgov.proxy.app import Sidecar
from kvgov.types import EntryState
from kvgov.wire import RequestContext
from tests.security import doors
from tests.security.doors import engine, key, run

pytestmark = pytest.mark.postgres


def _runtime(db: doors.ProdDatabase) -> psycopg.Connection[tuple[object, ...]]:
    """A connection as the runtime role, as a sidecar (or whoever has its password) connects."""
    return psycopg.connect(db.url.replace("postgresql+psycopg", "postgresql"), autocommit=True)


def _squat(db: doors.ProdDatabase, digest: str) -> None:
    now = datetime.now(UTC)
    with _runtime(db) as conn:
        conn.execute(
            "INSERT INTO cache_entries (key_digest, tenant, owner, state, tiers, created_at,"
            " updated_at, expires_at) VALUES (%s, 'globex', 'mallory', 'live', '[]', %s, %s,"
            " '2999-01-01')",
            (digest, now, now),
        )


def _row(sc: Sidecar, digest: str) -> CacheEntry | None:
    with Session(sc.engine) as s:
        return s.get(CacheEntry, digest)


async def test_a_row_squatted_under_another_tenant_is_taken_by_the_real_put(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    async with doors.sidecar(tmp_path, prod_db) as sc:
        acme = engine(sc, "tok-acme")
        try:
            raw = key(0x71, "acme")
            digest = sc.pipeline.pseudonymizer.key_digest(raw)
            _squat(prod_db, digest)
            alice = RequestContext(request_id="r-squat", tenant="acme", user="alice")
            value = os.urandom(4096)
            assert (await run(acme.put, raw, value, alice)).ok
            assert sc.writer is not None
            await sc.writer.flush()
            row = _row(sc, digest)
            assert row is not None
            owner = sc.pipeline.pseudonymizer.user("acme", "alice")
            assert (row.tenant, row.owner) == ("acme", owner), (
                f"acme's put left the squatted row as ({row.tenant}, {row.owner})"
            )
            assert row.state is EntryState.LIVE and row.size == len(value)
            with Session(sc.engine) as s:
                repo = LedgerRepository(s)
                assert digest in {e.key_digest for e in repo.entries(tenant="acme")}
                assert digest not in {e.key_digest for e in repo.entries(tenant="globex")}
            # the data was never lost: acme's engine reads it back
            assert doors.value_of(await run(acme.get, raw, alice)) == value
        finally:
            acme.close()


async def test_a_row_the_chain_names_still_never_moves(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    """The allowance is for rows no chained event backs: acme's row, backed by its put,
    cannot be moved, not even with a table of the runtime role's own shadowing the ledger's
    events in the trigger's query (a temporary ``ledger_events``)."""
    async with doors.sidecar(tmp_path, prod_db) as sc:
        acme = engine(sc, "tok-acme")
        try:
            raw = key(0x72, "acme")
            alice = RequestContext(request_id="r-squat-2", tenant="acme", user="alice")
            assert (await run(acme.put, raw, os.urandom(1024), alice)).ok
            assert sc.writer is not None
            await sc.writer.flush()
            digest = sc.pipeline.pseudonymizer.key_digest(raw)
            with _runtime(prod_db) as conn:
                with pytest.raises(pg_errors.RaiseException, match="never change"):
                    conn.execute(
                        "UPDATE cache_entries SET tenant = 'globex' WHERE key_digest = %s",
                        (digest,),
                    )
                conn.execute("CREATE TEMP TABLE ledger_events (key_digest text, tenant text)")
                with pytest.raises(pg_errors.RaiseException, match="never change"):
                    conn.execute(
                        "UPDATE cache_entries SET tenant = 'globex' WHERE key_digest = %s",
                        (digest,),
                    )
            row = _row(sc, digest)
            assert row is not None and row.tenant == "acme"
        finally:
            acme.close()

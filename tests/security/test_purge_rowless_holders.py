"""A purge names the engines that held a digest of its scope whose ``cache_entries`` row is gone.

Attack (last session's list): purge scope stands on the chained put events since 0e41323
(:func:`kvgov.services.purge.scope.scoped_entries`: a digest the user put is in scope whether
or not a row has it), but the query for the engines that held an entry in scope through the
executing sidecar (``engines_that_held``'s ``here``) still selected its digests from
``cache_entries`` only. A digest whose row is missing (deleted, never written for a put the
chain alone records, history from before migration 0011) named no holder: the engine that
stored the user's chunk, its control channel down while the purge ran, was sent no EVICT and
named nowhere, and the signed receipt said ``completed`` while its local tier kept the chunk.

Today a whole purge meets the missing row only by luck: ``tiers@S`` runs first and records a
``kv:delete`` for every digest in scope, which makes the writer insert a row for the rowless
digest before ``engines@S`` reads the holders (the end-to-end test pins that). The holder query
itself (``test_the_holders_of_a_rowless_digest_of_the_scope_are_named``) missed the engine
whenever those events had not reached the database yet, and depended on that side effect. Now
it selects on the same digests as the scope, rows or not
(:func:`kvgov.ledger.repository.user_digests`).
"""

from __future__ import annotations

import os
from pathlib import Path

import psycopg
import pytest
from sqlalchemy.orm import Session

from kvgov.services.purge import scope
from kvgov.types import PurgeState
from kvgov.wire import RequestContext
from tests.security import doors
from tests.security.doors import engine, key, run

pytestmark = pytest.mark.postgres


def _delete_row_as_owner(db: doors.ProdDatabase, digest: str) -> int:
    """Delete the digest's row as the database's owner would (the runtime role may not): a
    digest the chain names that no row has, as history can leave it."""
    with psycopg.connect(db.superuser_dsn) as conn:
        return conn.execute("DELETE FROM cache_entries WHERE key_digest = %s", (digest,)).rowcount


async def test_the_holders_of_a_rowless_digest_of_the_scope_are_named(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    """What ``engines@S`` reads: the engine that put alice's chunk on this sidecar's chain,
    though no ``cache_entries`` row has the chunk's digest."""
    async with doors.sidecar(tmp_path, prod_db) as sc:
        acme = engine(sc, "tok-acme")
        try:
            alice = RequestContext(request_id="r-rowless-0", tenant="acme", user="alice")
            raw = key(0x60, "acme")
            assert (await run(acme.put, raw, os.urandom(4096), alice)).ok
            assert sc.writer is not None
            await sc.writer.flush()
            digest = sc.pipeline.pseudonymizer.key_digest(raw)
            assert _delete_row_as_owner(prod_db, digest) == 1
            subject = sc.pipeline.pseudonymizer.user("acme", "alice")
            with Session(sc.engine) as s:
                scoped = [e.key_digest for e in scope.scoped_entries(s, "acme", subject)]
                holders = scope.engines_that_held(s, "acme", subject, chain_id=sc.settings.chain_id)
            assert digest in scoped  # the scope stands on the chained put (0e41323)
            assert "vllm-acme" in holders.here, (
                f"the engine that put alice's rowless chunk is not a holder: {holders}"
            )
        finally:
            acme.close()


async def test_an_engine_that_put_a_rowless_digest_of_the_scope_is_named(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    async with doors.sidecar(tmp_path, prod_db) as sc:
        acme = engine(sc, "tok-acme")
        channel = acme.control(lambda request: [], reconnect_delay=0.1)
        try:
            assert await run(channel.connected.wait, 10)
            alice = RequestContext(request_id="r-rowless", tenant="acme", user="alice")
            raw = key(0x61, "acme")  # tenant-scoped: in alice's scope through her chained put
            assert (await run(acme.put, raw, os.urandom(4096), alice)).ok
            assert sc.writer is not None
            await sc.writer.flush()
            digest = sc.pipeline.pseudonymizer.key_digest(raw)
            assert _delete_row_as_owner(prod_db, digest) == 1
            await run(channel.close)  # the engine's local tier keeps the chunk; no channel
            job = await doors.purge(sc, "acme", "alice")
            receipt = doors.receipt(job)
            assert receipt["entries_in_scope"] >= 1  # the scope found the rowless digest
            unreachable = {u["engine"]: u["error"] for u in receipt["engines"]["unreachable"]}
            assert "vllm-acme" in unreachable, (
                f"the engine that put alice's chunk is not named: receipt {receipt['state']},"
                f" engines {receipt['engines']}"
            )
            assert job.state is PurgeState.INCOMPLETE
        finally:
            channel.close()
            acme.close()

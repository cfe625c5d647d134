"""Purge scope anchored on the chain (review r10, F3 and F4): a purge whose signed receipt says
``completed`` while the purged user's KV data is still cached and served.

Each test FAILS while its hole is open (``docs/purge.md``: a user purge covers every key the
user ever put; the receipt records what was acknowledged and what was not).

* F3: a re-put of a live key by the purged user is recorded ``kv:put:kept``, which purge scope
  (``user_entries``: ``kv:put`` only) did not count.
* F4: whoever holds the runtime database role could move the entry's ``cache_entries`` row to
  another tenant (or re-key it) and so take it out of every purge, although the user's chained
  put still names it. The runtime role's edit is now refused (migration 0011's owner trigger);
  the purge must reach the entry whatever its row says all the same: a row moved before that
  migration, or by a role that can switch the trigger off, is made here by the superuser with
  triggers off. An edit the runtime role may still make (the owner) cannot hide the entry.
"""

from __future__ import annotations

import os
from pathlib import Path

import psycopg
import pytest
from psycopg import errors as pg_errors
from sqlalchemy import create_engine, text
from sqlalchemy.exc import DBAPIError

from kvgov.types import EntryState, PurgeState
from kvgov.wire import RequestContext
from tests.security import doors
from tests.security.doors import engine, key, run, value_of

pytestmark = pytest.mark.postgres


def _as_superuser_without_triggers(db: doors.ProdDatabase, statement: str, digest: str) -> int:
    """Run ``statement`` on the row of ``digest`` as the superuser with every trigger off: the
    row as a runtime role could leave it before migration 0011. Returns the rows changed."""
    with psycopg.connect(db.superuser_dsn) as conn:
        conn.execute("SET session_replication_role = replica")
        return conn.execute(statement, {"d": digest}).rowcount


async def test_f3_a_re_put_by_the_purged_user_is_not_in_scope(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    """Bob's request created a tenant-scoped chunk; alice's request put the same chunk again
    (the same prefix: ``kv:put:kept``). ``docs/purge.md``: a user purge covers every key the
    user ever put."""
    async with doors.sidecar(tmp_path, prod_db) as sc:
        acme = engine(sc, "tok-acme")
        try:
            raw = key(0x53, "acme")
            value = os.urandom(4096)
            bob = RequestContext(request_id="r-4", tenant="acme", user="bob")
            alice = RequestContext(request_id="r-5", tenant="acme", user="alice")
            assert (await run(acme.put, raw, value, bob)).ok
            assert (await run(acme.put, raw, value, alice)).ok  # acknowledged as cached
            # vllm-acme holds alice's re-put: its control channel is up for her purge (a holder
            # without one is named unreachable and the purge is incomplete)
            async with doors.control_up(sc, "tok-acme"):
                job = await doors.purge(sc, "acme", "alice")
            assert job.state is PurgeState.COMPLETED
            receipt = doors.receipt(job)
            digest = sc.pipeline.pseudonymizer.key_digest(raw)
            served = value_of(await run(acme.get, raw, bob))
            assert served is None, (
                f"a chunk alice put is {doors.entry_state(sc, digest)} and served after her purge "
                f"(entries_in_scope={receipt['entries_in_scope']})"
            )
        finally:
            acme.close()


async def test_f4_the_runtime_role_hides_an_entry_from_a_purge_by_editing_its_row(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    """Moving alice's row to another tenant takes it out of her purge's scope, although her
    chained ``kv:put`` (tenant acme, actor alice, this key digest) still names it. The runtime
    role's UPDATE is refused now; the row moved anyway (as before migration 0011) must still
    be purged."""
    async with doors.sidecar(tmp_path, prod_db) as sc:
        acme = engine(sc, "tok-acme")
        runtime = create_engine(prod_db.url)
        try:
            raw = key(0x54, "acme")  # tenant-scoped: acme's key is not shredded by her purge
            value = os.urandom(4096)
            alice = RequestContext(request_id="r-6", tenant="acme", user="alice")
            assert (await run(acme.put, raw, value, alice)).ok
            assert sc.writer is not None
            await sc.writer.flush()
            digest = sc.pipeline.pseudonymizer.key_digest(raw)
            move = "UPDATE cache_entries SET tenant = 'elsewhere' WHERE key_digest = %(d)s"
            with pytest.raises(DBAPIError, match="never change"), runtime.begin() as c:
                c.exec_driver_sql(move, {"d": digest})  # the runtime role, as a sidecar connects
            moved = _as_superuser_without_triggers(prod_db, move, digest)
            assert moved == 1
            job = await doors.purge(sc, "acme", "alice")
            receipt = doors.receipt(job)
            bob = RequestContext(request_id="r-7", tenant="acme", user="bob")
            served = value_of(await run(acme.get, raw, bob))
            assert served is None, (
                f"receipt {receipt['state']} (entries_in_scope={receipt['entries_in_scope']}) "
                "and alice's chunk is still served"
            )
        finally:
            runtime.dispose()
            acme.close()


async def test_a_re_keyed_row_leaves_the_put_digest_in_scope(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    """The row's key digest changed: no row has alice's digest any more, only her chained put
    names it. The purge still deletes it from the tiers (and evicts it), and records it."""
    async with doors.sidecar(tmp_path, prod_db) as sc:
        acme = engine(sc, "tok-acme")
        try:
            raw = key(0x55, "acme")
            value = os.urandom(4096)
            alice = RequestContext(request_id="r-8", tenant="acme", user="alice")
            assert (await run(acme.put, raw, value, alice)).ok
            assert sc.writer is not None
            await sc.writer.flush()
            digest = sc.pipeline.pseudonymizer.key_digest(raw)
            rekey = "UPDATE cache_entries SET key_digest = repeat('f', 64) WHERE key_digest = %(d)s"
            with (
                psycopg.connect(prod_db.url.replace("postgresql+psycopg", "postgresql")) as conn,
                pytest.raises(pg_errors.RaiseException, match="never change"),
            ):
                conn.execute(rekey, {"d": digest})  # the runtime role: refused
            assert _as_superuser_without_triggers(prod_db, rekey, digest) == 1
            assert doors.entry_state(sc, digest) is None
            job = await doors.purge(sc, "acme", "alice")
            receipt = doors.receipt(job)
            bob = RequestContext(request_id="r-9", tenant="acme", user="bob")
            served = value_of(await run(acme.get, raw, bob))
            assert served is None, (
                f"receipt {receipt['state']} (entries_in_scope={receipt['entries_in_scope']}) "
                "and alice's re-keyed chunk is still served"
            )
            await sc.writer.flush()
            assert doors.entry_state(sc, digest) is EntryState.PURGED  # the purge recorded it
        finally:
            acme.close()


async def test_an_owner_the_runtime_role_edits_does_not_hide_the_entry(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    """The runtime role may still update an entry's owner and scope user (the writer does):
    alice's user-scoped chunk handed to someone else stays in her purge through her put."""
    async with doors.sidecar(tmp_path, prod_db) as sc:
        acme = engine(sc, "tok-acme")
        runtime = create_engine(prod_db.url)
        try:
            raw = key(0x56, "acme")  # tenant-scoped, so bob may read it
            value = os.urandom(4096)
            alice = RequestContext(request_id="r-10", tenant="acme", user="alice")
            assert (await run(acme.put, raw, value, alice)).ok
            assert sc.writer is not None
            await sc.writer.flush()
            digest = sc.pipeline.pseudonymizer.key_digest(raw)
            with runtime.begin() as c:
                changed = c.execute(
                    text(
                        "UPDATE cache_entries SET owner = 'someone-else', scope_user = NULL"
                        " WHERE key_digest = :d"
                    ),
                    {"d": digest},
                ).rowcount
            assert changed == 1
            job = await doors.purge(sc, "acme", "alice")
            receipt = doors.receipt(job)
            bob = RequestContext(request_id="r-11", tenant="acme", user="bob")
            served = value_of(await run(acme.get, raw, bob))
            assert served is None, (
                f"receipt {receipt['state']} (entries_in_scope={receipt['entries_in_scope']}) "
                "and alice's chunk, its owner edited, is still served"
            )
        finally:
            runtime.dispose()
            acme.close()

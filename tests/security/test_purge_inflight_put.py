"""A purge and the puts still arriving while it runs (review r10, F2; ``docs/purge.md``, "Puts
in flight").

A purge's tier step read its scope once from ``cache_entries`` and deleted exactly that, so:

* a PUT admitted before the purge, whose payload was still arriving, was stored after the
  read: live and served under a ``completed`` receipt;
* a put the sidecar acknowledged from its journal but had not yet committed to Postgres was
  not in the scope read (widest for a purge created by another process: the CLI, another
  replica).

Now the step first raises an erasure fence in the sidecar's pipeline (puts of the scope in
flight are never made visible; new ones are refused until the job ends), flushes the ledger
writer, and deletes what the in-memory index holds of the scope as well. The first two tests
FAIL on the code before (the attack works); the others show the fence refuses nothing else,
and lifts when the job ends.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from kvgov.db.purge_views import PurgeRequest, StepName
from kvgov.proxy.app import Sidecar
from kvgov.types import EntryState, EventKind, PurgeState
from kvgov.wire import RequestContext
from kvgov.wire.codec import FrameType, encode_frame
from tests.security import doors
from tests.security.doors import RawWire, engine, key, run, value_of

pytestmark = pytest.mark.postgres


def _denials(sc: Sidecar, reason: str) -> int:
    return sum(1 for e in doors.events(sc, EventKind.KV_DENIED) if e.reason == reason)


class _HalfPut:
    """A raw engine connection that sends a PUT's header and the first half of its value,
    then the rest when told (a large value on a slow link, or an engine trickling it)."""

    def __init__(self, sc: Sidecar, raw: str, value: bytes, user: str) -> None:
        self.sc, self.raw, self.value, self.user = sc, raw, value, user
        self.wire = RawWire(sc.server.tcp_port)

    async def start(self) -> None:
        hello = await run(self.wire.hello, "tok-acme")
        assert hello.type == FrameType.HELLO and hello.error is None, hello.meta
        ctx = {"request_id": f"half-{self.user}", "tenant": "acme", "user": self.user}
        meta = {"items": [{"key": self.raw, "len": len(self.value)}], "ctx": ctx}
        await run(self.wire.send_raw, encode_frame(FrameType.PUT, 7, meta, len(self.value)))
        await run(self.wire.send_raw, self.value[: len(self.value) // 2])
        digest = self.sc.pipeline.pseudonymizer.key_digest(self.raw)
        assert await doors.until(lambda: digest in self.sc.pipeline._storing, 10)

    async def finish(self) -> dict[str, Any]:
        """Send the rest; the item's result in the PUT reply."""
        await run(self.wire.send_raw, self.value[len(self.value) // 2 :])
        reply = await run(self.wire.read)
        assert reply.type == FrameType.PUT, reply.meta
        result: dict[str, Any] = reply.meta["results"][0]
        return result

    def close(self) -> None:
        self.wire.close()


async def test_a_put_in_flight_during_the_purge_is_not_stored_after_it(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    """Alice's tenant-scoped chunk: its PUT is admitted, then the purge of alice runs, then the
    rest of its payload arrives (r10's F2 test, its assertions kept)."""
    async with doors.sidecar(tmp_path, prod_db) as sc:
        raw = key(0x52, "acme")  # tenant-scoped (no user tag): sealed under acme's key
        digest = sc.pipeline.pseudonymizer.key_digest(raw)
        value = os.urandom(256 << 10)
        put = _HalfPut(sc, raw, value, "alice")
        reader = engine(sc, "tok-acme")
        try:
            await put.start()
            purge = asyncio.create_task(doors.purge(sc, "acme", "alice"))
            await asyncio.wait([purge], timeout=2)
            result = await put.finish()  # stored, or refused by a fixed sidecar
            job = await purge
            assert sc.writer is not None
            await sc.writer.flush()  # a kv:put would reach Postgres (acked from the journal)
            bob = RequestContext(request_id="r-3", tenant="acme", user="bob")
            served = value_of(await run(reader.get, raw, bob))
            state = doors.entry_state(sc, digest)
            assert served is None and state is not EntryState.LIVE, (
                f"after a {job.state} purge of alice, her chunk is {state} and "
                f"{'served' if served == value else 'not served'} to another user"
            )
            # how: the put was refused as its erasure's, recorded, and nothing of it is left
            assert result.get("reason") == "erasure_in_progress", result
            assert _denials(sc, "erasure_in_progress") == 1
            assert not any([await t.contains(digest) for t in sc.tiers.tiers])
        finally:
            put.close()
            reader.close()


async def test_a_put_acknowledged_from_the_journal_but_not_committed_is_purged(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    """Alice's put is acknowledged once journaled; Postgres is slow to take the commit (a
    session holds a lock the writer needs) when a purge created by another process (the CLI,
    on its own chain: it runs the global steps) reaches this sidecar's ``tiers@S`` step."""
    from kvgov.proxy.app import build_sidecar
    from kvgov.services.purge.build import cli_service

    base = doors.settings(tmp_path, prod_db)
    # the sidecar's executor runs when the test wakes it, not on its own poll
    purge = base.purge.model_copy(update={"poll_interval_s": 3600.0})
    sc = await build_sidecar(base.model_copy(update={"purge": purge}))
    await sc.start()
    assert sc.purge is not None
    acme = engine(sc, "tok-acme")
    slow = psycopg.connect(prod_db.superuser_dsn)  # what keeps the writer's commit waiting
    try:
        raw = key(0x61, "acme")
        digest = sc.pipeline.pseudonymizer.key_digest(raw)
        value = os.urandom(4096)
        slow.execute("LOCK TABLE cache_entries IN SHARE MODE")  # reads go on, writes wait
        alice = RequestContext(request_id="r-8", tenant="acme", user="alice")
        assert (await run(acme.put, raw, value, alice)).ok  # acknowledged from the journal
        assert doors.entry_state(sc, digest) is None  # ... and not in Postgres
        async with cli_service(base) as cli:  # polls as configured by default
            job = await cli.create(PurgeRequest(tenant="acme", user="alice", requested_by="test"))
            await cli.run_until_idle(job.id)  # keys, tiers (its shared tiers); ledger waits
            sc.purge.wake()
            deadline = time.monotonic() + 20
            while True:  # the sidecar has taken its tier step: let the commit through
                steps = (await cli.get(job.id)).steps
                mine = [s for s in steps if s.name is StepName.TIERS and s.sidecar_id]
                if mine and mine[0].state is not PurgeState.PENDING:
                    break
                assert time.monotonic() < deadline, "the sidecar never took tiers@S"
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)
            slow.rollback()
            job = await asyncio.wait_for(cli.wait(job.id), 60)
        bob = RequestContext(request_id="r-9", tenant="acme", user="bob")
        served = value_of(await run(acme.get, raw, bob))
        state = doors.entry_state(sc, digest)
        assert served is None and state is not EntryState.LIVE, (
            f"after a {job.state} purge of alice, her chunk acknowledged before it is "
            f"{state} and {'served' if served == value else 'not served'} to another user"
        )
    finally:
        slow.close()
        acme.close()
        await sc.stop()


async def test_another_users_put_in_flight_during_the_purge_is_stored(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    """Bob's tenant-scoped chunk and his user-scoped one are in flight while alice is purged:
    the fence is alice's, so both are stored and served (no false discard)."""
    async with doors.sidecar(tmp_path, prod_db) as sc:
        shared, own = key(0x62, "acme"), key(0x63, "acme", user="bob")
        values = {shared: os.urandom(256 << 10), own: os.urandom(256 << 10)}
        puts = [_HalfPut(sc, raw, v, "bob") for raw, v in values.items()]
        reader = engine(sc, "tok-acme")
        try:
            for put in puts:
                await put.start()
            job = await doors.purge(sc, "acme", "alice")
            assert job.state is PurgeState.COMPLETED
            for put in puts:
                assert await put.finish() == {"code": 0}
            bob = RequestContext(request_id="r-10", tenant="acme", user="bob")
            for raw, value in values.items():
                assert value_of(await run(reader.get, raw, bob)) == value
            assert _denials(sc, "erasure_in_progress") == 0
        finally:
            for put in puts:
                put.close()
            reader.close()


async def test_a_fence_refuses_its_subjects_puts_until_its_job_ends(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    """While a purge of alice is under way, her new puts are refused (``denied``, reason
    ``erasure_in_progress``, recorded) and everyone else's are stored; a tenant purge fences
    that tenant alone; once the job is finished the fence is lifted and her puts are cached
    again (new data, after the erasure)."""
    from kvgov.proxy.dataplane.fences import Fence

    async with doors.sidecar(tmp_path, prod_db) as sc:
        assert sc.purge is not None
        await sc.purge.stop()  # nothing lifts the fences behind the test's back
        pseudonym = sc.pipeline.pseudonymizer.user("acme", "alice")
        until = time.time() + 60
        sc.pipeline.fence("job-of-alice", Fence("acme", pseudonym, until))
        sc.pipeline.fence("job-of-globex", Fence("globex", None, until))
        acme = engine(sc, "tok-acme")
        try:
            alice = RequestContext(request_id="r-11", tenant="acme", user="alice")
            bob = RequestContext(request_id="r-12", tenant="acme", user="bob")
            value = os.urandom(4096)
            for raw in (key(0x64, "acme"), key(0x65, "acme", user="alice")):
                ack = await run(acme.put, raw, value, alice)
                assert not ack.ok and ack.reason == "erasure_in_progress", ack
                assert value_of(await run(acme.get, raw, alice)) is None
            assert _denials(sc, "erasure_in_progress") == 2
            for raw in (key(0x64, "acme"), key(0x66, "acme", user="bob")):
                assert (await run(acme.put, raw, value, bob)).ok
                assert value_of(await run(acme.get, raw, bob)) == value
            # neither is an open purge job: both are lifted as finished
            await sc.purge.service.lift_fences()
            assert sc.pipeline.fenced_jobs == []
            raw = key(0x65, "acme", user="alice")
            assert (await run(acme.put, raw, value, alice)).ok
            assert value_of(await run(acme.get, raw, alice)) == value
        finally:
            acme.close()


async def test_the_fence_is_lifted_when_the_purge_is_finished(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    async with doors.sidecar(tmp_path, prod_db) as sc:
        acme = engine(sc, "tok-acme")
        try:
            job = await doors.purge(sc, "acme", "alice")
            assert job.state is PurgeState.COMPLETED
            assert sc.pipeline.fenced_jobs == []
            alice = RequestContext(request_id="r-13", tenant="acme", user="alice")
            assert (await run(acme.put, key(0x67, "acme"), os.urandom(4096), alice)).ok
        finally:
            acme.close()

"""Attack (erasure): values erased from a shared Redis stay there while its sidecars run.

A Redis tier is shared by several sidecars; a purge or deletion reaches it only through the
sidecars alive then. One made while none was alive, or whose Redis deletion failed, left the
erased (sealed) values in Redis: never served, but readable to whoever reads Redis, under a key
not shredded when the purge was tenant-wide or a plain deletion. Only a sidecar's *start*
deleted those orphans (``upkeep.reconcile``), so a fleet whose sidecars ran for weeks kept them
until a restart or their TTL, and a value put without TTL for good. Now a running sidecar
reconciles its shared tiers again every ``tiers.shared_reconcile_interval_s`` (jittered), with
the checks of the start (the ledger asked at that moment, values idle for
``upkeep.SHARED_ORPHAN_MIN_IDLE_S``, checked atomically in Redis) and records each deletion
the same way (``kv:delete``, reason ``orphan``). Helpers: ``tests/security/test_tier_orphans.py``.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import update
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from kvgov.connectors.tiers.chain import TierChain
from kvgov.connectors.tiers.redis import IdleDeletion, RedisTier
from kvgov.db.models import CacheEntry
from kvgov.ledger.events import InMemoryEventSink
from kvgov.proxy import app as sidecar_app
from kvgov.proxy.app import SHARED_RECONCILE_TASK, Sidecar, build_sidecar
from kvgov.proxy.dataplane import upkeep
from kvgov.proxy.dataplane.index import EntryIndex
from kvgov.proxy.dataplane.records import Recorder
from kvgov.types import EntryState, EventKind, Outcome
from tests.security import doors
from tests.security.doors import key, run
from tests.security.test_tier_orphans import (
    ALICE,
    BOB,
    _age,
    _cli_verify,
    _client,
    _fleet_peer,
    _orphan_events,
    _redis,
)

pytestmark = pytest.mark.redis

#: the running sidecars' reconcile interval here (seconds)
INTERVAL_S = 0.2
#: how long a test waits for what a pass should do: a hundred intervals
PATIENCE_S = 20.0


def _tiers(redis_url: str, redis_prefix: str, interval_s: float = INTERVAL_S) -> dict[str, Any]:
    return {
        "chain": ["redis"],
        "redis_url": redis_url,
        "redis_prefix": redis_prefix,
        "shared_reconcile_interval_s": interval_s,
    }


def _passes(sc: Sidecar, outcome: str = "ok") -> float:
    labels = {"tier": "redis", "outcome": outcome}
    got = sc.metrics.registry.get_sample_value("kvgov_tiers_reconcile_passes_total", labels)
    return got or 0.0


def _reconcilers() -> list[asyncio.Task[Any]]:
    return [t for t in asyncio.all_tasks() if t.get_name() == SHARED_RECONCILE_TASK]


def _set_states(sc: Sidecar, states: dict[str, EntryState]) -> None:
    """What a purge or a deletion made elsewhere leaves in the ledger: the rows say so."""
    with Session(sc.engine) as session, session.begin():
        for digest, state in states.items():
            session.execute(
                update(CacheEntry).where(CacheEntry.key_digest == digest).values(state=state)
            )


@pytest.mark.postgres
async def test_values_erased_from_a_shared_redis_while_a_sidecar_runs_go_at_its_next_pass(
    tmp_path: Path, prod_db: doors.ProdDatabase, redis_url: str, redis_prefix: str
) -> None:
    """A sidecar runs. Another sidecar of the fleet puts entries (after this one loaded its
    index) and stops; then some of them are purged or deleted without this sidecar deleting
    their values (their Redis deletion failed, or no sidecar was there for it). Nothing
    touches the values since. Within an interval this sidecar deletes them and records each
    once; a live entry's value (its own, another sidecar's) and a value touched recently stay.
    """
    erased, dropped, young, theirs, ours = (key(c, "acme") for c in range(0x81, 0x86))
    value = os.urandom(20_000)
    client = _redis(redis_url)
    try:
        async with doors.tiered_sidecar(
            tmp_path / "s1", prod_db, _tiers(redis_url, redis_prefix)
        ) as sc:
            c = _client(sc.server.tcp_port)
            try:
                assert (await run(c.put, ours, value, ALICE)).ok
            finally:
                c.close()
            peer = _fleet_peer(sc.settings, tmp_path / "s2", shared_reconcile_interval_s=0)
            other = await build_sidecar(peer)
            await other.start()
            try:
                c2 = _client(other.server.tcp_port)
                try:
                    for k in (erased, dropped, young, theirs):
                        assert (await run(c2.put, k, value, BOB)).ok
                finally:
                    c2.close()
            finally:
                await other.stop()
            digest = sc.pipeline.pseudonymizer.key_digest
            gone = {digest(erased): EntryState.PURGED, digest(dropped): EntryState.DELETED}
            kept = [digest(k) for k in (young, theirs, ours)]
            sizes = {d: int(client.strlen(redis_prefix + d)) for d in gone}
            stored = {d: client.get(redis_prefix + d) for d in kept}
            assert all(sizes.values()) and all(stored.values()), "not stored in Redis"
            # while this sidecar runs, erased is purged and dropped deleted elsewhere (and so
            # is young, a moment ago); time passes: nothing touches the others
            _set_states(sc, {**gone, digest(young): EntryState.PURGED})
            for d in [*gone, digest(theirs), digest(ours)]:
                _age(client, redis_prefix + d)

            def left() -> list[str]:
                return [d for d in gone if client.exists(redis_prefix + d)]

            assert await doors.until(lambda: not left(), PATIENCE_S), (
                f"{len(left())} erased values still in the shared Redis after {PATIENCE_S} s "
                f"of a sidecar running with shared_reconcile_interval_s={INTERVAL_S}"
            )
            after = _passes(sc)
            assert await doors.until(lambda: _passes(sc) >= after + 2, PATIENCE_S), "no pass"
            for d in kept:  # a live entry's value (its own, another's) and a young one
                assert client.get(redis_prefix + d) == stored[d], "a value that is no orphan"
            recorded = _orphan_events(sc)
            principal = f"sidecar:{sc.settings.chain_id}"
            removed = sc.metrics.registry.get_sample_value(
                "kvgov_tiers_orphans_removed_total", {"tier": "redis"}
            )
            c = _client(sc.server.tcp_port)
            try:  # still serving its live entry
                got = await run(c.get, ours, ALICE)
                assert got is not None and got[0] == value
            finally:
                c.close()
            assert _reconcilers(), "no reconcile task while running"
            settings = sc.settings
        assert _reconcilers() == [], "stop() left the reconcile task running"
    finally:
        client.close()
    # each deletion recorded once, as at start, through the ledger
    assert sorted(e.key_digest for e in recorded) == sorted(gone)
    assert removed == len(gone)
    for e in recorded:
        assert e.kind == EventKind.KV_DELETE and e.reason == "orphan" and e.tier == "redis"
        assert e.outcome == Outcome.OK and e.principal == principal and e.tenant == "acme"
        assert e.actor is None and e.request_id is None
        assert e.nbytes == sizes[e.key_digest]
        assert e.attrs == {"entry_state": gone[e.key_digest], "removed_here": True}
    code, report = await run(_cli_verify, settings, peer)
    assert code == 0, report
    assert report["ok"] is True


@contextmanager
def _restricted_redis(
    redis_url: str, redis_prefix: str
) -> Iterator[tuple[str, Callable[..., Any]]]:
    """A Redis user of its own (the tests' prefix, every command): yields its URL and a way to
    change its rights (``ACL SETUSER``) while it is connected."""
    from urllib.parse import urlsplit, urlunsplit

    client = _redis(redis_url)
    user, password = f"kvgov-test-{os.urandom(4).hex()}", os.urandom(12).hex()
    client.execute_command(
        "ACL", "SETUSER", user, "on", f">{password}", f"~{redis_prefix}*", "+@all"
    )
    parts = urlsplit(redis_url)
    url = urlunsplit(parts._replace(netloc=f"{user}:{password}@{parts.hostname}:{parts.port}"))
    try:
        yield url, lambda *rules: client.execute_command("ACL", "SETUSER", user, *rules)
    finally:
        client.execute_command("ACL", "DELUSER", user)
        client.close()


async def _fails_then_recovers(
    sc: Sidecar,
    redis_url: str,
    redis_prefix: str,
    caplog: pytest.LogCaptureFixture,
    *,
    fail: Callable[[], Any],
    mend: Callable[[], Any],
    error: str,
) -> None:
    """While ``fail`` holds, passes fail: logged (the error class, never a key), counted, the
    orphan kept, the sidecar serving; after ``mend``, the next pass deletes and records it."""
    client = _redis(redis_url)
    try:
        assert await doors.until(lambda: _passes(sc) >= 1, PATIENCE_S), "no pass"
        fail()
        lost = "ef" * 32  # a put that crashed before it was recorded: no row at all
        client.set(redis_prefix + lost, b"x" * 1234, ex=3600)
        _age(client, redis_prefix + lost)
        failed = _passes(sc, "failed")
        assert await doors.until(lambda: _passes(sc, "failed") >= failed + 2, PATIENCE_S)
        assert client.exists(redis_prefix + lost)
        logged = [r for r in caplog.records if r.getMessage() == "tiers.reconcile.failed"]
        assert logged, "a failing pass was not logged"
        for r in logged:
            assert r.__dict__["tier"] == "redis" and r.__dict__["error"] == error
        mend()
        assert await doors.until(lambda: bool(_orphan_events(sc)), PATIENCE_S), (
            "the pass after a failing one did not reconcile"
        )
        assert [e.key_digest for e in _orphan_events(sc)] == [lost]
        assert not client.exists(redis_prefix + lost)
        assert _reconcilers(), "a failing pass ended the reconcile task"
        c = _client(sc.server.tcp_port)
        try:  # the sidecar still serves
            k = key(0x91, "acme")
            assert (await run(c.put, k, b"v" * 4096, ALICE)).ok
            got = await run(c.get, k, ALICE)
            assert got is not None and got[0] == b"v" * 4096
        finally:
            c.close()
    finally:
        client.close()
    for r in caplog.records:  # neither the key nor the Redis password in any log
        text = f"{r.getMessage()} {r.__dict__}"
        assert lost not in text and redis_prefix not in text


@pytest.mark.postgres
async def test_a_pass_failing_in_redis_is_logged_and_the_next_one_works(
    tmp_path: Path,
    prod_db: doors.ProdDatabase,
    redis_url: str,
    redis_prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Redis refuses the sidecar's scans for a while (its ACL: stands for Redis away)."""
    with (
        _restricted_redis(redis_url, redis_prefix) as (url, acl),
        caplog.at_level(logging.INFO, logger="kvgov"),
    ):
        async with doors.tiered_sidecar(tmp_path, prod_db, _tiers(url, redis_prefix)) as sc:
            await _fails_then_recovers(
                sc,
                redis_url,
                redis_prefix,
                caplog,
                fail=lambda: acl("-scan"),
                mend=lambda: acl("+scan"),
                error="TierError",
            )
        password = url.split("@", 1)[0].rsplit(":", 1)[1]
        assert all(password not in f"{r.getMessage()} {r.__dict__}" for r in caplog.records)


@pytest.mark.postgres
async def test_a_pass_whose_ledger_lookup_fails_is_logged_and_the_next_one_works(
    tmp_path: Path,
    prod_db: doors.ProdDatabase,
    redis_url: str,
    redis_prefix: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The ledger's lookup raises for a while (the database away)."""
    down = False
    real = sidecar_app.ledger_entries

    def lookup(engine: Any, digests: Sequence[str]) -> Any:
        if down:
            raise OperationalError("SELECT", {}, ConnectionRefusedError("stand-in: db away"))
        return real(engine, digests)

    def fail() -> None:
        nonlocal down
        down = True

    def mend() -> None:
        nonlocal down
        down = False

    monkeypatch.setattr(sidecar_app, "ledger_entries", lookup)
    with caplog.at_level(logging.INFO, logger="kvgov"):
        async with doors.tiered_sidecar(tmp_path, prod_db, _tiers(redis_url, redis_prefix)) as sc:
            await _fails_then_recovers(
                sc, redis_url, redis_prefix, caplog, fail=fail, mend=mend, error="OperationalError"
            )


@pytest.mark.postgres
async def test_no_reconcile_task_when_the_interval_is_zero(
    tmp_path: Path, prod_db: doors.ProdDatabase, redis_url: str, redis_prefix: str
) -> None:
    """``tiers.shared_reconcile_interval_s = 0``: shared tiers are reconciled at start only."""
    async with doors.tiered_sidecar(
        tmp_path, prod_db, _tiers(redis_url, redis_prefix, interval_s=0)
    ):
        assert _reconcilers() == []


class _HeldRedis(RedisTier):
    """A real Redis tier that stops right after a deletion, until released: a sidecar
    stopping at that moment cancels the pass between the deletion and its record."""

    deleted: asyncio.Event
    release: asyncio.Event

    async def delete_idle(self, keys: Sequence[str], min_idle_s: int) -> IdleDeletion:
        done = await super().delete_idle(keys, min_idle_s)
        self.deleted.set()
        await self.release.wait()
        return done


@pytest.mark.parametrize("one_each", [True, False], ids=["event", "past-the-cap-summary"])
async def test_a_pass_cancelled_after_a_deletion_records_it_first(
    redis_url: str, redis_prefix: str, monkeypatch: pytest.MonkeyPatch, one_each: bool
) -> None:
    """The sidecar stops (its tasks are cancelled) while a pass has deleted a value and not
    yet recorded it: the pass records it (its own event, or past the cap the summary that
    counts it), then ends."""
    if not one_each:
        monkeypatch.setattr(upkeep, "RECONCILE_RECORDED_MAX", 0)
    tier = await _HeldRedis.connect(redis_url, prefix=redis_prefix)
    tier.deleted, tier.release = asyncio.Event(), asyncio.Event()
    tiers = TierChain([tier])
    client = _redis(redis_url)
    try:
        orphan = "cd" * 32
        await tier.put(orphan, b"x" * 100)
        _age(client, redis_prefix + orphan)
        sink = InMemoryEventSink()
        task = asyncio.create_task(
            upkeep.reconcile_shared_every(
                INTERVAL_S, EntryIndex(), tiers, Recorder(sink), lookup=lambda _: {}, principal="t"
            )
        )
        await asyncio.wait_for(tier.deleted.wait(), PATIENCE_S)
        task.cancel()  # the sidecar stops: the value is gone, its record not written yet
        await asyncio.sleep(0)
        tier.release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not client.exists(redis_prefix + orphan)
        (event,) = sink.events
        assert event.kind is EventKind.KV_DELETE and event.reason == "orphan"
        if one_each:
            assert event.key_digest == orphan and event.nbytes == 100
        else:
            assert event.key_digest is None and event.attrs == {"orphans": 1}
    finally:
        client.close()
        await tiers.close()

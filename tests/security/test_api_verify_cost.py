"""Whole-ledger verification cannot be used to starve the sidecar (review r15, finding F1).

Attack: any auditor token, a tenant-scoped one included, kept ~40 ``GET /v1/audit/verify``
(or ``GET /dashboard``) in flight. Each ran a whole-ledger verification in one of the API's 40
anyio worker threads (the ones ``authenticate`` needs too) and held two connections of the
sidecar's own ledger pool (10 in all): the control plane stalled, the heartbeat's pool
checkout failed, the pod dropped out of the live set and purges created meanwhile skipped it
yet signed ``completed``. Now one verification runs at a time per process, on a thread and a
one-connection engine of its own; its report is kept ``api.verify_cache_s`` for every reader
(``api.verify_scoped_refresh_s`` for tenant-scoped ones), and callers in between share it.

The large ledger is stood in for by a gate inside the verification: deterministic, no timing
of real hashing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from prometheus_client import generate_latest
from sqlalchemy import Engine
from sqlalchemy.orm import Session

import kvgov.ledger.trust
import kvgov.ledger.verify
from kvgov.db.engine import make_engine
from kvgov.db.tokens import TokenRepository
from kvgov.proxy.api.app import ControlPlane, create_control_app
from kvgov.proxy.app import Sidecar, touch_sidecar
from kvgov.types import Role
from tests.security import doors
from tests.security.doors import run

pytestmark = pytest.mark.postgres

FLOOD = 45


def _token(sc: Sidecar, role: Role, tenant: str | None) -> dict[str, str]:
    with Session(sc.engine) as s:
        _, raw = TokenRepository(s).create(role, tenant=tenant)
        s.commit()
    return {"Authorization": f"Bearer {raw}"}


@asynccontextmanager
async def _client(
    sc: Sidecar, plane: ControlPlane | None = None
) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=create_control_app(plane or sc.control_plane()))
    async with httpx.AsyncClient(transport=transport, base_url="http://kvgov.test") as c:
        yield c


class Gate:
    """Stands in for a large ledger: every call of the wrapped function waits on the gate
    (at most ``hold_s``), counting how many wait at once."""

    def __init__(self, hold_s: float = 20.0) -> None:
        self.hold_s = hold_s
        self.running = self.peak = self.calls = 0
        self.engines: list[Engine] = []
        self.lock = threading.Lock()
        self.event = threading.Event()

    def wrap(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def gated(engine: Engine, *args: Any, **kwargs: Any) -> Any:
            with self.lock:
                self.running += 1
                self.calls += 1
                self.peak = max(self.peak, self.running)
                self.engines.append(engine)
            try:
                self.event.wait(self.hold_s)
                return real(engine, *args, **kwargs)
            finally:
                with self.lock:
                    self.running -= 1

        return gated


async def _flood(
    c: httpx.AsyncClient, path: str, headers: dict[str, str]
) -> list[asyncio.Task[httpx.Response]]:
    return [asyncio.create_task(c.get(path, headers=headers)) for _ in range(FLOOD)]


async def _drain(flood: list[asyncio.Task[httpx.Response]]) -> list[int | str]:
    done = await asyncio.wait_for(asyncio.gather(*flood, return_exceptions=True), 120)
    return [r.status_code if isinstance(r, httpx.Response) else type(r).__name__ for r in done]


async def test_a_scoped_auditor_cannot_run_verifications_in_parallel_nor_stall_admins(
    tmp_path: Path, prod_db: doors.ProdDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    """45 ``/v1/audit/verify`` of an acme-scoped auditor in flight: one verification runs,
    and a global admin's ``GET /v1/purges`` answers meanwhile (before: 40 ran at once, every
    anyio worker thread held, and the admin's request waited behind them)."""
    gate = Gate()
    monkeypatch.setattr(
        "kvgov.ledger.trust.verify_trusted", gate.wrap(kvgov.ledger.trust.verify_trusted)
    )
    async with doors.sidecar(tmp_path, prod_db) as sc:
        acme_auditor = _token(sc, Role.AUDITOR, "acme")
        admin = _token(sc, Role.ADMIN, None)
        async with _client(sc) as c:
            flood = await _flood(c, "/v1/audit/verify", acme_auditor)
            try:
                assert await doors.until(lambda: gate.running >= 1, 10)
                await asyncio.sleep(0.5)  # the flood's requests reach their verification
                t0 = time.monotonic()
                try:
                    r = await asyncio.wait_for(c.get("/v1/purges", headers=admin), 5)
                    status: int | None = r.status_code
                except TimeoutError:
                    status = None
                waited = time.monotonic() - t0
                peak = gate.peak
            finally:
                gate.event.set()
                codes = await _drain(flood)
    assert peak <= 1, f"one acme-scoped auditor ran {peak} whole-ledger verifications at once"
    assert status == 200 and waited < 2, (
        f"an admin's request waited {waited:.1f}s behind an auditor's verifications "
        f"(status {status})"
    )
    assert codes == [200] * FLOOD, codes
    assert gate.calls == 1, f"{gate.calls} verifications served {FLOOD} concurrent requests"


async def test_the_dashboard_shares_the_one_verification(
    tmp_path: Path, prod_db: doors.ProdDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``GET /dashboard`` floods (a scoped auditor's bearer token) join the same single flight
    as ``/v1/audit/verify``."""
    gate = Gate()
    monkeypatch.setattr(
        "kvgov.ledger.trust.verify_trusted", gate.wrap(kvgov.ledger.trust.verify_trusted)
    )
    async with doors.sidecar(tmp_path, prod_db) as sc:
        acme_auditor = _token(sc, Role.AUDITOR, "acme")
        fleet_auditor = _token(sc, Role.AUDITOR, None)
        async with _client(sc) as c:
            flood = await _flood(c, "/dashboard", acme_auditor)
            flood += await _flood(c, "/v1/audit/verify", fleet_auditor)
            try:
                assert await doors.until(lambda: gate.running >= 1, 10)
                await asyncio.sleep(0.5)
                peak = gate.peak
            finally:
                gate.event.set()
                codes = await _drain(flood)
    assert peak <= 1, f"dashboards and auditors ran {peak} whole-ledger verifications at once"
    assert codes == [200] * (2 * FLOOD), codes


async def test_verifications_never_take_the_sidecars_ledger_pool(
    tmp_path: Path, prod_db: doors.ProdDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a flood of verifications holds its connections (the gate sits inside each chain's
    walk), the sidecar's own pool keeps free connections: its heartbeat goes through at once,
    and the verification never checked out from the sidecar's engine (before: 10 flights took
    the whole pool and the heartbeat waited 30 s for a connection, then failed)."""
    gate = Gate()
    monkeypatch.setattr(
        kvgov.ledger.verify, "_verify_chain", gate.wrap(kvgov.ledger.verify._verify_chain)
    )
    async with doors.sidecar(tmp_path, prod_db) as sc:
        assert sc.engine is not None
        acme_auditor = _token(sc, Role.AUDITOR, "acme")
        async with _client(sc) as c:
            flood = await _flood(c, "/v1/audit/verify", acme_auditor)
            beat: asyncio.Future[None] | None = None
            try:
                assert await doors.until(lambda: gate.running >= 1, 10)
                await asyncio.sleep(0.5)
                held = sc.engine.pool.checkedout()  # type: ignore[attr-defined]
                beat = asyncio.ensure_future(
                    run(touch_sidecar, sc.engine, sc.sidecar_id, sc.settings.chain_id)
                )
                t0 = time.monotonic()
                done, _ = await asyncio.wait({beat}, timeout=5)
                beat_s = time.monotonic() - t0
                beat_ok = beat in done and beat.exception() is None
                sidecar_engine_used = any(e is sc.engine for e in gate.engines)
            finally:
                gate.event.set()
                codes = await _drain(flood)
                if beat is not None:
                    await asyncio.gather(beat, return_exceptions=True)
    assert not sidecar_engine_used, (
        "a whole-ledger verification checked out from the sidecar's own ledger pool"
    )
    assert beat_ok, (
        f"the auditor's verifications kept sidecar {sc.sidecar_id}'s heartbeat from the ledger "
        f"pool for {beat_s:.1f}s ({held} of its connections checked out): purges created "
        "now skip it"
    )
    assert codes == [200] * FLOOD, codes


async def test_authentication_does_not_wait_behind_busy_sync_routes(
    tmp_path: Path, prod_db: doors.ProdDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    """45 slow ``GET /v1/stats`` of an acme-scoped auditor hold every anyio worker thread; a
    global admin's dry-run purge (an async route) still authenticates and answers (before:
    ``authenticate`` queued for a worker thread behind them)."""
    import kvgov.ledger.queries_api

    gate = Gate()
    real = kvgov.ledger.queries_api.tenant_stats
    monkeypatch.setattr(
        kvgov.ledger.queries_api,
        "tenant_stats",
        gate.wrap(real),  # its first argument is the session, not an engine: only counted
    )
    async with doors.sidecar(tmp_path, prod_db) as sc:
        acme_auditor = _token(sc, Role.AUDITOR, "acme")
        admin = _token(sc, Role.ADMIN, None)
        async with _client(sc) as c:
            flood = await _flood(c, "/v1/stats", acme_auditor)
            try:
                assert await doors.until(lambda: gate.running >= 40, 10), gate.running
                t0 = time.monotonic()
                body = {"tenant": "acme", "user": "alice", "dry_run": True}
                try:
                    r = await asyncio.wait_for(c.post("/v1/purges", json=body, headers=admin), 5)
                    status: int | None = r.status_code
                except TimeoutError:
                    status = None
                waited = time.monotonic() - t0
            finally:
                gate.event.set()
                codes = await _drain(flood)
    assert status == 200 and waited < 2, (
        f"an admin's dry-run purge waited {waited:.1f}s for authentication behind an auditor's "
        f"slow reads (status {status})"
    )
    assert codes == [200] * FLOOD, codes


def _break_a_link(dsn: str, chain: str) -> None:
    """Point event 2's ``prev_hash`` at its own hash (the walk then looks the hash up: the
    nested query of ``_diagnose``)."""
    with psycopg.connect(dsn) as conn:
        conn.execute("SET session_replication_role = replica")  # no trigger fires
        conn.execute(
            "UPDATE ledger_events SET prev_hash = hash WHERE chain_id = %s AND seq = 2", (chain,)
        )


async def test_a_verification_needs_one_connection_at_a_time(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    """``verify_trusted`` over a one-connection pool, on a ledger whose broken link sends the
    walk to look the hash up: the same report as over a full pool (before: the outer
    connection stayed checked out over the chains' walk, and the walk's stream over the
    lookup, so a pool of one timed out)."""
    from kvgov.ledger.trust import trusted_keys, verify_trusted

    async with doors.sidecar(tmp_path, prod_db) as sc:
        assert sc.writer is not None
        await sc.writer.flush()
        chain = sc.settings.chain_id
        keys = trusted_keys(sc.settings)
    await run(_break_a_link, prod_db.superuser_dsn, chain)
    wide = make_engine(prod_db.url)
    one = make_engine(prod_db.url, pool_size=1, max_overflow=0, pool_timeout=3)
    try:
        expected = verify_trusted(wide, keys, expect_chains=(chain,)).to_dict()
        got = verify_trusted(one, keys, expect_chains=(chain,)).to_dict()
    finally:
        wide.dispose()
        one.dispose()
    mine = next(c for c in expected["chains"] if c["chain_id"] == chain)
    assert mine["ok"] is False, mine
    assert got == expected


# -- the cache -----------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@contextmanager
def _counting(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    calls = [0]
    real = kvgov.ledger.trust.verify_trusted

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr("kvgov.ledger.trust.verify_trusted", counted)
    yield calls


def _at(body: dict[str, Any]) -> datetime:
    return datetime.fromisoformat(body["verified_at"].replace("Z", "+00:00"))


async def test_the_report_is_kept_for_its_ttl_then_refreshed(
    tmp_path: Path, prod_db: doors.ProdDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Within ``verify_cache_s`` every reader gets the kept report (its ``verified_at``
    unchanged); after it a fleet-wide reader starts a fresh one; a tenant-scoped reader only
    after ``verify_scoped_refresh_s``. The counts show on ``/metrics``."""
    from kvgov.proxy.api.verifier import LedgerVerifier

    clock = Clock()
    with _counting(monkeypatch) as calls:
        async with doors.sidecar(tmp_path, prod_db) as sc:
            plane = sc.control_plane()
            assert plane.ledger is not None
            verifier = LedgerVerifier(cache_s=5, scoped_refresh_s=50, clock=clock)
            plane = dataclasses.replace(
                plane, ledger=dataclasses.replace(plane.ledger, verifier=verifier)
            )
            fleet = _token(sc, Role.AUDITOR, None)
            acme = _token(sc, Role.AUDITOR, "acme")
            async with _client(sc, plane) as c:

                async def verify(headers: dict[str, str]) -> dict[str, Any]:
                    r = await c.get("/v1/audit/verify", headers=headers)
                    assert r.status_code == 200, r.text
                    body: dict[str, Any] = r.json()
                    return body

                first = await verify(fleet)
                assert calls[0] == 1 and first["ok"] is True
                assert (await verify(fleet))["verified_at"] == first["verified_at"]
                scoped = await verify(acme)
                assert scoped["scope"] == "tenant" and scoped["verified_at"] == first["verified_at"]
                page = await c.get("/dashboard", headers=fleet)
                assert page.status_code == 200
                assert calls[0] == 1, "a reader within the TTL started another verification"

                clock.now += 6  # past verify_cache_s
                assert (await verify(acme))["verified_at"] == first["verified_at"]
                assert calls[0] == 1, "a tenant-scoped reader refreshed the kept report"
                second = await verify(fleet)
                assert calls[0] == 2 and _at(second) > _at(first)

                clock.now += 51  # past verify_scoped_refresh_s
                third = await verify(acme)
                assert calls[0] == 3 and _at(third) > _at(second)

                text = generate_latest(verifier.registry).decode()
    runs = re.search(r'kvgov_api_ledger_verifications_total\{outcome="ok"\} (\S+)', text)
    hits = re.search(r'kvgov_api_ledger_verify_requests_total\{served="cached"\} (\S+)', text)
    assert runs is not None and float(runs.group(1)) == 3, text
    assert hits is not None and float(hits.group(1)) == 4, text


async def test_the_sidecar_counts_verifications_on_metrics(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    """The sidecar's own verifier counts on its ``/metrics``."""
    async with doors.sidecar(tmp_path, prod_db) as sc:
        fleet = _token(sc, Role.AUDITOR, None)
        async with _client(sc) as c:
            assert (await c.get("/v1/audit/verify", headers=fleet)).status_code == 200
            assert (await c.get("/v1/audit/verify", headers=fleet)).status_code == 200
            text = (await c.get("/metrics", headers=fleet)).text
    assert 'kvgov_api_ledger_verifications_total{outcome="ok"} 1.0' in text, text
    assert 'kvgov_api_ledger_verify_requests_total{served="cached"} 1.0' in text, text

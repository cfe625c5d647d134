"""Tenant retention and TTL expiry, enforced by a real sidecar's sweeper through the purge's
one deletion path: entries past their tenant's retention (set with ``kvgov tenant retention``)
or past their TTL are deleted from every tier (memory, filesystem, Redis), verified gone,
recorded as ``kv:expired`` and no longer served; younger entries stay, byte for byte. Run on
SQLite and Postgres. The API's ``PUT /v1/tenants/{tenant}/retention`` is admins' only and
scoped like every route."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
import typer
from typer.testing import CliRunner

from kvgov.cli import tenant as tenant_cli
from kvgov.config import Settings
from kvgov.db.engine import make_engine, utcnow
from kvgov.db.models import CacheEntry, LedgerEvent, Tenant, table
from kvgov.ledger.verify import verify
from kvgov.policy.cache import CachingPolicyEngine
from kvgov.policy.embedded import EmbeddedPolicyEngine
from kvgov.proxy.app import Sidecar, build_sidecar
from kvgov.types import EntryState, EventKind
from kvgov.wire import RequestContext, WireClient
from tests.integration.test_api_support import ApiWorld, api_world, bearer

pytestmark = pytest.mark.redis


def _key(i: int) -> str:
    return f"m@1@0@{i:016x}@bfloat16@tenant%demo@user%u1"


@pytest.fixture
async def sidecar(
    db_url: str, tmp_path: Path, redis_url: str, redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Sidecar]:
    settings = Settings(
        data_dir=tmp_path / "data",
        database={"url": db_url},
        ledger={"chain_id": "retention-node"},
        dataplane={"host": "127.0.0.1", "port": 0, "lm_port": -1},
        tiers={
            "chain": ["memory", "filesystem", "redis"],
            "filesystem_path": tmp_path / "fs",
            "redis_url": redis_url,
            "redis_prefix": redis_prefix,
            "sweep_interval_s": 3600.0,  # the test sweeps itself
        },
    )
    sc = await build_sidecar(
        settings, policy=CachingPolicyEngine(EmbeddedPolicyEngine.from_paths())
    )
    await sc.start()
    # the CLI reads the same settings from the environment
    monkeypatch.setenv("KVGOV_DATABASE__URL", db_url)
    monkeypatch.setenv("KVGOV_DATA_DIR", str(settings.data_dir))
    monkeypatch.setenv("KVGOV_LEDGER__CHAIN_ID", "retention-cli")
    try:
        yield sc
    finally:
        await sc.stop()


def _cli(*args: str) -> tuple[int, str]:
    app = typer.Typer()

    @app.callback()
    def _root() -> None: ...

    tenant_cli.register(app)
    result = CliRunner().invoke(app, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


def _digests(sc: Sidecar, keys: list[str]) -> list[str]:
    return [sc.pipeline.pseudonymizer.key_digester.digest(k) for k in keys]


async def _held(sc: Sidecar, digests: list[str]) -> dict[str, int]:
    return {t.name: sum([await t.contains(d) for d in digests]) for t in sc.tiers.tiers}


def _expired_events(engine: sa.Engine) -> list[tuple[str | None, str | None]]:
    t = table(LedgerEvent)
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(t.c.key_digest, t.c.reason).where(t.c.kind == str(EventKind.KV_EXPIRED))
        ).all()
    return [(r[0], r[1]) for r in rows]


async def test_sweeper_deletes_entries_past_retention_and_ttl_from_every_tier(
    sidecar: Sidecar, db_url: str
) -> None:
    sc = sidecar
    assert sc.server.tcp_port is not None
    client = WireClient(f"tcp://127.0.0.1:{sc.server.tcp_port}", engine_id="e1")
    ctx = RequestContext(request_id="req-ret", user="u1")
    values = {i: os.urandom(50_000 + i) for i in range(6)}
    old, young, ttl = [0, 1, 2], [3, 4], [5]
    engine = make_engine(db_url)
    try:
        for i, v in values.items():
            assert (await asyncio.to_thread(client.put, _key(i), v, ctx)).ok
        await sc.writer.flush()
        all_d = _digests(sc, [_key(i) for i in values])
        old_d, young_d = [all_d[i] for i in old], [all_d[i] for i in young]
        ttl_d = [all_d[i] for i in ttl]
        assert await _held(sc, all_d) == {"memory": 6, "filesystem": 6, "redis": 6}

        code, out = await asyncio.to_thread(
            _cli, "tenant", "retention", "demo", "--seconds", "3600"
        )
        assert code == 0, out
        with engine.begin() as conn:  # age three entries past it, and one past its TTL
            ce = table(CacheEntry)
            past = utcnow() - timedelta(hours=2)
            conn.execute(sa.update(ce).where(ce.c.key_digest.in_(old_d)).values(created_at=past))
            conn.execute(sa.update(ce).where(ce.c.key_digest.in_(ttl_d)).values(expires_at=past))

        await sc.sweep()

        assert await _held(sc, old_d + ttl_d) == {"memory": 0, "filesystem": 0, "redis": 0}
        assert await _held(sc, young_d) == {"memory": 2, "filesystem": 2, "redis": 2}
        for i in old + ttl:  # no longer served
            assert await asyncio.to_thread(client.get, _key(i), ctx) is None
        for i in young:
            got = await asyncio.to_thread(client.get, _key(i), ctx)
            assert got is not None and got[0] == values[i]
        await sc.writer.flush()
        recorded = sorted(_expired_events(engine))
        assert recorded == sorted([(d, "retention") for d in old_d] + [(d, "ttl") for d in ttl_d])
        with engine.connect() as conn:
            ce = table(CacheEntry)
            states = dict(conn.execute(sa.select(ce.c.key_digest, ce.c.state)).all())
        assert {d: states[d] for d in old_d + ttl_d} == dict.fromkeys(
            old_d + ttl_d, str(EntryState.EXPIRED)
        )
        assert {states[d] for d in young_d} == {str(EntryState.LIVE)}

        await sc.sweep()  # idempotent: nothing more is due, nothing recorded twice
        await sc.writer.flush()
        assert len(_expired_events(engine)) == 4
        t = table(LedgerEvent)
        with engine.connect() as conn:
            setting = conn.execute(
                sa.select(t.c.tenant, t.c.attrs).where(
                    t.c.kind == str(EventKind.TENANT_RETENTION_SET)
                )
            ).all()
            tenant = conn.execute(sa.select(table(Tenant))).all()
        assert [(r[0], r[1]) for r in setting] == [("demo", {"retention_s": 3600})]
        assert [(r.id, r.retention_s) for r in tenant] == [("demo", 3600)]
        assert (await asyncio.to_thread(verify, engine)).ok
    finally:
        client.close()
        engine.dispose()


def test_cli_refuses_bad_retention(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGOV_DATA_DIR", str(tmp_path))
    assert _cli("tenant", "retention", "demo")[0] == 2  # neither --seconds nor --clear
    assert _cli("tenant", "retention", "demo", "--seconds", "0")[0] == 2
    assert _cli("tenant", "retention", "../etc", "--seconds", "60")[0] == 2


@pytest.fixture
def world(pg_url: str, tmp_path: Path) -> Iterator[ApiWorld]:
    with api_world(pg_url, tmp_path, seed=False) as w:
        yield w


@pytest.mark.postgres
async def test_api_sets_retention_for_admins_of_that_tenant_only(world: ApiWorld) -> None:
    transport = httpx.ASGITransport(app=world.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://kvgov.test") as c:
        body = {"retention_s": 600}
        r = await c.put(
            "/v1/tenants/acme/retention", json=body, headers=bearer(world.tokens.auditor)
        )
        assert r.status_code == 403
        r = await c.put(
            "/v1/tenants/globex/retention", json=body, headers=bearer(world.tokens.admin_acme)
        )
        assert r.status_code == 403
        r = await c.put(
            "/v1/tenants/acme/retention",
            json={"retention_s": 0},
            headers=bearer(world.tokens.admin),
        )
        assert r.status_code == 422
        r = await c.put(
            "/v1/tenants/acme/retention", json=body, headers=bearer(world.tokens.admin_acme)
        )
        assert r.status_code == 200, r.text
        assert r.json()["retention_s"] == 600
        r = await c.get("/v1/tenants", headers=bearer(world.tokens.auditor_acme))
        assert [(t["id"], t["retention_s"]) for t in r.json()] == [("acme", 600)]
        r = await c.get("/v1/tenants/acme", headers=bearer(world.tokens.auditor))
        assert r.json()["retention_s"] == 600
    t = table(LedgerEvent)
    with world.engine.connect() as conn:
        rows = conn.execute(
            sa.select(t.c.tenant, t.c.attrs).where(t.c.kind == str(EventKind.TENANT_RETENTION_SET))
        ).all()
    assert [(r[0], r[1]) for r in rows] == [("acme", {"retention_s": 600})]

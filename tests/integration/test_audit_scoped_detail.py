"""Per-chain ledger detail is for fleet-wide readers only.

Attack: chains are per sidecar, shared by every tenant, so a chain's event count, head and
checkpoints move with every tenant's traffic. ``/v1/audit/verify``, ``/v1/audit/checkpoints``
and the dashboard's integrity table showed them to tenant-scoped tokens, so acme could watch
globex's cache activity by polling (the reason ``/metrics`` refuses scoped tokens). Now a
scoped caller gets the verdict only, an empty checkpoint page and no chain table; tokens that
are not tenant-scoped keep the full detail.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import text

from kvgov.db.engine import make_engine
from kvgov.ledger.events import Event
from kvgov.types import EventKind
from tests.integration.test_api_support import ApiWorld, api_world, bearer

pytestmark = pytest.mark.postgres

SCOPED = ("auditor_acme", "admin_acme")
FLEET = ("auditor", "admin")
#: what only per-chain detail carries
CHAIN_FIELDS = ("events", "head_seq", "head_hash", "checkpoints", "last_checkpoint_seq", "position")


@pytest.fixture
def world(pg_url: str, tmp_path: Path) -> Iterator[ApiWorld]:
    # every verification here must see the traffic or the tampering just made: no report is
    # served again (what is kept, and for whom: tests/security/test_api_verify_cost.py)
    fresh = {"verify_cache_s": 0, "verify_scoped_refresh_s": 0}
    with api_world(pg_url, tmp_path, api=fresh) as w:
        yield w


@pytest.fixture
async def client(world: ApiWorld) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=world.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://kvgov.test") as c:
        yield c


async def _globex_traffic(world: ApiWorld, n: int = 3) -> None:
    """Another tenant's cache misses on the shared chain, then a signed checkpoint."""
    for i in range(n):
        await world.writer.run_async(
            world.writer.writer.append(
                Event(kind=EventKind.KV_MISS, tenant="globex", request_id=f"globex-{i}")
            )
        )
    await world.writer.write_checkpoint()


async def _verify(client: httpx.AsyncClient, token: str) -> dict[str, Any]:
    r = await client.get("/v1/audit/verify", headers=bearer(token))
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


async def _checkpoints(client: httpx.AsyncClient, token: str, **params: Any) -> dict[str, Any]:
    r = await client.get("/v1/audit/checkpoints", params=params, headers=bearer(token))
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def _no_chain_detail(body: dict[str, Any], raw: str) -> None:
    assert "chains" not in body, body
    assert body["scope"] == "tenant"
    for name in CHAIN_FIELDS:
        assert f'"{name}"' not in raw, name
    for chain in ("seed-node", "api-node"):
        assert chain not in raw


@pytest.mark.parametrize("who", SCOPED)
async def test_a_scoped_token_cannot_watch_another_tenants_traffic(
    world: ApiWorld, client: httpx.AsyncClient, who: str
) -> None:
    token = getattr(world.tokens, who)
    fleet = world.tokens.auditor
    before = await _verify(client, token)
    fleet_before = await _verify(client, fleet)
    fleet_cps_before = (await _checkpoints(client, fleet))["items"]

    await _globex_traffic(world)

    after = await _verify(client, token)
    raw = (await client.get("/v1/audit/verify", headers=bearer(token))).text
    _no_chain_detail(after, raw)
    assert after["ok"] is True and after["problems"] == []
    assert after["trusted_keys"] == fleet_before["trusted_keys"]
    assert {k: v for k, v in after.items() if k != "verified_at"} == {
        k: v for k, v in before.items() if k != "verified_at"
    }
    for params in ({}, {"chain_id": world.writer.chain_id}, {"limit": 1}):
        page = await _checkpoints(client, token, **params)
        assert page["items"] == [] and page["next"] is None, params

    # a reader that is not tenant-scoped still sees the chains move
    fleet_after = await _verify(client, fleet)
    events = {c["chain_id"]: c["events"] for c in fleet_after["chains"]}
    events_before = {c["chain_id"]: c["events"] for c in fleet_before["chains"]}
    assert events[world.writer.chain_id] >= events_before.get(world.writer.chain_id, 0) + 3
    fleet_cps = (await _checkpoints(client, fleet))["items"]
    assert len(fleet_cps) > len(fleet_cps_before)
    assert world.writer.chain_id in {cp["chain_id"] for cp in fleet_cps}


@pytest.mark.parametrize("who", FLEET)
async def test_fleet_readers_keep_the_full_detail(
    world: ApiWorld, client: httpx.AsyncClient, who: str
) -> None:
    token = getattr(world.tokens, who)
    body = await _verify(client, token)
    seed = next(c for c in body["chains"] if c["chain_id"] == "seed-node")
    assert seed["events"] == 19 and seed["checkpoints"] == 1 and seed["head_seq"] == 19
    assert "scope" not in body
    cps = (await _checkpoints(client, token))["items"]
    assert any(cp["chain_id"] == "seed-node" and cp["seq"] == 19 for cp in cps)
    # the same moment, asked by a scoped token: the verdict only
    scoped = await _verify(client, world.tokens.auditor_acme)
    assert scoped["ok"] == body["ok"] and "chains" not in scoped
    assert (await _checkpoints(client, world.tokens.auditor_acme))["items"] == []


async def test_a_broken_ledger_is_reported_to_a_scoped_token_without_positions(
    world: ApiWorld, client: httpx.AsyncClient, pg_url: str
) -> None:
    admin = make_engine(pg_url)
    try:
        with admin.begin() as conn:
            conn.execute(text("ALTER TABLE ledger_events DISABLE TRIGGER ALL"))
            conn.execute(
                text(
                    "UPDATE ledger_events SET nbytes = 999999 "
                    "WHERE chain_id = 'seed-node' AND seq = 5"
                )
            )
            conn.execute(text("ALTER TABLE ledger_events ENABLE TRIGGER ALL"))
    finally:
        admin.dispose()
    r = await client.get("/v1/audit/verify", headers=bearer(world.tokens.auditor_acme))
    scoped = r.json()
    assert scoped["ok"] is False
    # one generic line: no chain, position or count of what the database holds
    assert len(scoped["problems"]) == 1, scoped
    assert not re.search(r"\d|seed-node|api-node", scoped["problems"][0])
    _no_chain_detail(scoped, r.text)
    assert "modified" not in r.text
    fleet = await _verify(client, world.tokens.auditor)
    seed = next(c for c in fleet["chains"] if c["chain_id"] == "seed-node")
    assert fleet["ok"] is False and seed["position"] == 5 and seed["problem"] == "modified"


def _chain_events(html: str) -> dict[str, str]:
    return dict(re.findall(r'data-chain-events="([^"]+)">(\d+)<', html))


async def test_the_dashboard_shows_a_scoped_session_the_verdict_only(
    world: ApiWorld, client: httpx.AsyncClient
) -> None:
    login = await client.post("/dashboard/login", data={"token": world.tokens.auditor_acme})
    assert login.status_code == 303
    cookie = login.headers["set-cookie"].split(";")[0].split("=", 1)[1]
    client.cookies.clear()
    session = {"Cookie": f"kvgov_dashboard={cookie}"}

    async def pages() -> tuple[str, str]:
        scoped = await client.get("/dashboard", headers=session)
        fleet = await client.get("/dashboard", headers=bearer(world.tokens.auditor))
        assert scoped.status_code == 200 and fleet.status_code == 200
        return scoped.text, fleet.text

    scoped_before, fleet_before = await pages()
    await _globex_traffic(world)
    scoped_after, fleet_after = await pages()

    for html in (scoped_before, scoped_after):
        assert 'data-integrity="ok"' in html
        assert _chain_events(html) == {}
        assert 'data-chain-detail="withheld"' in html
        assert "seed-node" not in html and "api-node" not in html
    chain = world.writer.chain_id
    assert _chain_events(fleet_before)["seed-node"] == "19"
    assert (
        int(_chain_events(fleet_after)[chain])
        >= int(_chain_events(fleet_before).get(chain, "0")) + 3
    )
    assert 'data-chain-detail="withheld"' not in fleet_after

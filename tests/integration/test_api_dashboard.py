"""The /dashboard page over HTTP: sign-in flow, cookie safety, what it shows, who may see it."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from kvgov.proxy.api.auth import issue_session, read_session
from tests.integration.test_api_support import ApiWorld, api_world, bearer

pytestmark = pytest.mark.postgres


@pytest.fixture
def world(pg_url: str, tmp_path: Path) -> Iterator[ApiWorld]:
    with api_world(pg_url, tmp_path) as w:
        yield w


@pytest.fixture
async def client(world: ApiWorld) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=world.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://kvgov.test") as c:
        yield c


def _stat(html: str, tenant: str, name: str) -> str:
    row = re.search(rf'<tr data-tenant="{tenant}">(.*?)</tr>', html, re.S)
    assert row, tenant
    cell = re.search(rf'data-stat="{name}"[^>]*>(.*?)</', row.group(1), re.S)
    assert cell, (tenant, name)
    return re.sub(r"<[^>]+>", "", cell.group(1)).strip()


async def test_without_credentials_the_sign_in_form_is_shown(client: httpx.AsyncClient):
    r = await client.get("/dashboard")
    assert r.status_code == 401
    assert 'action="/dashboard/login"' in r.text and 'type="password"' in r.text
    assert "default-src 'none'" in r.headers["content-security-policy"]
    assert r.headers["cache-control"] == "no-store"
    assert r.headers["x-frame-options"] == "DENY"


async def test_sign_in_sets_a_safe_session_cookie_and_shows_the_page(
    world: ApiWorld, client: httpx.AsyncClient
):
    r = await client.post("/dashboard/login", data={"token": world.tokens.auditor})
    assert r.status_code == 303 and r.headers["location"] == "/dashboard"
    cookie = r.headers["set-cookie"]
    for flag in ("HttpOnly", "Path=/dashboard", "SameSite=strict", "Max-Age=28800"):
        assert flag.lower() in cookie.lower()
    value = cookie.split(";")[0].split("=", 1)[1]
    assert world.tokens.auditor not in cookie  # the cookie names the token, never holds it
    assert read_session(world.ctx.session_secret, value) == world.tokens.auditor_id

    page = await client.get("/dashboard", headers={"Cookie": f"kvgov_dashboard={value}"})
    assert page.status_code == 200
    html = page.text
    for heading in ("Ledger integrity", "Tenants", "Recent denials", "Erasure requests"):
        assert heading in html
    assert 'data-integrity="ok"' in html
    assert _stat(html, "acme", "entries") == "4"
    assert _stat(html, "acme", "hit_rate") == "75.0%"
    assert _stat(html, "globex", "misses") == "2"
    assert "cross_user_scope" in html  # the recent denial
    for raw in world.seeded.users:
        assert raw not in html

    out = await client.post("/dashboard/logout")
    assert out.status_code == 303 and 'kvgov_dashboard=""' in out.headers["set-cookie"]


async def test_bad_tokens_and_engine_tokens_cannot_sign_in(
    world: ApiWorld, client: httpx.AsyncClient
):
    bad = await client.post("/dashboard/login", data={"token": "kvgov_nope"})
    assert bad.status_code == 401 and "not valid" in bad.text and "set-cookie" not in bad.headers
    revoked = await client.post("/dashboard/login", data={"token": world.tokens.revoked})
    assert revoked.status_code == 401
    engine = await client.post("/dashboard/login", data={"token": world.tokens.engine})
    assert engine.status_code == 403 and "set-cookie" not in engine.headers
    assert (await client.get("/dashboard", headers=bearer(world.tokens.engine))).status_code == 403


async def test_forged_expired_or_revoked_sessions_are_refused(
    world: ApiWorld, client: httpx.AsyncClient
):
    secret = world.ctx.session_secret
    forged = issue_session(b"x" * 32, world.tokens.admin_id)
    expired = issue_session(secret, world.tokens.auditor_id, now=0)
    for value in (forged, expired, "garbage", "a.b"):
        r = await client.get("/dashboard", headers={"Cookie": f"kvgov_dashboard={value}"})
        assert r.status_code == 401
    # a signed cookie with no open server-side session opens nothing
    unsigned_in = issue_session(secret, world.tokens.auditor_id, session_id="never-opened")
    r = await client.get("/dashboard", headers={"Cookie": f"kvgov_dashboard={unsigned_in}"})
    assert r.status_code == 401
    # revoking the token ends its sessions
    login = await client.post("/dashboard/login", data={"token": world.tokens.auditor})
    good = login.headers["set-cookie"].split(";")[0].split("=", 1)[1]
    client.cookies.clear()
    ok = await client.get("/dashboard", headers={"Cookie": f"kvgov_dashboard={good}"})
    assert ok.status_code == 200
    await client.delete(f"/v1/tokens/{world.tokens.auditor_id}", headers=bearer(world.tokens.admin))
    gone = await client.get("/dashboard", headers={"Cookie": f"kvgov_dashboard={good}"})
    assert gone.status_code == 401


async def test_a_tenant_scoped_token_sees_only_its_tenant(
    world: ApiWorld, client: httpx.AsyncClient
):
    html = (await client.get("/dashboard", headers=bearer(world.tokens.auditor_acme))).text
    assert 'data-tenant="acme"' in html
    assert 'data-tenant="globex"' not in html


async def test_static_css_is_served(client: httpx.AsyncClient):
    r = await client.get("/dashboard/static/dashboard.css")
    assert r.status_code == 200 and ".badge.ok" in r.text

"""The auth matrix on a real Postgres ledger: no token -> 401, wrong role or tenant -> 403,
right role -> 200/201/204; tokens are stored hashed; auth off only in development."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from kvgov.db.models import ApiToken
from tests.integration.test_api_support import ApiWorld, api_world, bearer

pytestmark = pytest.mark.postgres

READS = [
    "/v1/entries",
    "/v1/entries?tenant=acme",
    "/v1/requests/req-a2/provenance",
    "/v1/users/alice@acme.example/footprint?tenant=acme",
    "/v1/decisions",
    "/v1/audit/verify",
    "/v1/audit/checkpoints",
    "/v1/stats",
    "/v1/tenants/acme/stats",
    "/v1/purges",
    "/v1/purges?tenant=acme&state=completed",
    "/v1/purges/{acme_purge}",
    "/v1/purges/{acme_purge}/receipt",
    "/v1/keys",
    "/v1/keys?tenant=acme",
]
ADMIN_ONLY = [("GET", "/v1/tokens"), ("POST", "/v1/tokens")]
#: admin routes a tenant-scoped admin may use for its own tenant (the bodies name acme)
TENANT_ADMIN = [("POST", "/v1/keys/rotate"), ("POST", "/v1/purges")]
ALL = [("GET", p) for p in READS] + ADMIN_ONLY + TENANT_ADMIN
BODIES = {
    "/v1/tokens": {"role": "auditor"},
    "/v1/keys/rotate": {"tenant": "acme"},
    "/v1/purges": {"tenant": "acme", "user": "bob@acme.example", "dry_run": True},
}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiWorld]:
    # one seeded database for the whole matrix (the matrix only reads, and creates tokens)
    from tests.conftest import create_pg_database, drop_pg_database

    name, url = create_pg_database()
    try:
        with api_world(url, tmp_path_factory.mktemp("auth")) as w:
            # one finished purge (signed receipt) per tenant, for the purge routes
            w.ids = {
                "acme_purge": asyncio.run(w.purge("acme", "alice@acme.example")).id,
                "globex_purge": asyncio.run(w.purge("globex", "carol@globex.example")).id,
            }
            yield w
    finally:
        drop_pg_database(name)


@pytest.fixture
async def client(world: ApiWorld) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=world.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://kvgov.test") as c:
        c.ids = world.ids  # type: ignore[attr-defined]  # the seeded purge ids, for _call
        yield c


async def _call(client: httpx.AsyncClient, method: str, path: str, token: str | None):
    headers = bearer(token) if token else {}
    path = path.format(**getattr(client, "ids", {}))
    if method == "POST":
        return await client.post(path, json=BODIES[path], headers=headers)
    return await client.get(path, headers=headers)


def _problem(r: httpx.Response, status: int) -> None:
    assert r.status_code == status, (r.request.url, r.text)
    assert r.headers["content-type"] == "application/problem+json"
    assert r.json()["status"] == status


@pytest.mark.parametrize(("method", "path"), ALL)
async def test_no_token_is_401(client: httpx.AsyncClient, method: str, path: str):
    r = await _call(client, method, path, None)
    _problem(r, 401)
    assert r.headers["www-authenticate"].startswith("Bearer")
    assert r.json()["code"] == "unauthenticated"


@pytest.mark.parametrize(("method", "path"), ALL)
@pytest.mark.parametrize("bad", ["kvgov_not-a-real-token", "garbage", "revoked", "Basic"], ids=str)
async def test_unknown_revoked_or_malformed_credentials_are_401(
    world: ApiWorld, client: httpx.AsyncClient, method: str, path: str, bad: str
):
    if bad == "revoked":
        r = await _call(client, method, path, world.tokens.revoked)
    elif bad == "Basic":
        r = await client.request(
            method, path.format(**world.ids), headers={"Authorization": "Basic YWxhZGRpbg=="}
        )
    else:
        r = await _call(client, method, path, bad)
    _problem(r, 401)


@pytest.mark.parametrize(("method", "path"), ALL)
async def test_engine_tokens_are_refused_on_the_api(
    world: ApiWorld, client: httpx.AsyncClient, method: str, path: str
):
    r = await _call(client, method, path, world.tokens.engine)
    _problem(r, 403)
    assert r.json()["code"] == "forbidden"


@pytest.mark.parametrize("path", READS)
@pytest.mark.parametrize("who", ["auditor", "admin", "auditor_acme", "admin_acme"])
async def test_readers_read(world: ApiWorld, client: httpx.AsyncClient, path: str, who: str):
    r = await _call(client, "GET", path, getattr(world.tokens, who))
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(("method", "path"), ADMIN_ONLY)
@pytest.mark.parametrize("who", ["auditor", "auditor_acme", "admin_acme"])
async def test_token_management_needs_a_global_admin(
    world: ApiWorld, client: httpx.AsyncClient, method: str, path: str, who: str
):
    _problem(await _call(client, method, path, getattr(world.tokens, who)), 403)


@pytest.mark.parametrize(("method", "path"), TENANT_ADMIN)
@pytest.mark.parametrize("who", ["auditor", "auditor_acme"])
async def test_purging_and_rotating_keys_need_an_admin(
    world: ApiWorld, client: httpx.AsyncClient, method: str, path: str, who: str
):
    _problem(await _call(client, method, path, getattr(world.tokens, who)), 403)


@pytest.mark.parametrize(("method", "path"), TENANT_ADMIN)
@pytest.mark.parametrize("who", ["admin", "admin_acme"])
async def test_admins_purge_and_rotate_their_tenants(
    world: ApiWorld, client: httpx.AsyncClient, method: str, path: str, who: str
):
    r = await _call(client, method, path, getattr(world.tokens, who))
    assert r.status_code == 200, r.text  # a dry-run purge and a rotation both answer 200


@pytest.mark.parametrize(("method", "path"), TENANT_ADMIN)
async def test_tenant_scoped_admins_cannot_act_on_other_tenants(
    world: ApiWorld, client: httpx.AsyncClient, method: str, path: str
):
    other = {**BODIES[path], "tenant": "globex"}
    _problem(await client.post(path, json=other, headers=bearer(world.tokens.admin_acme)), 403)


@pytest.mark.parametrize(
    ("method", "path", "status"), [("GET", "/v1/tokens", 200), ("POST", "/v1/tokens", 201)]
)
async def test_global_admin_manages_tokens(
    world: ApiWorld, client: httpx.AsyncClient, method: str, path: str, status: int
):
    r = await _call(client, method, path, world.tokens.admin)
    assert r.status_code == status, r.text


@pytest.mark.parametrize(
    "path",
    [
        "/v1/entries?tenant=globex",
        "/v1/decisions?tenant=globex",
        "/v1/stats?tenant=globex",
        "/v1/tenants/globex/stats",
        "/v1/users/carol@globex.example/footprint?tenant=globex",
        "/v1/requests/req-g2/provenance?tenant=globex",
        "/v1/purges?tenant=globex",
        "/v1/purges/{globex_purge}",
        "/v1/purges/{globex_purge}/receipt",
        "/v1/keys?tenant=globex",
    ],
)
@pytest.mark.parametrize("who", ["auditor_acme", "admin_acme"])
async def test_tenant_scoped_tokens_cannot_see_other_tenants(
    world: ApiWorld, client: httpx.AsyncClient, path: str, who: str
):
    _problem(await _call(client, "GET", path, getattr(world.tokens, who)), 403)


@pytest.mark.parametrize(
    ("path", "key"),
    [
        ("/v1/entries", "items"),
        ("/v1/decisions", "items"),
        ("/v1/stats", "tenants"),
        ("/v1/purges", "items"),
    ],
)
async def test_tenant_scoped_lists_are_forced_to_their_tenant(
    world: ApiWorld, client: httpx.AsyncClient, path: str, key: str
):
    scoped = (await _call(client, "GET", path, world.tokens.auditor_acme)).json()[key]
    everything = (await _call(client, "GET", path, world.tokens.auditor)).json()[key]
    assert scoped and {i["tenant"] for i in scoped} == {"acme"}
    assert {i["tenant"] for i in everything} == {"acme", "globex"}


async def test_the_dashboard_cookie_is_not_accepted_by_the_api(
    world: ApiWorld, client: httpx.AsyncClient
):
    login = await client.post("/dashboard/login", data={"token": world.tokens.auditor})
    assert login.status_code == 303
    set_cookie = login.headers["set-cookie"]
    assert set_cookie.startswith("kvgov_dashboard=")
    cookie = set_cookie.split(";")[0].split("=", 1)[1]
    r = await client.get("/v1/stats", headers={"Cookie": f"kvgov_dashboard={cookie}"})
    _problem(r, 401)


def test_tokens_are_stored_only_as_sha256(world: ApiWorld):
    with world.engine.connect() as conn:
        hashes = set(conn.execute(select(ApiToken.token_hash)).scalars())
    for token in (world.tokens.admin, world.tokens.auditor, world.tokens.engine):
        assert hashlib.sha256(token.encode()).hexdigest() in hashes
        assert token not in hashes


@pytest.fixture
def open_world(pg_url: str, tmp_path: Path) -> Iterator[ApiWorld]:
    with api_world(pg_url, tmp_path, auth=False, seed=False) as w:
        yield w


async def test_auth_can_be_switched_off_in_development_only(open_world: ApiWorld):
    transport = httpx.ASGITransport(app=open_world.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://kvgov.test") as c:
        assert (await c.get("/v1/stats")).status_code == 200
    from kvgov.config import Settings

    with pytest.raises(ValueError, match=r"api\.auth=false"):
        Settings(environment="production", api={"auth": False})

"""Dashboard sign-in and sign-out refuse cross-site requests (login CSRF).

Attack: ``POST /dashboard/login`` took any form post, so a page on another site could auto-submit
the attacker's own token and sign the visitor's browser into the attacker's session
(``SameSite=Strict`` stops a cookie being *sent* cross-site, not being *set* by the answer to a
top-level cross-site POST). Now a POST whose ``Sec-Fetch-Site`` is present and not
``same-origin``/``none``, or whose ``Origin`` is present and not the server's own origin, is
refused with 403 and no cookie and no server-side session; one with neither header (curl,
scripts) is still allowed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from kvgov.db.models import DashboardSession
from tests.integration.test_api_support import ApiWorld, api_world

pytestmark = pytest.mark.postgres

BASE = "http://kvgov.test"
COOKIE = "kvgov_dashboard"
FORM = {"Content-Type": "application/x-www-form-urlencoded"}

CROSS_SITE = {
    "foreign origin": {"Origin": "https://evil.example"},
    "cross-site fetch": {"Sec-Fetch-Site": "cross-site"},
    "same-site fetch": {"Sec-Fetch-Site": "same-site"},
    "browser navigation from evil": {
        "Origin": "https://evil.example",
        "Sec-Fetch-Site": "cross-site",
        "Sec-Fetch-Mode": "navigate",
    },
    "opaque origin": {"Origin": "null"},
    "other scheme": {"Origin": "https://kvgov.test"},
    "other port": {"Origin": "http://kvgov.test:8080"},
    "sibling host": {"Origin": "http://evil.kvgov.test"},
    "our origin but cross-site fetch": {"Origin": BASE, "Sec-Fetch-Site": "cross-site"},
    "our host with a path": {"Origin": BASE + "/evil"},
}
SAME_ORIGIN = {
    "no headers": {},
    "our origin": {"Origin": BASE},
    "our origin, explicit default port": {"Origin": "http://KVGOV.test:80"},
    "same-origin fetch": {"Origin": BASE, "Sec-Fetch-Site": "same-origin"},
    "typed by the user": {"Sec-Fetch-Site": "none"},
    # what Chromium sends on the page's own form POST under ``Referrer-Policy: no-referrer``
    "opaque origin, same-origin fetch": {"Origin": "null", "Sec-Fetch-Site": "same-origin"},
}


@pytest.fixture
def world(pg_url: str, tmp_path: Path) -> Iterator[ApiWorld]:
    with api_world(pg_url, tmp_path) as w:
        yield w


@pytest.fixture
async def client(world: ApiWorld) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=world.app)
    async with httpx.AsyncClient(transport=transport, base_url=BASE) as c:
        yield c


def _sessions(world: ApiWorld) -> int:
    with Session(world.engine) as s:
        return int(s.scalar(select(func.count()).select_from(DashboardSession)) or 0)


async def _login(client: httpx.AsyncClient, token: str, headers: dict[str, str]) -> httpx.Response:
    client.cookies.clear()
    return await client.post(
        "/dashboard/login", content=f"token={token}", headers={**FORM, **headers}
    )


@pytest.mark.parametrize("headers", CROSS_SITE.values(), ids=CROSS_SITE.keys())
async def test_cross_site_sign_in_is_refused_without_a_cookie_or_session(
    world: ApiWorld, client: httpx.AsyncClient, headers: dict[str, str]
) -> None:
    r = await _login(client, world.tokens.auditor_acme, headers)
    assert r.status_code == 403, (r.status_code, r.headers.get("set-cookie"))
    assert "set-cookie" not in r.headers
    assert "another site" in r.text
    assert r.headers["cache-control"] == "no-store"
    assert _sessions(world) == 0  # nothing was opened on the server either


@pytest.mark.parametrize("headers", SAME_ORIGIN.values(), ids=SAME_ORIGIN.keys())
async def test_same_origin_and_headerless_sign_in_work_where_cross_site_does_not(
    world: ApiWorld, client: httpx.AsyncClient, headers: dict[str, str]
) -> None:
    ok = await _login(client, world.tokens.auditor, headers)
    assert ok.status_code == 303 and ok.headers["location"] == "/dashboard", ok.text
    cookie = ok.headers["set-cookie"].split(";")[0].split("=", 1)[1]
    page = await client.get("/dashboard", headers={"Cookie": f"{COOKIE}={cookie}"})
    assert page.status_code == 200
    # the very same request from a foreign origin is told apart
    evil = await _login(client, world.tokens.auditor, {**headers, "Origin": "https://evil.example"})
    assert evil.status_code == 403 and "set-cookie" not in evil.headers
    assert _sessions(world) == 1


async def test_cross_site_sign_out_is_refused_and_the_session_survives(
    world: ApiWorld, client: httpx.AsyncClient
) -> None:
    signed_in = await _login(client, world.tokens.auditor, {"Origin": BASE})
    cookie = signed_in.headers["set-cookie"].split(";")[0].split("=", 1)[1]
    jar = {"Cookie": f"{COOKIE}={cookie}"}
    for headers in ({"Origin": "https://evil.example"}, {"Sec-Fetch-Site": "cross-site"}):
        out = await client.post("/dashboard/logout", headers={**jar, **headers})
        assert out.status_code == 403 and "set-cookie" not in out.headers
        assert (await client.get("/dashboard", headers=jar)).status_code == 200
    out = await client.post(
        "/dashboard/logout", headers={**jar, "Origin": BASE, "Sec-Fetch-Site": "same-origin"}
    )
    assert out.status_code == 303 and f'{COOKIE}=""' in out.headers["set-cookie"]
    assert (await client.get("/dashboard", headers=jar)).status_code == 401

"""Dashboard sign-out ends the session on the server: a kept copy of the cookie opens nothing.

Attack (issue 14, "what got through" 8): ``POST /dashboard/logout`` only told the browser to
delete its cookie; the signed cookie itself stayed valid until it expired, so anyone holding a
copy (a shared machine, a proxy log, malware) kept the dashboard after the user signed out.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from kvgov.db.engine import utcnow
from kvgov.db.models import DashboardSession
from kvgov.db.sessions import SessionRepository
from kvgov.db.tokens import TokenRepository
from kvgov.proxy.api.app import create_control_app
from kvgov.proxy.api.auth import ApiContext, issue_session, read_session_claims
from kvgov.proxy.app import Sidecar
from kvgov.types import Role
from tests.security import doors

pytestmark = pytest.mark.postgres

COOKIE = "kvgov_dashboard"


@asynccontextmanager
async def dashboard(
    tmp_path: Path, db: doors.ProdDatabase
) -> AsyncIterator[tuple[Sidecar, httpx.AsyncClient, str]]:
    async with doors.sidecar(tmp_path, db) as sc:
        with Session(sc.engine) as s:
            _, token = TokenRepository(s).create(Role.AUDITOR)
            s.commit()
        transport = httpx.ASGITransport(app=create_control_app(sc.control_plane()))
        async with httpx.AsyncClient(transport=transport, base_url="http://kvgov.test") as c:
            yield sc, c, token


def sc_api(client: httpx.AsyncClient) -> ApiContext:
    """The API context of the app behind ``client`` (its session secret)."""
    transport = client._transport
    assert isinstance(transport, httpx.ASGITransport)
    ctx = transport.app.state.kvgov_api  # type: ignore[attr-defined]
    assert isinstance(ctx, ApiContext)
    return ctx


async def sign_in(client: httpx.AsyncClient, token: str) -> str:
    r = await client.post("/dashboard/login", data={"token": token})
    assert r.status_code == 303, r.text
    return r.headers["set-cookie"].split(";")[0].split("=", 1)[1]


async def page(client: httpx.AsyncClient, cookie: str) -> int:
    # a fresh request each time, carrying exactly the kept copy of the cookie
    client.cookies.clear()
    r = await client.get("/dashboard", headers={"Cookie": f"{COOKIE}={cookie}"})
    return r.status_code


async def test_a_cookie_replayed_after_sign_out_is_refused(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    async with dashboard(tmp_path, prod_db) as (_, client, token):
        kept = await sign_in(client, token)
        assert await page(client, kept) == 200
        client.cookies.clear()
        out = await client.post("/dashboard/logout", headers={"Cookie": f"{COOKIE}={kept}"})
        assert out.status_code == 303
        assert await page(client, kept) == 401  # the copy is dead on the server
        # signing in again works, and is a new session
        again = await sign_in(client, token)
        assert again != kept
        assert await page(client, again) == 200
        assert await page(client, kept) == 401


async def test_sign_out_ends_only_its_own_session(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    async with dashboard(tmp_path, prod_db) as (_, client, token):
        laptop, phone = await sign_in(client, token), await sign_in(client, token)
        client.cookies.clear()
        await client.post("/dashboard/logout", headers={"Cookie": f"{COOKIE}={laptop}"})
        assert await page(client, laptop) == 401
        assert await page(client, phone) == 200


async def test_sessions_are_stored_as_hashes_and_expire(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    async with dashboard(tmp_path, prod_db) as (sc, client, token):
        cookie = await sign_in(client, token)
        with Session(sc.engine) as s:
            rows = s.scalars(select(DashboardSession)).all()
            assert len(rows) == 1
            stored = rows[0].id_hash
            assert stored not in cookie and token not in cookie
            # the session id behind the cookie: unknown to the table except by its hash
            later = utcnow() + timedelta(hours=9)
            repo = SessionRepository(s)
            assert repo.token_of("not-a-session", now=utcnow()) is None
        # a cookie whose signature is valid but whose server session is gone (or never was)
        app_ctx = sc_api(client)
        orphan = issue_session(app_ctx.session_secret, rows[0].token_id, session_id="made-up")
        assert await page(client, orphan) == 401
        no_session = issue_session(app_ctx.session_secret, rows[0].token_id)
        assert await page(client, no_session) == 401
        claims = read_session_claims(app_ctx.session_secret, cookie)
        assert claims is not None
        with Session(sc.engine) as s:
            repo = SessionRepository(s)
            assert repo.token_of(claims[1], now=utcnow()) == rows[0].token_id
            assert repo.token_of(claims[1], now=later) is None  # past its 8 hours

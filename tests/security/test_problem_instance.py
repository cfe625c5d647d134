"""Attack (personal data in error bodies): a raw user id echoed back in a problem's ``instance``.

``/v1/users/{user}/footprint`` takes a raw user id in its path (the route pseudonymises it). Its
error answers (401, 403, 405, 422, 500) are ``application/problem+json``, whose ``instance``
was the request's path: the raw id, in a response body that an ingress, a browser's error
reporting or an APM storing response bodies then keeps, where kvgov's rule is that a raw user
id goes nowhere but the caller's own request (the ledger holds keyed pseudonyms, logs and
``api:access`` the route's template). Now ``instance`` is the matched route's template
(``/v1/users/{user}/footprint``), and a path no route matched (404) has no ``instance``. A
trailing slash is one such path: it was redirected (307) with the raw id in ``Location``.

Each request below fails; the raw id (raw, URL-quoted, hex) must appear nowhere in the
response's body or headers, and ``instance`` must be the template (or absent).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import httpx
import psycopg
import pytest
from psycopg import sql
from sqlalchemy.orm import Session

from kvgov.db.tokens import TokenRepository
from kvgov.proxy.api.app import create_control_app
from kvgov.types import Role
from tests.security import doors

pytestmark = pytest.mark.postgres

#: raw user ids as a gateway sends them ('%', '+' and ' ' survive quoting differently; one with
#: a '/' matches no route however it is quoted: the "an encoded slash" request below)
USERS = ("alice.problem@example.com", "u+7f3a%41problem", "carol problem")
TEMPLATE = "/v1/users/{user}/footprint"


def _forms(raw: str) -> list[str]:
    """The raw id, URL-quoted (as in the path), and hex-encoded."""
    return list(dict.fromkeys((raw, quote(raw, safe=""), quote(raw), raw.encode().hex())))


def _leaks(response: httpx.Response, raw: str) -> list[str]:
    found = [f"body holds {form!r}" for form in _forms(raw) if form in response.text]
    for name, value in response.headers.multi_items():
        found += [f"header {name} holds {form!r}" for form in _forms(raw) if form in value]
    return found


@dataclass
class Api:
    client: httpx.AsyncClient
    admin: dict[str, str]
    acme_auditor: dict[str, str]


@asynccontextmanager
async def _api(tmp_path: Path, db: doors.ProdDatabase) -> AsyncIterator[Api]:
    async with doors.sidecar(tmp_path, db) as sc:
        with Session(sc.engine) as s:
            _, admin = TokenRepository(s).create(Role.ADMIN)
            _, auditor = TokenRepository(s).create(Role.AUDITOR, tenant="acme")
            s.commit()
        # a request the app fails is answered 500, as uvicorn answers it, not raised here
        transport = httpx.ASGITransport(
            app=create_control_app(sc.control_plane()), raise_app_exceptions=False
        )
        async with httpx.AsyncClient(transport=transport, base_url="http://kvgov.test") as c:
            yield Api(
                client=c,
                admin={"Authorization": f"Bearer {admin}"},
                acme_auditor={"Authorization": f"Bearer {auditor}"},
            )


@contextmanager
def _reads_refused(db: doors.ProdDatabase, table: str) -> Iterator[None]:
    """The database refuses the runtime role's reads of ``table`` (a 5xx on that route)."""
    role, name = sql.Identifier(db.runtime_role), sql.Identifier(table)
    with psycopg.connect(db.superuser_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("REVOKE SELECT ON {} FROM {}").format(name, role))
        try:
            yield
        finally:
            conn.execute(sql.SQL("GRANT SELECT ON {} TO {}").format(name, role))


async def test_a_failed_lookup_by_raw_user_id_answers_no_raw_user_id(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    leaks: list[str] = []
    instances: list[tuple[str, object, object]] = []
    seen: set[int] = set()
    async with _api(tmp_path, prod_db) as api:
        for raw in USERS:
            path = f"/v1/users/{quote(raw, safe='')}/footprint"
            get = api.client.get
            matched: list[tuple[str, int, httpx.Response]] = [
                ("no token", 401, await get(path, params={"tenant": "acme"})),
                ("no tenant", 422, await get(path, headers=api.admin)),
                (
                    "a limit out of range",
                    422,
                    await get(path, params={"tenant": "acme", "limit": 0}, headers=api.admin),
                ),
                (
                    "a cursor that does not parse",
                    422,
                    await get(
                        path, params={"tenant": "acme", "cursor": "bogus"}, headers=api.admin
                    ),
                ),
                (
                    "another tenant",
                    403,
                    await get(path, params={"tenant": "globex"}, headers=api.acme_auditor),
                ),
                ("a method the route lacks", 405, await api.client.post(path, headers=api.admin)),
            ]
            with _reads_refused(prod_db, "cache_entries"):
                failed = await get(path, params={"tenant": "acme"}, headers=api.admin)
            matched.append(("the database failing", 500, failed))
            unmatched = [
                (
                    "no such route",
                    404,
                    await get(f"/v1/users/{quote(raw, safe='')}/nothing", headers=api.admin),
                ),
                (
                    "an encoded slash",
                    404,
                    await get(f"/v1/users/{quote(raw + '/x', safe='')}/footprint"),
                ),
                # Starlette redirected a trailing slash (307) to the path without it, the raw
                # id in the Location header, before any token was looked at
                ("a trailing slash", 404, await get(path + "/", params={"tenant": "acme"})),
            ]
            for what, status, reply in matched + unmatched:
                assert reply.status_code == status, (what, reply.text)
                seen.add(status)
                assert reply.headers["content-type"] == "application/problem+json", what
                leaks += [f"{raw!r}, {what} ({status}): {leak}" for leak in _leaks(reply, raw)]
            # a matched route still says where it happened (its template); a path no route
            # matched has nothing to say that is not the path itself
            instances += [
                (what, reply.json().get("instance"), expected)
                for expected, replies in ((TEMPLATE, matched), (None, unmatched))
                for what, _, reply in replies
                if reply.json().get("instance") != expected
            ]
        # the same errors on a route without path parameters still say which route
        reply = await api.client.get("/v1/entries", params={"limit": 0}, headers=api.admin)
        assert reply.status_code == 422
        assert reply.json()["instance"] == "/v1/entries"
    assert seen == {401, 403, 404, 405, 422, 500}
    if leaks:
        pytest.fail("a raw user id in an error answer:\n  " + "\n  ".join(leaks), pytrace=False)
    assert instances == [], "instance is not the route's template (or absent)"

"""IDOR through the control plane: a token scoped to acme (auditor or admin) asks for globex's
objects by every route, by id, by filter, by crafted query strings and by following
pagination. Lists are forced to acme; items of globex (purge jobs and their receipts,
requests' provenance, users' footprints, keys, stats) are 403 (or 404); acting on globex (purge, key
rotation) is 403 and changes nothing; token management needs a global admin. No response
carries a globex identifier (tenant name, key digest, request id, purge id).

Attack (issue 14, first paragraph: "IDOR through the API's list routes" held), against a
production sidecar on Postgres whose ledger holds real traffic of both tenants. The
request-id collision across tenants ("what got through" 4) is its own test.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import httpx
import pytest
from sqlalchemy.orm import Session

from kvgov.db.purge_views import PurgeRequest
from kvgov.db.tokens import TokenRepository
from kvgov.proxy.api.app import create_control_app
from kvgov.proxy.app import Sidecar
from kvgov.types import PurgeState, Role
from kvgov.wire import RequestContext
from tests.security import doors
from tests.security.doors import engine, key, run

pytestmark = pytest.mark.postgres


@dataclass
class World:
    client: httpx.AsyncClient
    sc: Sidecar
    #: what must never reach acme's tokens
    globex_secrets: list[str]
    globex_purge: str
    acme_purge: str
    globex_request: str
    globex_token_id: str

    def token(self, role: Role, tenant: str | None) -> dict[str, str]:
        with Session(self.sc.engine) as s:
            _, raw = TokenRepository(s).create(role, tenant=tenant)
            s.commit()
        return {"Authorization": f"Bearer {raw}"}

    def leaks(self, response: httpx.Response) -> list[str]:
        """The globex identifiers in a response, other than the caller's own request echoed
        back (a problem's ``detail`` may repeat the id it asked for; its ``instance`` is the
        route's template, so it is searched like the rest)."""
        text = response.text
        if response.headers.get("content-type", "").startswith("application/problem+json"):
            problem = response.json()
            text = repr(problem)
            url = response.request.url
            asked = [unquote(p) for p in url.path.split("/")]
            asked += [v for _, v in url.params.multi_items()]
            for value in sorted(asked, key=len, reverse=True):
                if value:
                    text = text.replace(value, "")
        return [s for s in self.globex_secrets if s in text]


async def _traffic(sc: Sidecar) -> tuple[list[str], str]:
    """Both tenants cache and read chunks (user-scoped ones too); returns globex's digests and
    request id."""
    digests = []
    acme, globex = engine(sc, "tok-acme"), engine(sc, "tok-globex")
    try:
        for i in range(3):
            a = RequestContext(request_id=f"acme-req-{i}", tenant="acme", user="alice")
            g = RequestContext(request_id=f"globex-req-{i}", tenant="globex", user="gus")
            assert (await run(acme.put, key(i, "acme", user="alice"), os.urandom(3000), a)).ok
            assert (await run(globex.put, key(i, "globex", user="gus"), os.urandom(3000), g)).ok
            assert await run(globex.get, key(i, "globex", user="gus"), g) is not None
            assert await run(acme.get, key(i, "acme", user="alice"), a) is not None
            digests.append(sc.pipeline.pseudonymizer.key_digest(key(i, "globex", user="gus")))
    finally:
        acme.close()
        globex.close()
    assert sc.writer is not None
    await sc.writer.flush()
    return digests, "globex-req-1"


@asynccontextmanager
async def world(tmp_path: Path, prod_db: doors.ProdDatabase) -> AsyncIterator[World]:
    async with doors.sidecar(tmp_path, prod_db) as sc:
        digests, request = await _traffic(sc)
        assert sc.purge is not None
        jobs = {}
        # the engines that put the users' chunks keep their control channels up for the
        # purges (a holder without one is named unreachable and the purge is incomplete)
        async with doors.control_up(sc, "tok-acme"), doors.control_up(sc, "tok-globex"):
            for tenant, user in (("globex", "gus"), ("acme", "alice")):
                job = await sc.purge.service.create(
                    PurgeRequest(tenant=tenant, user=user, requested_by="test")
                )
                assert (await sc.purge.service.wait(job.id)).state is PurgeState.COMPLETED
                jobs[tenant] = job.id
        with Session(sc.engine) as s:
            record, _ = TokenRepository(s).create(Role.AUDITOR, tenant="globex")
            s.commit()
        transport = httpx.ASGITransport(app=create_control_app(sc.control_plane()))
        async with httpx.AsyncClient(transport=transport, base_url="http://kvgov.test") as c:
            yield World(
                client=c,
                sc=sc,
                globex_secrets=[*digests, "globex", request, jobs["globex"], record.id],
                globex_purge=jobs["globex"],
                acme_purge=jobs["acme"],
                globex_request=request,
                globex_token_id=record.id,
            )


def _tenants(body: Any) -> set[str]:
    """Every ``tenant`` value anywhere in a JSON body."""
    found: set[str] = set()
    if isinstance(body, dict):
        for k, v in body.items():
            if k == "tenant" and isinstance(v, str):
                found.add(v)
            found |= _tenants(v)
    elif isinstance(body, list):
        for v in body:
            found |= _tenants(v)
    return found


LISTS = [
    "/v1/entries",
    "/v1/decisions",
    "/v1/stats",
    "/v1/purges",
    "/v1/keys",
]


@pytest.mark.parametrize("role", [Role.AUDITOR, Role.ADMIN])
async def test_a_tenant_scoped_token_never_sees_another_tenant(
    tmp_path: Path, prod_db: doors.ProdDatabase, role: Role
) -> None:
    async with world(tmp_path, prod_db) as w:
        acme = w.token(role, "acme")
        c = w.client
        # lists: forced to acme, whatever the query says; pages followed to the end
        for path in LISTS:
            for query in ("", "?limit=1", "?tenant=acme&limit=2"):
                url: str | None = path + query
                pages = 0
                while url is not None:
                    r = await c.get(url, headers=acme)
                    assert r.status_code == 200, (url, r.text)
                    body = r.json()
                    assert _tenants(body) <= {"acme"}, (url, body)
                    assert not w.leaks(r), (url, w.leaks(r))
                    url = body.get("next") if isinstance(body, dict) else None
                    pages += 1
                    assert pages < 100
            for query in (
                "?tenant=globex",
                "?tenant=GLOBEX",
                "?tenant=acme&tenant=globex",
                "?tenant=globex&tenant=acme",
                "?tenant=%67lobex",
                "?tenant=globex%00",
                "?tenant=acme%20",
                "?tenant=*",
                "?tenant=",
            ):
                r = await c.get(path + query, headers=acme)
                assert r.status_code in (403, 422) or _tenants(r.json()) <= {"acme"}, (
                    path + query,
                    r.status_code,
                )
                assert not w.leaks(r), (path + query, w.leaks(r))
        # filters by another tenant's user, and items by id
        for path in (
            "/v1/entries?tenant=globex&user=gus",
            "/v1/keys?tenant=globex&user=gus",
            "/v1/users/gus/footprint?tenant=globex",
            "/v1/tenants/globex/stats",
            f"/v1/requests/{w.globex_request}/provenance",
            f"/v1/purges/{w.globex_purge}",
            f"/v1/purges/{w.globex_purge}/receipt",
        ):
            r = await c.get(path, headers=acme)
            # 403, or 404 where ids are looked up within the caller's tenant
            assert r.status_code in (403, 404), (path, r.status_code, r.text)
            assert not w.leaks(r), (path, w.leaks(r))
        # the same routes for acme's own objects work (the door is not simply shut)
        for path in (
            "/v1/users/alice/footprint?tenant=acme",
            "/v1/tenants/acme/stats",
            "/v1/requests/acme-req-1/provenance",
            f"/v1/purges/{w.acme_purge}",
            f"/v1/purges/{w.acme_purge}/receipt",
        ):
            r = await c.get(path, headers=acme)
            assert r.status_code == 200, (path, r.status_code, r.text)
            assert not w.leaks(r), (path, w.leaks(r))
        # the dashboard shows acme only
        page = await c.get("/dashboard", headers=acme)
        assert page.status_code == 200
        assert not w.leaks(page), w.leaks(page)


async def test_a_tenant_scoped_admin_cannot_act_on_another_tenant(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    async with world(tmp_path, prod_db) as w:
        acme_admin = w.token(Role.ADMIN, "acme")
        c = w.client
        purges_before = (await c.get("/v1/purges", headers=w.token(Role.AUDITOR, None))).json()
        keys_before = await c.get("/v1/keys?tenant=globex", headers=w.token(Role.AUDITOR, None))
        for body in ({"tenant": "globex"}, {"tenant": "globex", "user": "gus"}):
            r = await c.post("/v1/purges", json=body, headers=acme_admin)
            assert r.status_code == 403, r.text
            r = await c.post("/v1/purges", json={**body, "dry_run": True}, headers=acme_admin)
            assert r.status_code == 403, r.text
            r = await c.post("/v1/keys/rotate", json=body, headers=acme_admin)
            assert r.status_code == 403, r.text
        # tokens: listing, creating (for any tenant) and revoking need a global admin
        assert (await c.get("/v1/tokens", headers=acme_admin)).status_code == 403
        for made in ({"role": "admin"}, {"role": "auditor", "tenant": "globex"}):
            r = await c.post("/v1/tokens", json=made, headers=acme_admin)
            assert r.status_code == 403, r.text
        r = await c.delete(f"/v1/tokens/{w.globex_token_id}", headers=acme_admin)
        assert r.status_code == 403
        # nothing changed
        reader = w.token(Role.AUDITOR, None)
        assert (await c.get("/v1/purges", headers=reader)).json() == purges_before
        keys_after = await c.get("/v1/keys?tenant=globex", headers=reader)
        assert keys_after.json() == keys_before.json()
        with Session(w.sc.engine) as s:
            record = TokenRepository(s).get(w.globex_token_id)
        assert record is not None
        assert record.revoked_at is None


async def test_a_revoked_token_stays_revoked_whatever_its_row_says(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    """Review r15, F3: the runtime role (every sidecar pod's) cleared the ``revoked_at`` of a
    token an admin had revoked through ``DELETE /v1/tokens/{id}``, and the leaked token
    authenticated again while the ledger said revoked. The row's revocation is now final for
    that role (migration 0015), and the chained ``token:revoked`` event is what the API
    believes: a superuser who switches the trigger off and clears the row revives nothing."""
    import psycopg
    from sqlalchemy import text
    from sqlalchemy.exc import DBAPIError

    from kvgov.db.engine import make_engine

    async with world(tmp_path, prod_db) as w:
        c = w.client
        admin = w.token(Role.ADMIN, None)
        r = await c.post("/v1/tokens", json={"role": "auditor", "tenant": "globex"}, headers=admin)
        assert r.status_code == 201, r.text
        made = r.json()
        leaked = {"Authorization": f"Bearer {made['token']}"}
        assert (await c.get("/v1/entries", headers=leaked)).status_code == 200
        r = await c.delete(f"/v1/tokens/{made['id']}", headers=admin)
        assert r.status_code == 204, r.text
        assert (await c.get("/v1/entries", headers=leaked)).status_code == 401

        # the runtime role clears revoked_at: refused
        runtime = make_engine(prod_db.url)
        try:
            with runtime.connect() as conn:
                try:
                    conn.execute(
                        text("UPDATE api_tokens SET revoked_at = NULL WHERE id = :id"),
                        {"id": made["id"]},
                    )
                    conn.commit()
                except DBAPIError as exc:
                    assert "never change" in str(exc), exc
                else:
                    r = await c.get("/v1/entries", headers=leaked)
                    pytest.fail(
                        "the runtime role cleared revoked_at of a token revoked through DELETE"
                        f" /v1/tokens (token:revoked chained); it now answers {r.status_code}"
                    )
        finally:
            runtime.dispose()
        assert (await c.get("/v1/entries", headers=leaked)).status_code == 401

        # a superuser (triggers off) clears it: the chained revocation still holds
        with psycopg.connect(prod_db.superuser_dsn) as conn:
            conn.execute("SET session_replication_role = replica")
            cleared = conn.execute(
                "UPDATE api_tokens SET revoked_at = NULL WHERE id = %s", (made["id"],)
            ).rowcount
            assert cleared == 1
        r = await c.get("/v1/entries", headers=leaked)
        assert r.status_code == 401, (
            "a token revoked through DELETE /v1/tokens (token:revoked chained) authenticated"
            f" again after its row's revoked_at was cleared: {r.status_code}"
        )
        # and by a fresh process, which has not seen it revoked (nothing remembered)
        fresh = httpx.ASGITransport(app=create_control_app(w.sc.control_plane()))
        async with httpx.AsyncClient(transport=fresh, base_url="http://kvgov.test") as c2:
            assert (await c2.get("/v1/entries", headers=leaked)).status_code == 401

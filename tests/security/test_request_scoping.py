"""Request ids are scoped by tenant: provenance never crosses tenants through a shared id.

Attack (issue 14, "what got through" 4): request ids come from the engines and were global.
acme and then globex GET with the same id R; acme's tenant-scoped auditor's ``GET
/v1/requests/R/provenance`` returned globex's chunk (its digest, creating request, policy
revision and decision id), and globex's auditor got 403 on its own request.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
from sqlalchemy.orm import Session
from typer.testing import CliRunner

from kvgov.cli.main import build_app
from kvgov.db.tokens import TokenRepository
from kvgov.proxy.api.app import create_control_app
from kvgov.proxy.app import Sidecar
from kvgov.types import Role
from kvgov.wire import RequestContext
from tests.security import doors
from tests.security.doors import engine, key, run

pytestmark = pytest.mark.postgres

SHARED = "req-shared-R"


def bearer(sc: Sidecar, tenant: str | None) -> dict[str, str]:
    with Session(sc.engine) as s:
        _, raw = TokenRepository(s).create(Role.AUDITOR, tenant=tenant)
        s.commit()
    return {"Authorization": f"Bearer {raw}"}


@asynccontextmanager
async def both_tenants_used_r(
    tmp_path: Path, db: doors.ProdDatabase
) -> AsyncIterator[tuple[Sidecar, httpx.AsyncClient, dict[str, str]]]:
    """acme and globex each cache a chunk in their own request, then GET it in request R."""
    async with doors.sidecar(tmp_path, db) as sc:
        digests = {}
        for n, tenant in enumerate(("acme", "globex")):
            client = engine(sc, f"tok-{tenant}")
            try:
                k = key(100 + n, tenant)
                put = RequestContext(request_id=f"put-{tenant}", tenant=tenant)
                assert (await run(client.put, k, os.urandom(4096), put)).ok
                got = RequestContext(request_id=SHARED, tenant=tenant)
                assert await run(client.get, k, got) is not None
            finally:
                client.close()
            digests[tenant] = sc.pipeline.pseudonymizer.key_digest(k)
        assert sc.writer is not None
        await sc.writer.flush()
        transport = httpx.ASGITransport(app=create_control_app(sc.control_plane()))
        async with httpx.AsyncClient(transport=transport, base_url="http://kvgov.test") as api:
            yield sc, api, digests


async def test_each_tenants_auditor_sees_its_own_request_r(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    async with both_tenants_used_r(tmp_path, prod_db) as (sc, api, digests):
        path = f"/v1/requests/{SHARED}/provenance"
        for tenant, other in (("acme", "globex"), ("globex", "acme")):
            reply = await api.get(path, headers=bearer(sc, tenant))
            assert reply.status_code == 200, reply.text  # globex's auditor: not 403
            body = reply.json()
            assert body["tenant"] == tenant
            seen = [c["key_digest"] for c in body["chunks"]]
            assert seen == [digests[tenant]], body
            assert digests[other] not in reply.text
            assert f"put-{other}" not in reply.text
            assert all(c["created"]["request_id"] == f"put-{tenant}" for c in body["chunks"])
            # asking for the other tenant's request R is refused, not answered
            denied = await api.get(path, params={"tenant": other}, headers=bearer(sc, tenant))
            assert denied.status_code == 403
            assert digests[other] not in denied.text
            # an id only the other tenant used is no request of this tenant: not found
            theirs = await api.get(
                f"/v1/requests/put-{other}/provenance", headers=bearer(sc, tenant)
            )
            assert theirs.status_code == 404
            assert digests[other] not in theirs.text


async def test_an_unscoped_auditor_must_name_the_tenant(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    async with both_tenants_used_r(tmp_path, prod_db) as (sc, api, digests):
        path = f"/v1/requests/{SHARED}/provenance"
        fleet = bearer(sc, None)
        ambiguous = await api.get(path, headers=fleet)
        assert ambiguous.status_code == 409
        assert ambiguous.json()["code"] == "ambiguous_request"
        assert digests["acme"] not in ambiguous.text and digests["globex"] not in ambiguous.text
        named = await api.get(path, params={"tenant": "globex"}, headers=fleet)
        assert named.status_code == 200
        assert [c["key_digest"] for c in named.json()["chunks"]] == [digests["globex"]]
        # an id one tenant used needs no tenant
        single = await api.get("/v1/requests/put-acme/provenance", headers=fleet)
        assert single.status_code == 200 and single.json()["tenant"] == "acme"
        # and a tenant that never used the id has no such request
        absent = await api.get(path, params={"tenant": "initech"}, headers=fleet)
        assert absent.status_code == 404


async def test_the_cli_scopes_request_ids_by_tenant(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    async with both_tenants_used_r(tmp_path, prod_db) as (sc, _, digests):
        env = {"KVGOV_DATABASE_URL": prod_db.url, "KVGOV_DATA_DIR": str(sc.settings.data_dir)}

        def cli(*args: str) -> object:
            return CliRunner().invoke(build_app(), list(args), env=env)

        ambiguous = await run(cli, "provenance", SHARED)
        assert ambiguous.exit_code == 2  # type: ignore[attr-defined]
        assert "--tenant" in ambiguous.output  # type: ignore[attr-defined]
        acme = await run(cli, "provenance", SHARED, "--tenant", "acme", "--json")
        assert acme.exit_code == 0, acme.output  # type: ignore[attr-defined]
        data = json.loads(acme.stdout)  # type: ignore[attr-defined]
        assert data["tenant"] == "acme"
        assert [c["key_digest"] for c in data["chunks"]] == [digests["acme"]]
        assert all(c["tenant"] == "acme" for c in data["chunks"])

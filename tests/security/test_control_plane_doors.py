"""The control plane's unauthenticated doors say nothing an outsider can use.

``/metrics`` counts every tenant's traffic together (its labels never name a tenant, user or
key), yet the counts themselves move with other tenants' activity: it needs a token that is not
tenant-scoped (an auditor's is enough), unless ``api.metrics_public`` opens it on purpose.
``/healthz`` and ``/readyz`` answer probes (kubelet has no token) with a status and nothing
else: no listener addresses, connection counts or sidecar ids. The OpenAPI document and its
pages are off in production unless ``api.docs`` turns them on.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.orm import Session

from kvgov.config import ApiSettings
from kvgov.db.tokens import TokenRepository
from kvgov.proxy.api.app import create_control_app
from kvgov.types import Role
from tests.security import doors

pytestmark = pytest.mark.postgres


@asynccontextmanager
async def control(
    tmp_path: Path, prod_db: doors.ProdDatabase, **api: Any
) -> AsyncIterator[httpx.AsyncClient]:
    settings = doors.settings(tmp_path, prod_db)
    if api:
        settings = settings.model_copy(update={"api": ApiSettings(**api)})
    from kvgov.proxy.app import build_sidecar

    sc = await build_sidecar(settings)
    await sc.start()
    try:
        transport = httpx.ASGITransport(app=create_control_app(sc.control_plane()))
        async with httpx.AsyncClient(transport=transport, base_url="http://kvgov.test") as c:
            c.sidecar = sc  # type: ignore[attr-defined]
            yield c
    finally:
        await sc.stop()


def token(client: httpx.AsyncClient, role: Role, tenant: str | None = None) -> dict[str, str]:
    sc = client.sidecar  # type: ignore[attr-defined]
    with Session(sc.engine) as s:
        _, raw = TokenRepository(s).create(role, tenant=tenant)
        s.commit()
    return {"Authorization": f"Bearer {raw}"}


async def test_metrics_need_a_fleet_wide_token(tmp_path: Path, prod_db: doors.ProdDatabase) -> None:
    async with control(tmp_path, prod_db) as c:
        assert (await c.get("/metrics")).status_code == 401
        scoped = await c.get("/metrics", headers=token(c, Role.AUDITOR, tenant="acme"))
        assert scoped.status_code == 403  # one tenant's auditor sees no fleet-wide counts
        engine = await c.get("/metrics", headers=token(c, Role.ENGINE))
        assert engine.status_code == 403
        ok = await c.get("/metrics", headers=token(c, Role.AUDITOR))
        assert ok.status_code == 200
        assert "kvgov_dataplane_ops_total" in ok.text or "kvgov_dataplane_ops" in ok.text
        assert "acme" not in ok.text  # and never a tenant label


async def test_metrics_public_opens_them_on_purpose(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    async with control(tmp_path, prod_db, metrics_public=True) as c:
        assert (await c.get("/metrics")).status_code == 200


async def test_probes_answer_with_a_status_and_nothing_else(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    async with control(tmp_path, prod_db) as c:
        health = await c.get("/healthz")
        ready = await c.get("/readyz")
        assert (health.status_code, health.json()) == (200, {"status": "ok"})
        assert (ready.status_code, ready.json()) == (200, {"status": "ready"})


async def test_api_docs_are_off_in_production(tmp_path: Path, prod_db: doors.ProdDatabase) -> None:
    async with control(tmp_path, prod_db) as c:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert (await c.get(path)).status_code == 404, path
    async with control(tmp_path / "again", prod_db, docs=True) as c:
        assert (await c.get("/openapi.json")).status_code == 200

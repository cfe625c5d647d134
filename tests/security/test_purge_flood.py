"""Attack (review r15, F2): a tenant-scoped admin floods ``POST /v1/purges`` for its own tenant.

The role exists so that a tenant can purge its own users. Every job gets a ``gpu@S`` step for
every live sidecar, and each resets that pod's whole vLLM prefix cache (every tenant's); jobs
are claimed oldest first, so other tenants' purges queue behind the flood until their
``job_timeout_s`` passes and they end ``incomplete``. Nothing bounded it: no check that the
user exists (the CLI warns, the API did not), no limit per token or tenant. And the scoped
admin's dry run named the fleet's sidecars and its vLLM engines' URLs.

Here the API is the real one (real tokens, ``api:access`` recorded, the real purge service)
on a production-shaped Postgres ledger reached as the runtime role; no executor runs, so the
jobs stay open as they do while a fleet is busy.
"""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from fastapi import FastAPI
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from kvgov.config import Settings
from kvgov.connectors.tiers.memory import MemoryTier
from kvgov.db import sidecars
from kvgov.db.engine import make_engine, make_sessionmaker, utcnow
from kvgov.db.keystore import SqlKeyStore
from kvgov.db.models import PurgeJob
from kvgov.db.tokens import TokenRepository
from kvgov.keys.kek import FileKekProvider, generate_kek_file
from kvgov.keys.keyring import Keyring
from kvgov.ledger.events import EntryChange, Event
from kvgov.ledger.pseudonym import Pseudonymizer
from kvgov.ledger.writer import LedgerWriter
from kvgov.proxy.api.auth import ApiContext
from kvgov.proxy.api.compliance import include_v1
from kvgov.proxy.api.v1.purges import include_purges
from kvgov.services.purge.build import make_service, writer_checkpointer
from kvgov.services.purge.ports import KeyringShredder
from kvgov.types import EntryState, EventKind, Role, Scope
from tests.security import doors

pytestmark = pytest.mark.postgres

#: what the fleet looks like: a tenant-scoped token must not learn it
SIDECAR = "pod-7f3a-secret"
ENGINE = "http://10.9.8.7:8000"


@dataclass
class Api:
    client: httpx.AsyncClient
    sessions: Callable[[], Session]
    refused: list[str]
    tokens: dict[str, dict[str, str]]

    def jobs(self, tenant: str) -> int:
        with self.sessions() as s:
            return int(
                s.scalar(
                    select(func.count()).select_from(PurgeJob).where(PurgeJob.tenant == tenant)
                )
                or 0
            )


@asynccontextmanager
async def api(tmp_path: Path, db: doors.ProdDatabase, **limits: Any) -> AsyncIterator[Api]:
    settings = Settings(
        data_dir=tmp_path,
        database={"url": db.url},
        api=limits,
        purge={"poll_interval_s": 0.05, "vllm_engines": [ENGINE]},
    )
    engine = make_engine(db.url)
    key = Ed25519PrivateKey.generate()
    writer = LedgerWriter(engine, chain_id="flood-test", signing_key=key)
    await writer.start()
    pseudo = Pseudonymizer(os.urandom(32))
    keyring = Keyring(SqlKeyStore(engine), FileKekProvider(generate_kek_file(tmp_path / "kek")))
    sessions = make_sessionmaker(engine)
    # alice and gus used the cache: the ledger knows them in their tenants
    for tenant, user in (("acme", "alice"), ("globex", "gus")):
        who = pseudo.user(tenant, user)
        digest = pseudo.key_digest(f"m@1@0@1@bfloat16@tenant%{tenant}@user%{user}")
        await writer.append(
            Event(
                kind=EventKind.KV_PUT,
                tenant=tenant,
                actor=who,
                key_digest=digest,
                entry=EntryChange(
                    key_digest=digest,
                    state=EntryState.LIVE,
                    tenant=tenant,
                    owner=who,
                    scope_user=who,
                    scope=Scope.USER,
                    tiers=("memory",),
                ),
            )
        )
    await writer.flush()
    with sessions.begin() as s:
        sidecars.heartbeat(s, SIDECAR, now=utcnow(), chain_id=None)
    tokens = {}
    with sessions() as s:
        repo = TokenRepository(s)
        for name, tenant in (("admin", None), ("acme", "acme"), ("acme2", "acme")):
            _record, raw = repo.create(Role.ADMIN, tenant=tenant, name=name)
            tokens[name] = {"Authorization": f"Bearer {raw}"}
        s.commit()
    service = make_service(
        settings,
        sessions=sessions,
        sink=writer,
        tiers=[MemoryTier(8 << 20)],
        shredder=KeyringShredder(keyring),
        signing_key=key,
        pseudonymize=pseudo.user,
        checkpoint=writer_checkpointer(writer, engine, "flood-test"),
    )
    app = FastAPI()
    include_v1(
        app,
        ApiContext(
            settings=settings,
            engine=engine,
            sink=writer,
            pseudonymizer=pseudo,
            session_secret=secrets.token_bytes(32),
        ),
    )
    refused: list[str] = []
    include_purges(app, service, refused=refused.append)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://kvgov") as client:
        try:
            yield Api(client, sessions, refused, tokens)
        finally:
            await writer.close()
            engine.dispose()


async def test_a_user_the_ledger_never_saw_is_refused_unless_forced(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    async with api(tmp_path, prod_db) as a:
        for who in ("acme", "admin"):  # the global admin too: the API cannot ask to confirm
            r = await a.client.post(
                "/v1/purges", json={"tenant": "acme", "user": "x-0001"}, headers=a.tokens[who]
            )
            assert r.status_code == 409, (
                f"{who}: a purge of a user acme's ledger never saw was accepted"
                f" ({r.status_code}): every such job resets every pod's GPU prefix cache"
            )
            assert r.headers["content-type"] == "application/problem+json"
            assert r.json()["code"] == "unknown_subject"
            assert "x-0001" not in r.text  # the raw id is never returned
        assert a.jobs("acme") == 0, "a refused purge made a job"
        assert a.refused == ["unknown_subject", "unknown_subject"]
        # a near miss is named as such, without the id
        r = await a.client.post(
            "/v1/purges", json={"tenant": "acme", "user": "Alice"}, headers=a.tokens["acme"]
        )
        assert r.status_code == 409 and "1 other spelling" in r.json()["detail"], r.text
        # the user the ledger knows needs no force; one it never saw does, and then is purged
        for body in (
            {"tenant": "acme", "user": "alice"},
            {"tenant": "acme", "user": "x-0001", "force": True},
            {"tenant": "acme"},  # the whole tenant: no id to check
        ):
            r = await a.client.post("/v1/purges", json=body, headers=a.tokens["acme"])
            assert r.status_code == 202, (body, r.status_code, r.text)
        assert a.jobs("acme") == 3


async def test_a_scoped_admins_flood_is_bounded_by_its_tenants_open_jobs(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    async with api(tmp_path, prod_db, purges_open_per_tenant=4) as a:
        body = {"tenant": "acme", "user": "alice"}
        # 50 at once, from two of acme's admin tokens: the bound is the tenant's
        replies = await asyncio.gather(
            *(
                a.client.post("/v1/purges", json=body, headers=a.tokens[("acme", "acme2")[i % 2]])
                for i in range(50)
            )
        )
        codes = [r.status_code for r in replies]
        made = a.jobs("acme")
        assert made <= 4, f"one acme-scoped admin made {made} purge jobs, each a GPU reset per pod"
        assert codes.count(202) == made == 4, codes
        assert codes.count(429) == 46, codes
        for r in replies:
            if r.status_code == 429:
                assert r.headers["content-type"] == "application/problem+json"
                assert r.json()["code"] == "rate_limited"
                assert 1 <= int(r.headers["retry-after"]) <= 300  # the oldest job's timeout
        assert a.refused == ["open_jobs"] * 46
        # another tenant's purge, by the operator, is not held back by acme's bound
        r = await a.client.post(
            "/v1/purges", json={"tenant": "globex", "user": "gus"}, headers=a.tokens["admin"]
        )
        assert r.status_code == 202, r.text


async def test_a_scoped_admins_creations_per_minute_are_bounded(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    async with api(
        tmp_path, prod_db, purges_open_per_tenant=1000, purges_per_minute_per_token=5
    ) as a:
        body = {"tenant": "acme", "user": "alice"}
        codes = []
        for _ in range(50):
            r = await a.client.post("/v1/purges", json=body, headers=a.tokens["acme"])
            codes.append(r.status_code)
            if r.status_code == 429:
                assert 1 <= int(r.headers["retry-after"]) <= 60, r.headers
        made = a.jobs("acme")
        assert made <= 5, f"one acme-scoped admin made {made} purge jobs in a minute"
        assert codes == [202] * 5 + [429] * 45, codes
        assert set(a.refused) == {"per_minute"}
        # the bound is the token's: acme's other admin token has its own minute
        r = await a.client.post("/v1/purges", json=body, headers=a.tokens["acme2"])
        assert r.status_code == 202, r.text


async def test_a_global_admin_is_not_bounded(tmp_path: Path, prod_db: doors.ProdDatabase) -> None:
    async with api(tmp_path, prod_db, purges_open_per_tenant=2, purges_per_minute_per_token=2) as a:
        for _ in range(12):
            r = await a.client.post(
                "/v1/purges", json={"tenant": "acme", "user": "alice"}, headers=a.tokens["admin"]
            )
            assert r.status_code == 202, r.text
        assert a.jobs("acme") == 12
        # ... and its jobs count towards the tenant's open ones: acme's own admin waits
        r = await a.client.post(
            "/v1/purges", json={"tenant": "acme", "user": "alice"}, headers=a.tokens["acme"]
        )
        assert r.status_code == 429, r.text


async def test_a_scoped_admins_dry_run_names_no_sidecar_or_engine(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    async with api(tmp_path, prod_db) as a:
        body = {"tenant": "acme", "user": "alice", "dry_run": True}
        r = await a.client.post("/v1/purges", json=body, headers=a.tokens["acme"])
        assert r.status_code == 200, r.text
        leaked = [s for s in (SIDECAR, ENGINE, "10.9.8.7") if s in r.text]
        assert not leaked, f"acme's admin's dry run named the fleet: {leaked}"
        plan = r.json()
        assert plan["sidecars"] is None and plan["vllm_engines"] is None
        assert (plan["sidecar_count"], plan["vllm_engine_count"]) == (1, 1)
        assert plan["subject_known"] is True
        # the operator's dry run still names them
        r = await a.client.post("/v1/purges", json=body, headers=a.tokens["admin"])
        assert r.status_code == 200, r.text
        assert r.json()["sidecars"] == [SIDECAR] and r.json()["vllm_engines"] == [ENGINE]

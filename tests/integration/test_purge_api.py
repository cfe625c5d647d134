"""``POST /v1/purges`` and ``GET /v1/purges/{id}`` on a real Postgres ledger with the real
auth dependencies (bearer tokens from the token repository), the real ledger writer, tiers,
keyring and purge service; the sidecar's executor is played by ``service.wait``.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from fastapi import FastAPI

from kvgov.config import Settings
from kvgov.connectors.tiers.memory import MemoryTier
from kvgov.db.engine import make_engine, make_sessionmaker, upgrade
from kvgov.db.keystore import SqlKeyStore
from kvgov.db.tokens import TokenRepository
from kvgov.keys.kek import FileKekProvider, generate_kek_file
from kvgov.keys.keyring import Keyring
from kvgov.ledger.chain import public_key_bytes
from kvgov.ledger.events import EntryChange, Event
from kvgov.ledger.pseudonym import Pseudonymizer
from kvgov.ledger.writer import LedgerWriter
from kvgov.proxy.api.auth import ApiContext
from kvgov.proxy.api.compliance import include_v1
from kvgov.proxy.api.v1.purges import include_purges
from kvgov.services.purge.build import make_service, writer_checkpointer
from kvgov.services.purge.ports import KeyringShredder
from kvgov.services.purge.receipts import verify_receipt
from kvgov.services.purge.service import PurgeService
from kvgov.types import EntryState, EventKind, Role, Scope

pytestmark = pytest.mark.postgres


@dataclass
class Api:
    client: httpx.AsyncClient
    service: PurgeService
    tokens: dict[str, str]
    key: Ed25519PrivateKey
    memory: MemoryTier
    digest: str
    woken: list[int]

    def auth(self, who: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[who]}"}


@pytest.fixture
async def api(pg_url: str, tmp_path: Path) -> AsyncIterator[Api]:
    upgrade(pg_url)
    engine = make_engine(pg_url)
    settings = Settings(
        data_dir=tmp_path, database={"url": pg_url}, purge={"poll_interval_s": 0.05}
    )
    key = Ed25519PrivateKey.generate()
    writer = LedgerWriter(engine, chain_id="api-test", signing_key=key)
    await writer.start()
    pseudo = Pseudonymizer(os.urandom(32))
    keyring = Keyring(SqlKeyStore(engine), FileKekProvider(generate_kek_file(tmp_path / "kek")))
    memory = MemoryTier(16 << 20)
    alice = pseudo.user("acme", "alice")
    digest = pseudo.key_digest("m@1@0@1@bfloat16@tenant%acme@user%alice")
    await memory.put(digest, keyring.seal("acme", digest.encode(), b"x" * 4096, user=alice))
    await writer.append(
        Event(
            kind=EventKind.KV_PUT,
            tenant="acme",
            actor=alice,
            key_digest=digest,
            entry=EntryChange(
                key_digest=digest,
                state=EntryState.LIVE,
                tenant="acme",
                owner=alice,
                scope_user=alice,
                scope=Scope.USER,
                tiers=("memory",),
            ),
        )
    )
    tokens = {}
    with make_sessionmaker(engine)() as s:
        repo = TokenRepository(s)
        for name, role, tenant in (
            ("admin", Role.ADMIN, None),
            ("auditor", Role.AUDITOR, None),
            ("globex-admin", Role.ADMIN, "globex"),
        ):
            _record, tokens[name] = repo.create(role, tenant=tenant, name=name)
        s.commit()
    service = make_service(
        settings,
        sessions=make_sessionmaker(engine),
        sink=writer,
        tiers=[memory],
        shredder=KeyringShredder(keyring),
        signing_key=key,
        pseudonymize=pseudo.user,
        checkpoint=writer_checkpointer(writer, engine, "api-test"),
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
    woken: list[int] = []
    include_purges(app, service, wake=lambda: woken.append(1))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://kvgov") as client:
        try:
            yield Api(client, service, tokens, key, memory, digest, woken)
        finally:
            await writer.close()
            engine.dispose()


async def test_purge_routes_need_an_admin(api: Api) -> None:
    body = {"tenant": "acme", "user": "alice"}
    assert (await api.client.post("/v1/purges", json=body)).status_code == 401
    resp = await api.client.post("/v1/purges", json=body, headers=api.auth("auditor"))
    assert resp.status_code == 403
    assert resp.headers["content-type"].startswith("application/problem+json")
    # a tenant-scoped admin may purge only its own tenant
    resp = await api.client.post("/v1/purges", json=body, headers=api.auth("globex-admin"))
    assert resp.status_code == 403
    assert await api.memory.contains(api.digest)


async def test_dry_run_then_purge_then_status_with_receipt(api: Api) -> None:
    admin = api.auth("admin")
    dry = await api.client.post(
        "/v1/purges", json={"tenant": "acme", "user": "alice", "dry_run": True}, headers=admin
    )
    assert dry.status_code == 200
    assert dry.json()["entries_in_scope"] == 1
    assert await api.memory.contains(api.digest)

    created = await api.client.post(
        "/v1/purges", json={"tenant": "acme", "user": "alice"}, headers=admin
    )
    assert created.status_code == 202, created.text
    job = created.json()
    assert job["state"] == "pending" and job["kind"] == "user"
    assert "alice" not in created.text  # only the pseudonym leaves the server
    assert api.woken == [1]  # the sidecar's executor was told at once

    await api.service.wait(job["id"])  # what the sidecar's executor does
    got = await api.client.get(f"/v1/purges/{job['id']}", headers=admin)
    assert got.status_code == 200
    done = got.json()
    assert done["state"] == "completed"
    assert {s["name"] for s in done["steps"]} >= {"keys", "tiers", "gpu", "ledger"}
    assert verify_receipt(done["receipt"], [public_key_bytes(api.key)]).ok
    assert done["receipt"]["receipt"]["tiers"] == {"memory": 1}
    assert not await api.memory.contains(api.digest)

    other = await api.client.get(f"/v1/purges/{job['id']}", headers=api.auth("globex-admin"))
    assert other.status_code == 403
    missing = await api.client.get("/v1/purges/00000000-0000-0000-0000-000000000000", headers=admin)
    assert missing.status_code == 404
    bad = await api.client.post("/v1/purges", json={"tenant": "acme", "x": 1}, headers=admin)
    assert bad.status_code == 422

"""Shared setup for the compliance API tests (no tests here).

Everything is real: a fresh Postgres database migrated with the ledger's Alembic migrations,
the real :class:`LedgerWriter` (seeding the ledger with put/get/miss/deny/evict and policy
decision events that carry :class:`EntryChange`), the real Pseudonymizer and token repository,
the real purge service (memory tier, key store, Ed25519 receipts signed with the ledger's key
file), and the API mounted with :func:`include_v1` + :func:`include_purges` on a bare app.

The writer runs on an event loop of its own thread (:class:`WriterThread`): the API under test
is driven from several loops (httpx in the test's loop, Schemathesis' ASGI client, uvicorn in a
thread), and an asyncio writer belongs to one loop. :class:`WriterThread.sink` hands events to
it from any loop and waits for them to be durable, exactly like the writer's own ``append``.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

from click.testing import Result
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from fastapi import FastAPI
from sqlalchemy import Engine
from typer.testing import CliRunner

from kvgov.config import Settings
from kvgov.connectors.tiers.memory import MemoryTier
from kvgov.db.engine import make_engine, make_sessionmaker, upgrade
from kvgov.db.keystore import SqlKeyStore
from kvgov.db.purge_views import JobView, PurgeRequest
from kvgov.db.tokens import TokenRepository
from kvgov.keys.kek import generate_kek_file
from kvgov.ledger.chain import generate_signing_key_file, load_signing_key
from kvgov.ledger.events import Appended, EntryChange, Event
from kvgov.ledger.pseudonym import Pseudonymizer, generate_pseudonym_key_file
from kvgov.ledger.writer import LedgerWriter
from kvgov.proxy.api.auth import ApiContext
from kvgov.proxy.api.compliance import include_v1
from kvgov.proxy.api.v1.purges import include_purges
from kvgov.services.purge.build import make_service, writer_checkpointer
from kvgov.services.purge.ports import StoreShredder
from kvgov.services.purge.service import PurgeService
from kvgov.types import EntryState, EventKind, Outcome, Role, Scope, Sensitivity

T = TypeVar("T")

T0 = datetime(2026, 11, 20, 9, 0, tzinfo=UTC)
POLICY_REV = "bundle-2026.11.20"


class WriterThread:
    """A real LedgerWriter running on its own loop in a daemon thread."""

    def __init__(
        self, engine: Engine, chain_id: str, signing_key: Ed25519PrivateKey | None = None
    ) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.chain_id = chain_id
        self.writer = LedgerWriter(
            engine,
            chain_id=chain_id,
            signing_key=signing_key or Ed25519PrivateKey.generate(),
        )
        self.run(self.writer.start())

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=60)

    async def run_async(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the writer's loop and await it from another loop."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    async def flush(self) -> None:
        await self.run_async(self.writer.flush())

    async def write_checkpoint(self) -> object:
        return await self.run_async(self.writer.write_checkpoint())

    def close(self) -> None:
        try:
            self.run(self.writer.close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()

    @property
    def sink(self) -> BridgeSink:
        return BridgeSink(self)


class BridgeSink:
    """EventSink over a :class:`WriterThread`, usable from any event loop."""

    def __init__(self, owner: WriterThread) -> None:
        self._owner = owner

    def submit(self, event: Event) -> asyncio.Future[Appended]:
        fut = asyncio.run_coroutine_threadsafe(self._owner.writer.append(event), self._owner._loop)
        return asyncio.wrap_future(fut)

    async def append(self, event: Event) -> Appended:
        return await self.submit(event)

    async def write_checkpoint(self) -> object:
        """Sign the writer's head (as the sidecar's writer does for ``POST /v1/tokens``)."""
        return await self._owner.write_checkpoint()


@dataclass
class Tokens:
    admin: str
    auditor: str
    auditor_acme: str
    admin_acme: str
    engine: str
    revoked: str
    admin_id: str
    auditor_id: str


def make_tokens(engine: Engine) -> Tokens:
    with make_sessionmaker(engine)() as session:
        repo = TokenRepository(session)
        admin_rec, admin = repo.create(Role.ADMIN, name="root admin")
        auditor_rec, auditor = repo.create(Role.AUDITOR, name="auditor")
        _, auditor_acme = repo.create(Role.AUDITOR, tenant="acme", name="acme auditor")
        _, admin_acme = repo.create(Role.ADMIN, tenant="acme", name="acme admin")
        _, engine_token = repo.create(Role.ENGINE, name="engine")
        revoked_rec, revoked = repo.create(Role.AUDITOR, name="old")
        repo.revoke(revoked_rec.id)
        session.commit()
    return Tokens(
        admin=admin,
        auditor=auditor,
        auditor_acme=auditor_acme,
        admin_acme=admin_acme,
        engine=engine_token,
        revoked=revoked,
        admin_id=admin_rec.id,
        auditor_id=auditor_rec.id,
    )


@dataclass
class Seeded:
    """Names and the expected numbers of the seeded ledger."""

    digests: dict[str, str]
    users: dict[str, str]  # raw id -> pseudonym (raw ids only ever live in the test)


def seed_ledger(writer: WriterThread, pseudo: Pseudonymizer) -> Seeded:
    """A small but realistic history through the real writer (one event per call, in order)."""
    users = {
        "alice@acme.example": pseudo.user("acme", "alice@acme.example"),
        "bob@acme.example": pseudo.user("acme", "bob@acme.example"),
        "carol@globex.example": pseudo.user("globex", "carol@globex.example"),
    }
    alice, bob, carol = users.values()
    digests = {
        name: pseudo.key_digest(f"llama@1@{i}@{name}@tenant%{tenant}")
        for i, (name, tenant) in enumerate(
            [
                ("a1", "acme"),
                ("a2", "acme"),
                ("a3", "acme"),
                ("b1", "acme"),
                ("g1", "globex"),
                ("g2", "globex"),
            ]
        )
    }

    def at(minutes: int) -> datetime:
        return T0 + timedelta(minutes=minutes)

    events: list[Event] = []

    def decision(minute: int, did: str, tenant: str, op: str, allowed: bool, reasons: list[str]):
        events.append(
            Event(
                kind=EventKind.POLICY_DECISION,
                tenant=tenant,
                decision_id=did,
                policy_revision=POLICY_REV,
                outcome=Outcome.ALLOW if allowed else Outcome.DENY,
                attrs={
                    "decision_id": did,
                    "policy_revision": POLICY_REV,
                    "data_revision": "data-1",
                    "input_digest": secrets.token_hex(32),
                    "allowed": allowed,
                    "reasons": reasons,
                    "tiers": ["memory", "filesystem"] if allowed else [],
                    "ttl_s": 86400 if allowed else None,
                    "scope": "tenant",
                    "operation": op,
                },
                occurred_at=at(minute),
            )
        )

    def put(minute, name, tenant, owner, request_id, tiers, size, sens, scope_user=None):
        events.append(
            Event(
                kind=EventKind.KV_PUT,
                tenant=tenant,
                actor=owner,
                request_id=request_id,
                key_digest=digests[name],
                tier=tiers[0],
                nbytes=size,
                outcome=Outcome.OK,
                decision_id=f"d-put-{tenant}",
                policy_revision=POLICY_REV,
                principal="engine:vllm-0",
                entry=EntryChange(
                    key_digest=digests[name],
                    state=EntryState.LIVE,
                    tenant=tenant,
                    owner=owner,
                    scope_user=scope_user,
                    scope=Scope.USER if scope_user else Scope.TENANT,
                    sensitivity=sens,
                    model="meta-llama/Llama-3.1-8B-Instruct",
                    size=size,
                    tiers=tuple(tiers),
                    key_id=f"t:{tenant}",
                    key_version=1,
                    expires_at=at(minute) + timedelta(days=1),
                    request_id=request_id,
                    decision_id=f"d-put-{tenant}",
                    policy_revision=POLICY_REV,
                ),
                occurred_at=at(minute),
            )
        )

    def lookup(minute, kind, name, tenant, actor, request_id, tier=None, reason=None):
        events.append(
            Event(
                kind=kind,
                tenant=tenant,
                actor=actor,
                request_id=request_id,
                key_digest=digests[name] if name else None,
                tier=tier,
                nbytes=None,
                outcome={
                    EventKind.KV_GET: Outcome.HIT,
                    EventKind.KV_MISS: Outcome.MISS,
                    EventKind.KV_DENIED: Outcome.DENY,
                }[kind],
                reason=reason,
                policy_revision=POLICY_REV,
                principal="engine:vllm-0",
                occurred_at=at(minute),
            )
        )

    decision(0, "d-put-acme", "acme", "put", True, [])
    decision(0, "d-put-globex", "globex", "put", True, [])
    put(1, "a1", "acme", alice, "req-a1", ["memory", "filesystem"], 1000, Sensitivity.INTERNAL)
    put(2, "a2", "acme", alice, "req-a1", ["memory"], 2000, Sensitivity.INTERNAL)
    put(3, "a3", "acme", alice, "req-a1", ["filesystem"], 4000, Sensitivity.CONFIDENTIAL, alice)
    put(4, "b1", "acme", bob, "req-b1", ["memory"], 8000, Sensitivity.PHI, bob)
    put(5, "g1", "globex", carol, "req-g1", ["redis"], 16000, Sensitivity.INTERNAL)
    put(6, "g2", "globex", carol, "req-g1", ["memory"], 32000, Sensitivity.INTERNAL)
    # bob's request reuses two of alice's tenant-wide chunks: a2 first, then a1
    lookup(10, EventKind.KV_GET, "a2", "acme", bob, "req-a2", tier="memory")
    lookup(11, EventKind.KV_GET, "a1", "acme", bob, "req-a2", tier="filesystem")
    lookup(12, EventKind.KV_GET, "a1", "acme", alice, "req-a3", tier="memory")
    lookup(12, EventKind.KV_MISS, None, "acme", alice, "req-a3")
    decision(13, "d-deny-acme", "acme", "get", False, ["cross_user_scope"])
    lookup(13, EventKind.KV_DENIED, "a3", "acme", bob, "req-a4", reason="cross_user_scope")
    decision(14, "d-deny-globex", "globex", "put", False, ["sensitivity_not_cacheable"])
    lookup(15, EventKind.KV_GET, "g1", "globex", carol, "req-g2", tier="redis")
    lookup(15, EventKind.KV_MISS, None, "globex", carol, "req-g2")
    lookup(16, EventKind.KV_MISS, None, "globex", carol, "req-g3")
    events.append(
        Event(
            kind=EventKind.KV_EVICT,
            tenant="globex",
            key_digest=digests["g2"],
            tier="memory",
            reason="lru",
            entry=EntryChange(key_digest=digests["g2"], state=EntryState.DELETED, tiers=()),
            occurred_at=at(17),
        )
    )
    for event in events:
        writer.run(writer.writer.append(event))
    writer.run(writer.writer.write_checkpoint())
    return Seeded(digests=digests, users=users)


#: what the seeded ledger must show, per tenant
EXPECTED_STATS = {
    "acme": {
        "entries": 4,
        "live_bytes_by_tier": {"memory": 11000, "filesystem": 5000},
        "puts": 4,
        "hits": 3,
        "misses": 1,
        "hit_rate": 0.75,
        "denials": 1,
    },
    "globex": {
        "entries": 1,
        "live_bytes_by_tier": {"redis": 16000},
        "puts": 2,
        "hits": 1,
        "misses": 2,
        "hit_rate": 1 / 3,
        "denials": 0,
    },
}


@dataclass
class ApiWorld:
    app: FastAPI
    engine: Engine
    ctx: ApiContext
    writer: WriterThread
    tokens: Tokens
    seeded: Seeded
    pseudo: Pseudonymizer
    #: the real purge service on the same database (the sidecar's executor is played by
    #: :meth:`purge`), signing with the ledger's key file like a sidecar does
    purges: PurgeService
    settings: Settings
    #: the tier the purge service deletes from (what a sidecar's memory tier would hold)
    memory: MemoryTier
    #: the database the CLI reaches (the same as ``engine``)
    database_url: str = ""
    #: ids a test module seeded (purge ids, ...), by name
    ids: dict[str, str] = field(default_factory=dict)

    async def cli(self, *args: str) -> Result:
        """``kvgov ARGS`` on this node's configuration and database (in a thread: commands
        such as ``purge status`` run their own event loop)."""
        from kvgov.cli.main import build_app

        env = {
            "KVGOV_DATABASE_URL": self.database_url,
            "KVGOV_DATA_DIR": str(self.settings.data_dir),
        }
        runner = CliRunner()
        return await asyncio.to_thread(runner.invoke, build_app(), list(args), env=env)

    async def purge(self, tenant: str, user: str | None = None) -> JobView:
        """Create a purge job and run it to the end, receipt included."""
        job = await self.purges.create(PurgeRequest(tenant=tenant, user=user, requested_by="test"))
        return await self.purges.wait(job.id)


def build_app(ctx: ApiContext, purges: PurgeService | None = None) -> FastAPI:
    app = FastAPI(title="kvgov control plane (test)", version="test")
    include_v1(app, ctx)
    if purges is not None:
        include_purges(app, purges)
    return app


@contextmanager
def api_world(
    pg_url: str,
    tmp_path: Path,
    *,
    auth: bool = True,
    seed: bool = True,
    api: dict[str, object] | None = None,
) -> Iterator[ApiWorld]:
    """A migrated, seeded Postgres ledger and the API over it (``api``: more ``api.*``
    settings)."""
    upgrade(pg_url)
    engine = make_engine(pg_url)
    # a configured node: the ledger's signing key and the KEK in their files, as `kvgov init`
    # leaves them (receipts are verified against that key; key rotation wraps with that KEK)
    settings = Settings(
        data_dir=tmp_path / "kvgov",
        api={"auth": auth, **(api or {})},
        purge={"poll_interval_s": 0.05},
    )
    generate_signing_key_file(settings.signing_key_path)
    generate_kek_file(settings.kek_path)
    signing_key = load_signing_key(settings.signing_key_path)
    seeder = WriterThread(engine, "seed-node", signing_key)  # a chain of a trusted key
    api_writer = WriterThread(engine, "api-node", signing_key)
    try:
        # in its key file too, so that the CLI on this node pseudonymises as the API does
        generate_pseudonym_key_file(settings.pseudonym_key_path)
        pseudo = Pseudonymizer.from_file(settings.pseudonym_key_path)
        seeded = seed_ledger(seeder, pseudo) if seed else Seeded({}, {})
        tokens = make_tokens(engine)
        ctx = ApiContext(
            settings=settings,
            engine=engine,
            sink=api_writer.sink,
            pseudonymizer=pseudo,
            session_secret=secrets.token_bytes(32),
        )
        memory = MemoryTier(16 << 20)
        purges = make_service(
            settings,
            sessions=make_sessionmaker(engine),
            sink=api_writer.sink,
            tiers=[memory],
            shredder=StoreShredder(SqlKeyStore(engine)),
            signing_key=signing_key,
            pseudonymize=pseudo.user,
            checkpoint=writer_checkpointer(api_writer, engine, api_writer.chain_id),
        )
        yield ApiWorld(
            app=build_app(ctx, purges),
            engine=engine,
            ctx=ctx,
            writer=api_writer,
            tokens=tokens,
            seeded=seeded,
            pseudo=pseudo,
            purges=purges,
            settings=settings,
            memory=memory,
            database_url=pg_url,
        )
    finally:
        api_writer.close()
        seeder.close()
        engine.dispose()


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}

"""The purge service against real components: Postgres ledger (real LedgerWriter), real memory
and filesystem tiers, real keyring + sealed chunks, real Ed25519 receipts and ledger verify.

The data a sidecar would have put is seeded the way the data plane records it: seal under the
keyring, store in the tiers, append a ``kv:put`` event whose EntryChange creates the entry.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import os
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import Engine, func, select
from sqlalchemy.exc import OperationalError

from kvgov.config import Settings
from kvgov.connectors.tiers.filesystem import FilesystemTier
from kvgov.connectors.tiers.memory import MemoryTier
from kvgov.db import purge_jobs as jobs
from kvgov.db import sidecars
from kvgov.db.engine import make_engine, make_sessionmaker, upgrade, utcnow
from kvgov.db.keystore import SqlKeyStore
from kvgov.db.models import CacheEntry, EventPayload, LedgerEvent, PurgeJob, Tenant, UserRef
from kvgov.db.purge_views import PurgeRequest, StepName
from kvgov.errors import KeyDestroyedError
from kvgov.keys.kek import FileKekProvider, generate_kek_file
from kvgov.keys.keyring import Keyring
from kvgov.ledger.chain import public_key_bytes
from kvgov.ledger.events import EntryChange, Event
from kvgov.ledger.pseudonym import Pseudonymizer
from kvgov.ledger.verify import verify
from kvgov.ledger.writer import LedgerWriter
from kvgov.services.purge.build import make_service, writer_checkpointer
from kvgov.services.purge.ports import KeyringShredder, TierSet
from kvgov.services.purge.receipts import verify_receipt
from kvgov.services.purge.retention import apply_retention
from kvgov.services.purge.service import PurgeService
from kvgov.types import EntryState, EventKind, PurgeState, Scope

pytestmark = pytest.mark.postgres

CHAIN = "test-sidecar-chain"
N = 6  # chunks per (tenant, user)


@dataclass
class Env:
    settings: Settings
    engine: Engine
    writer: LedgerWriter
    key: Ed25519PrivateKey
    keyring: Keyring
    store: SqlKeyStore
    kek: FileKekProvider
    memory: MemoryTier
    fs: FilesystemTier
    pseudo: Pseudonymizer
    digests: dict[tuple[str, str], list[str]] = field(default_factory=dict)
    sealed: dict[str, bytes] = field(default_factory=dict)

    def service(
        self, *, sidecar_id: str | None = None, shredder: Any = None, **overrides: object
    ) -> PurgeService:
        settings = self.settings
        if overrides:
            settings = self.settings.model_copy(
                update={"purge": self.settings.purge.model_copy(update=overrides)}
            )
        return make_service(
            settings,
            sessions=make_sessionmaker(self.engine),
            sink=self.writer,
            tiers=[self.memory, self.fs],
            shredder=shredder or KeyringShredder(self.keyring),
            signing_key=self.key,
            pseudonymize=self.pseudo.user,
            checkpoint=writer_checkpointer(self.writer, self.engine, CHAIN),
            sidecar_id=sidecar_id,
            principal=f"sidecar:{sidecar_id}" if sidecar_id else "test",
        )

    def count(self, model: type, *where: object) -> int:
        with make_sessionmaker(self.engine)() as s:
            return int(s.scalar(select(func.count()).select_from(model).where(*where)) or 0)

    async def seed(self, tenant: str, user: str, *, scope: Scope = Scope.USER) -> list[str]:
        pseud = self.pseudo.user(tenant, user)
        out = []
        for i in range(N):
            tags = f"@tenant%{tenant}" + (f"@user%{user}" if scope is Scope.USER else "")
            cache_key = f"m@1@0@{abs(hash((tenant, user, i))):x}@bfloat16{tags}"
            digest = self.pseudo.key_digest(cache_key)
            plain = f"{tenant}/{user}/{i}/".encode() * 300
            sealed = self.keyring.seal(
                tenant, digest.encode(), plain, user=pseud if scope is Scope.USER else None
            )
            header_key = self.keyring.current(tenant, pseud if scope is Scope.USER else None)
            await self.memory.put(digest, sealed)
            await self.fs.put(digest, sealed)
            self.sealed[digest] = bytes(sealed)
            await self.writer.append(
                Event(
                    kind=EventKind.KV_PUT,
                    tenant=tenant,
                    actor=pseud,
                    key_digest=digest,
                    nbytes=len(plain),
                    payload={"prompt_excerpt": f"secret words of {user}"},
                    entry=EntryChange(
                        key_digest=digest,
                        state=EntryState.LIVE,
                        tenant=tenant,
                        owner=pseud,
                        scope_user=pseud if scope is Scope.USER else None,
                        scope=scope,
                        size=len(plain),
                        tiers=("memory", "filesystem"),
                        key_id=header_key.key_id,
                        key_version=header_key.version,
                    ),
                )
            )
            out.append(digest)
        self.digests[(tenant, user)] = out
        return out


@contextlib.asynccontextmanager
async def world(url: str, tmp_path: Path) -> AsyncIterator[Env]:
    """The purge service's world on the database ``url``: a real ledger writer, memory and
    filesystem tiers, a real keyring (the attacks of ``tests/security`` use it too)."""
    upgrade(url)
    engine = make_engine(url)
    settings = Settings(
        data_dir=tmp_path,
        database={"url": url},
        tiers={"filesystem_fsync": False},
        purge={"poll_interval_s": 0.05, "job_timeout_s": 30.0, "http_timeout_s": 2.0},
    )
    key = Ed25519PrivateKey.generate()
    writer = LedgerWriter(engine, chain_id=CHAIN, signing_key=key)
    await writer.start()
    kek = FileKekProvider(generate_kek_file(tmp_path / "kek.key"))
    store = SqlKeyStore(engine)
    fs = await FilesystemTier.open(tmp_path / "fs", fsync=False)
    try:
        yield Env(
            settings=settings,
            engine=engine,
            writer=writer,
            key=key,
            keyring=Keyring(store, kek),
            store=store,
            kek=kek,
            memory=MemoryTier(64 << 20),
            fs=fs,
            pseudo=Pseudonymizer(os.urandom(32)),
        )
    finally:
        await writer.close()
        await fs.close()
        engine.dispose()


@pytest.fixture
async def env(pg_url: str, tmp_path: Path) -> AsyncIterator[Env]:
    async with world(pg_url, tmp_path) as e:
        yield e


async def _held(env: Env, digests: list[str]) -> dict[str, int]:
    return {
        "memory": sum([await env.memory.contains(d) for d in digests]),
        "filesystem": sum([await env.fs.contains(d) for d in digests]),
    }


async def test_user_purge_erases_everywhere_and_keeps_others(env: Env) -> None:
    u = await env.seed("acme", "alice")
    v = await env.seed("acme", "bob")
    shared = await env.seed("acme", "alice", scope=Scope.TENANT)  # alice's tenant-scoped chunks
    other = await env.seed("globex", "alice")  # same user id, another tenant
    copied_aside = env.sealed[u[0]]
    alice = env.pseudo.user("acme", "alice")

    service = env.service()
    job = await service.create(PurgeRequest(tenant="acme", user="alice"))
    job = await asyncio.wait_for(service.wait(job.id), 30)

    assert job.state is PurgeState.COMPLETED
    # gone from every tier, still there for everyone else
    assert await _held(env, u + shared) == {"memory": 0, "filesystem": 0}
    assert await _held(env, v) == {"memory": N, "filesystem": N}
    assert await _held(env, other) == {"memory": N, "filesystem": N}
    # the ledger index says purged for alice's entries only
    assert env.count(CacheEntry, CacheEntry.state == EntryState.PURGED) == 2 * N
    assert env.count(CacheEntry, CacheEntry.state == EntryState.LIVE) == 2 * N
    # a ciphertext copied aside before the purge can no longer be opened
    fresh = Keyring(env.store, env.kek)
    with pytest.raises(KeyDestroyedError):
        fresh.open(copied_aside, tenant="acme", cache_key=u[0].encode())
    # bob's data still opens
    assert fresh.open(env.sealed[v[0]], tenant="acme", cache_key=v[0].encode())
    # erasable payloads: alice's gone, bob's kept; the user ref is marked erased
    alice_events = select(LedgerEvent.seq).where(LedgerEvent.actor == alice)
    assert (
        env.count(
            EventPayload, EventPayload.seq.in_(alice_events), EventPayload.payload.is_not(None)
        )
        == 0
    )
    assert env.count(EventPayload, EventPayload.payload.is_not(None)) == 2 * N
    assert env.count(UserRef, UserRef.pseudonym == alice, UserRef.erased_at.is_not(None)) == 1
    # the chain still verifies after the erasure
    report = await asyncio.to_thread(verify, env.engine)
    assert report.ok, report.to_dict()
    # the signed receipt
    assert job.receipt is not None
    check = verify_receipt(job.receipt, [public_key_bytes(env.key)])
    assert check.ok, check.reason
    r = job.receipt["receipt"]
    assert r["state"] == "completed"
    assert r["subject"] == alice
    assert r["tiers"] == {"memory": 2 * N, "filesystem": 2 * N}
    assert r["entries_purged"] == 2 * N
    assert {k["key_id"] for k in r["keys_destroyed"]} == {f"u:acme:{alice}"}
    assert r["ledger"]["erasure_event"]["chain_id"] == CHAIN
    assert r["ledger"]["checkpoint"]["seq"] >= r["ledger"]["erasure_event"]["seq"]
    assert r["ledger"]["payloads_erased"] == 2 * N
    kinds = {row for (row,) in _rows(env, select(LedgerEvent.kind))}
    assert {"purge:requested", "purge:step", "user:data:purged", "ledger:payload:erased"} <= kinds
    # a tampered receipt does not verify
    forged = {**job.receipt, "receipt": {**r, "tiers": {"memory": 0}}}
    assert not verify_receipt(forged, [public_key_bytes(env.key)]).ok
    assert not verify_receipt(job.receipt, [public_key_bytes(Ed25519PrivateKey.generate())]).ok

    # running the same purge again is harmless and finds nothing left
    again = await service.create(PurgeRequest(tenant="acme", user="alice"))
    again = await asyncio.wait_for(service.wait(again.id), 30)
    assert again.state is PurgeState.COMPLETED
    r2 = again.receipt["receipt"] if again.receipt else {}
    assert r2["entries_purged"] == 0
    assert r2["tiers"] == {"memory": 0, "filesystem": 0}
    assert r2["keys_destroyed"] == []
    assert r2["ledger"]["payloads_erased"] == 0


def _rows(env: Env, query: object) -> list[tuple[object, ...]]:
    with make_sessionmaker(env.engine)() as s:
        return [tuple(r) for r in s.execute(query)]  # type: ignore[call-overload]


async def test_dry_run_changes_nothing(env: Env) -> None:
    u = await env.seed("acme", "alice")
    await env.seed("acme", "bob")
    await env.writer.flush()
    events_before = env.count(LedgerEvent)
    plan = await env.service().plan(PurgeRequest(tenant="acme", user="alice", dry_run=True))
    assert plan.entries_in_scope == N
    assert plan.present_in_reachable_tiers == {"memory": N, "filesystem": N}
    assert [k.key_id for k in plan.keys_to_destroy] == [
        f"u:acme:{env.pseudo.user('acme', 'alice')}"
    ]
    assert plan.payloads_to_erase == N
    # nothing changed: no job, no event, data and keys intact
    assert env.count(PurgeJob) == 0
    assert env.count(LedgerEvent) == events_before
    assert await _held(env, u) == {"memory": N, "filesystem": N}
    assert env.count(CacheEntry, CacheEntry.state == EntryState.LIVE) == 2 * N
    assert Keyring(env.store, env.kek).open(
        env.sealed[u[0]], tenant="acme", cache_key=u[0].encode()
    )


async def test_tenant_purge_erases_every_user_of_the_tenant(env: Env) -> None:
    a = await env.seed("acme", "alice")
    b = await env.seed("acme", "bob")
    g = await env.seed("globex", "carol")
    service = env.service()
    job = await service.create(PurgeRequest(tenant="acme"))
    job = await asyncio.wait_for(service.wait(job.id), 30)
    assert job.state is PurgeState.COMPLETED
    assert await _held(env, a + b) == {"memory": 0, "filesystem": 0}
    assert await _held(env, g) == {"memory": N, "filesystem": N}
    assert job.receipt is not None
    r = job.receipt["receipt"]
    assert r["kind"] == "tenant" and r["subject"] is None
    assert len(r["keys_destroyed"]) == 2
    kinds = {k for (k,) in _rows(env, select(LedgerEvent.kind))}
    assert "tenant:data:purged" in kinds
    assert (await asyncio.to_thread(verify, env.engine)).ok


async def test_unregistered_work_ends_incomplete_naming_the_sidecar(env: Env) -> None:
    await env.seed("acme", "alice")
    with make_sessionmaker(env.engine).begin() as s:
        sidecars.heartbeat(s, "sidecar-gone", now=utcnow(), chain_id=None)
    service = env.service(job_timeout_s=1.0)
    job = await service.create(PurgeRequest(tenant="acme", user="alice"))
    labels = {s.label for s in job.steps}
    assert {"tiers@sidecar-gone", "engines@sidecar-gone"} <= labels
    job = await asyncio.wait_for(service.wait(job.id), 30)
    assert job.state is PurgeState.INCOMPLETE
    assert job.receipt is not None
    r = job.receipt["receipt"]
    assert r["state"] == "incomplete"
    assert any("sidecar-gone" in line for line in r["incomplete"])
    assert verify_receipt(job.receipt, [public_key_bytes(env.key)]).ok
    # what this process could reach was still erased
    assert await _held(env, env.digests[("acme", "alice")]) == {"memory": 0, "filesystem": 0}


async def test_sidecars_sharing_the_database_each_take_their_own_steps(env: Env) -> None:
    await env.seed("acme", "alice")
    with make_sessionmaker(env.engine).begin() as s:
        for sid in ("sc-a", "sc-b"):
            sidecars.heartbeat(s, sid, now=utcnow(), chain_id=None)
    a, b = env.service(sidecar_id="sc-a"), env.service(sidecar_id="sc-b")
    job = await a.create(PurgeRequest(tenant="acme", user="alice"))
    await asyncio.gather(a.run_until_idle(), b.run_until_idle(), a.run_until_idle())
    job = await asyncio.wait_for(a.wait(job.id), 30)
    assert job.state is PurgeState.COMPLETED
    by_label = {s.label: s for s in job.steps}
    assert set(by_label) == {
        "keys", "tiers", "ledger",
        "tiers@sc-a", "engines@sc-a", "gpu@sc-a", "tiers@sc-b", "engines@sc-b", "gpu@sc-b",
    }  # fmt: skip
    assert all(s.attempts == 1 for s in job.steps), [(s.label, s.attempts) for s in job.steps]
    assert by_label["tiers@sc-a"].detail["executed_by"] == "sidecar:sc-a"
    assert by_label["tiers@sc-b"].detail["executed_by"] == "sidecar:sc-b"


async def test_a_step_left_running_by_a_dead_process_is_taken_again(env: Env) -> None:
    u = await env.seed("acme", "alice")
    service = env.service(step_lease_s=0.2)
    job = await service.create(PurgeRequest(tenant="acme", user="alice"))
    # a process claims the first step and dies before finishing it
    with make_sessionmaker(env.engine).begin() as s:
        claimed = jobs.claim_step(
            s, sidecar_id=None, now=utcnow(), lease_s=0.2, job_timeout_s=30, job_id=job.id
        )
    assert claimed is not None
    await asyncio.sleep(0.3)
    job = await asyncio.wait_for(service.wait(job.id), 30)
    assert job.state is PurgeState.COMPLETED
    retried = next(s for s in job.steps if s.id == claimed[1].id)
    assert retried.attempts == 2
    assert await _held(env, u) == {"memory": 0, "filesystem": 0}


class _LockedOnce(KeyringShredder):
    """The real shredder, after one attempt that fails as SQLite does when another writer
    committed between a transaction's read and its write (fault injection)."""

    def __init__(self, keyring: Keyring) -> None:
        super().__init__(keyring)
        self.calls = 0

    def shred(self, tenant: str, user: str | None = None) -> Any:
        self.calls += 1
        if self.calls == 1:
            raise OperationalError("UPDATE data_keys ...", {"key_id": "k"}, Exception("locked"))
        return super().shred(tenant, user)


async def test_a_step_that_meets_a_database_error_is_retried(env: Env) -> None:
    await env.seed("acme", "alice")
    shredder = _LockedOnce(env.keyring)
    service = env.service(shredder=shredder)
    job = await service.create(PurgeRequest(tenant="acme", user="alice"))
    job = await asyncio.wait_for(service.wait(job.id), 30)
    assert job.state is PurgeState.COMPLETED  # within the job's time, not after it ran out
    keys = next(s for s in job.steps if s.name is StepName.KEYS)
    assert keys.state is PurgeState.COMPLETED
    assert keys.attempts == 2
    assert shredder.calls == 2
    assert keys.detail["destroyed"]


class _VllmStandIn(http.server.BaseHTTPRequestHandler):
    """A loopback stand-in for vLLM's ``POST /reset_prefix_cache`` (vLLM cannot run here)."""

    calls: list[str] = []

    def do_POST(self) -> None:
        type(self).calls.append(self.path)
        ok = self.path == "/reset_prefix_cache"
        self.send_response(200 if ok else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def vllm_stand_in() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _VllmStandIn)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _VllmStandIn.calls = []
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


async def test_gpu_prefix_cache_reset_recorded_and_unreachable_engine_named(
    env: Env, vllm_stand_in: str
) -> None:
    await env.seed("acme", "alice")
    dead = "http://127.0.0.1:9"  # discard port: nothing listens
    service = env.service(vllm_engines=[vllm_stand_in, dead])
    job = await service.create(PurgeRequest(tenant="acme", user="alice"))
    job = await asyncio.wait_for(service.wait(job.id), 30)
    assert _VllmStandIn.calls == ["/reset_prefix_cache"]
    assert job.state is PurgeState.INCOMPLETE
    assert job.receipt is not None
    r = job.receipt["receipt"]
    results = {g["engine"]: g for g in r["gpu_reset"]}
    assert results[vllm_stand_in]["ok"] is True and results[vllm_stand_in]["status"] == 200
    assert results[dead]["ok"] is False
    assert any("gpu" in line for line in r["incomplete"])


async def test_retention_and_ttl_use_the_same_deletion_path(env: Env) -> None:
    old = await env.seed("acme", "alice")
    keep = await env.seed("globex", "bob")
    ttl = await env.seed("globex", "carol")
    await env.writer.flush()
    past = utcnow().replace(year=2000)
    with make_sessionmaker(env.engine).begin() as s:
        s.add(Tenant(id="acme", retention_s=60, created_at=utcnow()))
        for row in s.scalars(select(CacheEntry).where(CacheEntry.key_digest.in_(old))):
            row.created_at = past
        for row in s.scalars(select(CacheEntry).where(CacheEntry.key_digest.in_(ttl))):
            row.expires_at = past
    report = await apply_retention(
        make_sessionmaker(env.engine), TierSet([env.memory, env.fs]), env.writer, now=utcnow()
    )
    assert report.retention_expired == N and report.ttl_expired == N
    assert report.deleted == {"memory": 2 * N, "filesystem": 2 * N}
    assert await _held(env, old + ttl) == {"memory": 0, "filesystem": 0}
    assert await _held(env, keep) == {"memory": N, "filesystem": N}
    assert env.count(CacheEntry, CacheEntry.state == EntryState.EXPIRED) == 2 * N
    again = await apply_retention(
        make_sessionmaker(env.engine), TierSet([env.memory, env.fs]), env.writer, now=utcnow()
    )
    assert again.ttl_expired == again.retention_expired == 0
    assert (await asyncio.to_thread(verify, env.engine)).ok


async def test_user_purge_covers_entries_the_user_re_put(env: Env) -> None:
    """A re-put of a live entry keeps its first owner; the re-putting user's purge still
    covers it (scope errs on deleting more). A mere read does not put a key in scope."""
    mine = await env.seed("acme", "alice", scope=Scope.TENANT)
    theirs = await env.seed("globex", "bob", scope=Scope.TENANT)
    alice, bob = env.pseudo.user("acme", "alice"), env.pseudo.user("acme", "bob")
    re_put, read = mine[0], mine[1]
    await env.writer.append(
        Event(
            kind=EventKind.KV_PUT,
            tenant="acme",
            actor=bob,
            key_digest=re_put,
            entry=EntryChange(
                key_digest=re_put,
                state=EntryState.LIVE,
                tenant="acme",
                owner=bob,
                scope=Scope.TENANT,
                tiers=("memory", "filesystem"),
            ),
        )
    )
    await env.writer.append(Event(kind=EventKind.KV_GET, tenant="acme", actor=bob, key_digest=read))
    assert env.count(CacheEntry, CacheEntry.key_digest == re_put, CacheEntry.owner == alice) == 1

    service = env.service()
    plan = await service.plan(PurgeRequest(tenant="acme", user="bob", dry_run=True))
    assert plan.entries_in_scope == 1
    job = await service.create(PurgeRequest(tenant="acme", user="bob"))
    job = await asyncio.wait_for(service.wait(job.id), 30)

    assert job.state is PurgeState.COMPLETED
    assert await _held(env, [re_put]) == {"memory": 0, "filesystem": 0}
    assert await _held(env, mine[1:]) == {"memory": N - 1, "filesystem": N - 1}
    assert await _held(env, theirs) == {"memory": N, "filesystem": N}
    assert env.count(CacheEntry, CacheEntry.state == EntryState.PURGED) == 1
    assert (
        env.count(
            CacheEntry, CacheEntry.key_digest == re_put, CacheEntry.state == EntryState.PURGED
        )
        == 1
    )
    report = await asyncio.to_thread(verify, env.engine)
    assert report.ok, report.to_dict()


async def test_a_misspelt_user_id_is_flagged_before_it_purges_nothing(env: Env) -> None:
    """Ids are matched exactly, as the gateway sent them (their keyed pseudonym): an operator
    who types ``Alice`` for the gateway's ``alice`` would get a completed purge, and a signed
    receipt, that erased nothing of hers. The plan says the id is unknown and that another
    spelling of it has data; an id nobody used is unknown with no near miss."""
    await env.seed("acme", "alice")
    await env.seed("globex", "ALICE")  # another tenant's: never a near miss for acme
    await env.writer.flush()
    service = env.service()

    async def check(user: str | None) -> tuple[bool | None, int, int]:
        req = PurgeRequest(tenant="acme", user=user, dry_run=True)
        plan = await service.plan(req)
        assert (plan.subject_known, plan.spelling_variants_known) == await service.subject_check(
            req
        )
        return plan.subject_known, plan.spelling_variants_known, plan.entries_in_scope

    assert await check("alice") == (True, 0, N)
    assert await check("Alice") == (False, 1, 0)
    assert await check(" alice ") == (False, 1, 0)
    assert await check("ALICE") == (False, 1, 0)
    assert await check("zed") == (False, 0, 0)
    assert await check(None) == (None, 0, N)  # the whole tenant: no subject to check

"""How long purging one user takes: 10,000 entries across the memory and filesystem tiers, on
Postgres, through the real purge service (ledger writer, keyring, tiers, receipt).

One run creates and drops its own Postgres database. It seeds the user's entries the way the
data plane records them (sealed chunk in both tiers, ``kv:put`` event with its EntryChange and
an erasable payload) plus another user's entries that must survive, then times the purge end
to end and each step, next to the bare tier deletes of the same keys (the floor: what deleting
costs with no ledger, no verification and no receipt). Target: under 10 seconds.

    python bench/purge.py [--entries 10000] [--chunk-bytes 4096]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psycopg
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import func, select

from kvgov.config import Settings
from kvgov.connectors.tiers.filesystem import FilesystemTier
from kvgov.connectors.tiers.memory import MemoryTier
from kvgov.db.engine import make_engine, make_sessionmaker, upgrade
from kvgov.db.keystore import SqlKeyStore
from kvgov.db.models import CacheEntry
from kvgov.db.purge_views import PurgeRequest
from kvgov.keys.kek import FileKekProvider, generate_kek_file
from kvgov.keys.keyring import Keyring
from kvgov.ledger.events import EntryChange, Event
from kvgov.ledger.pseudonym import Pseudonymizer
from kvgov.ledger.verify import verify
from kvgov.ledger.writer import LedgerWriter
from kvgov.services.purge.build import make_service, writer_checkpointer
from kvgov.services.purge.ports import KeyringShredder
from kvgov.types import EntryState, EventKind, PurgeState, Scope

ADMIN_DSN = os.environ.get("KVGOV_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")
CHAIN = "bench-purge"


async def seed(
    writer: LedgerWriter,
    keyring: Keyring,
    tiers: list[MemoryTier | FilesystemTier],
    pseudo: Pseudonymizer,
    user: str,
    count: int,
    chunk: int,
) -> list[str]:
    p = pseudo.user("acme", user)
    plain = os.urandom(chunk)
    handle = keyring.current("acme", p)
    digests = []
    futures = []
    for i in range(count):
        digest = pseudo.key_digest(f"bench@1@0@{i:x}@bfloat16@tenant%acme@user%{user}")
        sealed = keyring.seal("acme", digest.encode(), plain, user=p)
        for tier in tiers:
            await tier.put(digest, sealed)
        futures.append(
            writer.submit(
                Event(
                    kind=EventKind.KV_PUT,
                    tenant="acme",
                    actor=p,
                    key_digest=digest,
                    nbytes=chunk,
                    payload={"note": "erasable detail"},
                    entry=EntryChange(
                        key_digest=digest,
                        state=EntryState.LIVE,
                        tenant="acme",
                        owner=p,
                        scope_user=p,
                        scope=Scope.USER,
                        size=chunk,
                        tiers=tuple(t.name for t in tiers),
                        key_id=handle.key_id,
                        key_version=handle.version,
                    ),
                ),
            )
        )
        digests.append(digest)
    await asyncio.gather(*futures)
    return digests


async def run(entries: int, chunk: int, url: str, work: Path) -> int:
    upgrade(url)
    engine = make_engine(url)
    settings = Settings(data_dir=work, database={"url": url}, purge={"poll_interval_s": 0.01})
    key = Ed25519PrivateKey.generate()
    writer = LedgerWriter(engine, chain_id=CHAIN, signing_key=key)
    await writer.start()
    keyring = Keyring(SqlKeyStore(engine), FileKekProvider(generate_kek_file(work / "kek.key")))
    memory = MemoryTier(1 << 30)
    fs = await FilesystemTier.open(work / "fs", fsync=False)
    pseudo = Pseudonymizer(os.urandom(32))
    try:
        t0 = time.perf_counter()
        user_keys = await seed(writer, keyring, [memory, fs], pseudo, "alice", entries, chunk)
        other = await seed(writer, keyring, [memory, fs], pseudo, "bob", entries // 10, chunk)
        await writer.flush()
        print(f"seeded {len(user_keys)} + {len(other)} entries in {time.perf_counter() - t0:.1f} s")

        # the floor: bare deletes of the same number of keys from both tiers (another user's
        # copies, so the purge below still finds its own)
        floor_keys = [f"floor-{i}" for i in range(entries)]
        blob = os.urandom(chunk)
        for k in floor_keys:
            await memory.put(k, blob)
            await fs.put(k, blob)
        t0 = time.perf_counter()
        for tier in (memory, fs):
            await asyncio.gather(*(tier.delete(k) for k in floor_keys))
        floor_s = time.perf_counter() - t0

        service = make_service(
            settings,
            sessions=make_sessionmaker(engine),
            sink=writer,
            tiers=[memory, fs],
            shredder=KeyringShredder(keyring),
            signing_key=key,
            pseudonymize=pseudo.user,
            checkpoint=writer_checkpointer(writer, engine, CHAIN),
        )
        t0 = time.perf_counter()
        job = await service.create(PurgeRequest(tenant="acme", user="alice"))
        job = await service.wait(job.id)
        purge_s = time.perf_counter() - t0

        receipt = (job.receipt or {}).get("receipt", {})
        with make_sessionmaker(engine)() as s:
            purged = s.scalar(select(func.count()).where(CacheEntry.state == EntryState.PURGED))
        left = sum([await memory.contains(k) or await fs.contains(k) for k in user_keys])
        kept = sum([await memory.contains(k) and await fs.contains(k) for k in other])
        report = await asyncio.to_thread(verify, engine)
        print(f"\npurge of one user with {entries} entries on Postgres (memory + filesystem)")
        print(f"  state                 {job.state}")
        print(f"  deleted per tier      {receipt.get('tiers')}")
        print(f"  entries marked purged {purged}; still held anywhere: {left}")
        print(f"  other user's entries  {kept}/{len(other)} still held")
        print(f"  ledger verify         {'ok' if report.ok else 'BROKEN'}")
        for step in job.steps:
            if step.started_at and step.finished_at:
                took = (step.finished_at - step.started_at).total_seconds()
                print(f"  step {step.label:<22} {took:7.3f} s")
        print(f"  bare tier deletes     {floor_s:7.3f} s   (floor: no ledger, no verification)")
        print(f"  purge end to end      {purge_s:7.3f} s   target < 10 s")
        print(f"  ratio purge / floor   {purge_s / floor_s:7.1f}x")
        ok = (
            job.state is PurgeState.COMPLETED
            and left == 0
            and kept == len(other)
            and report.ok
            and purge_s < 10.0
        )
        print(f"\n{'PASS' if ok else 'FAIL'}: purge {'under' if purge_s < 10 else 'OVER'} 10 s")
        return 0 if ok else 1
    finally:
        await writer.close()
        await fs.close()
        engine.dispose()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=10_000)
    parser.add_argument("--chunk-bytes", type=int, default=4096)
    args = parser.parse_args()
    name = f"kvgov_bench_purge_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base = ADMIN_DSN.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://", 1)
    try:
        with tempfile.TemporaryDirectory(prefix="kvgov-bench-purge-") as work:
            return asyncio.run(run(args.entries, args.chunk_bytes, f"{base}/{name}", Path(work)))
    finally:
        with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


if __name__ == "__main__":
    sys.exit(main())

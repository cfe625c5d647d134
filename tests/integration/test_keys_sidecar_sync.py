"""A running sidecar keeps its in-memory keys in step with the key store: ``kvgov keys shred``
and ``kvgov keys rotate``, run by the CLI against the same Postgres database, reach it within
``keys.revalidate_interval_s`` (real sidecar, real Rego policy, real keyring, real wire client)."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from typer.testing import CliRunner

from kvgov.cli.main import build_app
from kvgov.config import Settings
from kvgov.db.models import LedgerEvent, table
from kvgov.ledger.verify import verify
from kvgov.policy.cache import CachingPolicyEngine
from kvgov.policy.embedded import EmbeddedPolicyEngine
from kvgov.proxy.app import Sidecar, build_sidecar
from kvgov.types import EventKind
from kvgov.wire import WireClient

pytestmark = pytest.mark.postgres

INTERVAL_S = 0.2
PATIENCE_S = 15.0  # generous: the machine is shared; the bound under test is the interval


def _key(tenant: str, h: str) -> str:
    return f"meta-llama/Llama-3.1-8B@1@0@{h}@bfloat16@tenant%{tenant}"


@pytest.fixture
def cfg(tmp_path: Path, pg_url: str, monkeypatch: pytest.MonkeyPatch) -> Settings:
    # the CLI reads the same data dir (KEK, pseudonym and signing keys) and database
    monkeypatch.setenv("KVGOV_DATA_DIR", str(tmp_path / "kvgov"))
    monkeypatch.setenv("KVGOV_DATABASE_URL", pg_url)
    return Settings(
        dataplane={"host": "127.0.0.1", "port": 0, "lm_port": -1, "buffer_pool_bytes": 64 << 20},
        tiers={"chain": ["memory"]},
        keys={"revalidate_interval_s": INTERVAL_S},
    )


@pytest.fixture
async def sidecar(cfg: Settings) -> AsyncIterator[Sidecar]:
    sc = await build_sidecar(cfg, policy=CachingPolicyEngine(EmbeddedPolicyEngine.from_paths()))
    await sc.start()
    try:
        yield sc
    finally:
        await sc.stop()


async def _run(fn: Callable[..., Any], *args: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


def kvgov(*args: str) -> tuple[int, str]:
    """The real CLI (it runs its own event loop: call it from a worker thread)."""
    result = CliRunner().invoke(build_app(), list(args), catch_exceptions=False)
    return result.exit_code, result.output


class Engine:
    """An inference engine's view of the sidecar over the wire."""

    def __init__(self, sc: Sidecar, engine_id: str, tenant: str) -> None:
        self.sc = sc
        self.tenant = tenant
        self.client = WireClient(f"tcp://127.0.0.1:{sc.server.tcp_port}", engine_id=engine_id)

    async def put(self, h: str, data: bytes) -> None:
        ack = await _run(self.client.put, _key(self.tenant, h), data, None)
        assert ack.ok, ack

    async def get(self, h: str, size: int = 1 << 20) -> bytes | None:
        buf = bytearray(size)
        hit = await _run(self.client.get_into, _key(self.tenant, h), buf, None)
        return None if hit is None else bytes(buf[: hit.length])

    def key_of(self, h: str) -> tuple[str | None, int | None]:
        """The data key version the sidecar sealed that entry under."""
        digest = self.sc.pipeline.pseudonymizer.key_digest(_key(self.tenant, h))
        entry = self.sc.pipeline.index.get(digest)
        assert entry is not None
        return entry.key_id, entry.key_version


async def eventually(check: Callable[[], Awaitable[bool]], what: str) -> None:
    deadline = time.monotonic() + PATIENCE_S
    while not await check():
        if time.monotonic() > deadline:
            pytest.fail(f"never happened: {what}")
        await asyncio.sleep(INTERVAL_S / 4)


def _misses(sc: Sidecar, digest: str) -> list[dict[str, Any]]:
    t = table(LedgerEvent)
    query = select(t).where(t.c.kind == str(EventKind.KV_MISS), t.c.key_digest == digest)
    with sc.engine.connect() as conn:
        return [dict(r._mapping) for r in conn.execute(query)]


async def test_a_cli_shred_reaches_the_running_sidecar(sidecar: Sidecar) -> None:
    demo = Engine(sidecar, "vllm-demo-0", "demo")
    acme = Engine(sidecar, "vllm-acme-0", "acme")
    try:
        d1, a1 = os.urandom(300_000), os.urandom(70_000)
        await demo.put("d1", d1)
        await acme.put("a1", a1)
        assert await demo.get("d1") == d1
        assert demo.key_of("d1") == ("t:demo", 1)

        code, out = await _run(kvgov, "keys", "shred", "--tenant", "demo", "--yes")
        assert code == 0, out
        assert "t:demo v1" in out

        async def demo_is_gone() -> bool:
            return await demo.get("d1") is None

        await eventually(demo_is_gone, "the sidecar drops the shredded key")
        assert await demo.get("d1") is None  # and stays a miss
        assert await acme.get("a1") == a1  # other tenants unaffected, byte for byte

        # new data for the shredded tenant goes under a new version and reads back
        d2 = os.urandom(40_000)
        await demo.put("d2", d2)
        assert demo.key_of("d2") == ("t:demo", 2)
        assert await demo.get("d2") == d2
    finally:
        demo.client.close()
        acme.client.close()
    assert sidecar.writer is not None
    await sidecar.writer.flush()
    digest = sidecar.pipeline.pseudonymizer.key_digest(_key("demo", "d1"))
    misses = _misses(sidecar, digest)
    assert misses and all(m["tenant"] == "demo" and m["outcome"] == "miss" for m in misses)
    shredded = [
        e for e in _kinds(sidecar, EventKind.KEY_SHREDDED) if e["chain_id"] != sidecar.sidecar_id
    ]
    assert [(e["attrs"], e["principal"]) for e in shredded] == [
        ({"key_id": "t:demo", "version": 1}, "cli")
    ]
    assert verify(sidecar.engine).ok


async def test_the_miss_after_a_shred_records_why(sidecar: Sidecar) -> None:
    demo = Engine(sidecar, "vllm-demo-0", "demo")
    try:
        await demo.put("d1", os.urandom(10_000))
        code, out = await _run(kvgov, "keys", "shred", "--tenant", "demo", "--yes")
        assert code == 0, out

        async def demo_is_gone() -> bool:
            return await demo.get("d1") is None

        await eventually(demo_is_gone, "the sidecar drops the shredded key")
    finally:
        demo.client.close()
    assert sidecar.writer is not None
    await sidecar.writer.flush()
    digest = sidecar.pipeline.pseudonymizer.key_digest(_key("demo", "d1"))
    assert {m["reason"] for m in _misses(sidecar, digest)} == {"key_destroyed"}


async def test_a_cli_rotation_reaches_the_running_sidecar(sidecar: Sidecar) -> None:
    demo = Engine(sidecar, "vllm-demo-0", "demo")
    acme = Engine(sidecar, "vllm-acme-0", "acme")
    try:
        a1, d1 = os.urandom(90_000), os.urandom(20_000)
        await acme.put("a1", a1)
        await demo.put("d1", d1)
        assert acme.key_of("a1") == ("t:acme", 1)

        code, out = await _run(kvgov, "keys", "rotate", "--tenant", "acme")
        assert code == 0, out
        assert "t:acme: new writes use v2" in out

        puts = 0

        async def new_puts_use_v2() -> bool:
            nonlocal puts
            puts += 1
            await acme.put(f"a{puts + 1:x}", b"probe" * 1000)
            return acme.key_of(f"a{puts + 1:x}") == ("t:acme", 2)

        await eventually(new_puts_use_v2, "new acme puts use the rotated version")
        a2 = os.urandom(60_000)
        await acme.put("b2", a2)
        assert acme.key_of("b2") == ("t:acme", 2)
        assert await acme.get("b2") == a2
        assert await acme.get("a1") == a1  # sealed under v1 (now retired): still opens
        # the other tenant keeps its key
        await demo.put("d2", b"demo" * 500)
        assert demo.key_of("d2") == ("t:demo", 1)
        assert await demo.get("d1") == d1
    finally:
        demo.client.close()
        acme.client.close()
    assert sidecar.writer is not None
    await sidecar.writer.flush()
    assert verify(sidecar.engine).ok


def _kinds(sc: Sidecar, kind: EventKind) -> list[dict[str, Any]]:
    t = table(LedgerEvent)
    with sc.engine.connect() as conn:
        rows = conn.execute(select(t).where(t.c.kind == str(kind)).order_by(t.c.seq))
        return [dict(r._mapping) for r in rows]

"""The keys a running sidecar creates by itself are in its ledger: a new tenant's first put
records ``key:created`` (key id and version, never material), a user-scoped key names only the
pseudonym, an automatic rotation records ``key:rotated``, an explicit rotation is recorded once,
and the chain verifies (real sidecar on Postgres, real Rego policy, real wire client)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from kvgov.db.models import DataKey, LedgerEvent, table
from kvgov.ledger.verify import verify
from kvgov.proxy.app import Sidecar
from kvgov.services import keys as keys_service
from kvgov.types import EventKind
from kvgov.wire import RequestContext, WireClient
from tests.integration.live import loopback_settings, running_sidecar

pytestmark = pytest.mark.postgres

KEY_KINDS = (EventKind.KEY_CREATED, EventKind.KEY_ROTATED, EventKind.KEY_SHREDDED)


def _key(tenant: str, h: str, user: str | None = None) -> str:
    key = f"meta-llama/Llama-3.1-8B@1@0@{h}@bfloat16@tenant%{tenant}"
    return key + (f"@user%{user}" if user else "")


@pytest.fixture
async def sidecar(tmp_path: Path, pg_url: str) -> AsyncIterator[Sidecar]:
    settings = loopback_settings(
        tmp_path / "data",
        pg_url,
        tiers={"chain": ["memory"]},
        keys={"rotate_after_chunks": 3},
    )
    async with running_sidecar(settings) as sc:
        yield sc


async def _put(sc: Sidecar, engine: str, key: str, ctx: RequestContext | None = None) -> None:
    client = WireClient(f"tcp://127.0.0.1:{sc.server.tcp_port}", engine_id=engine)
    try:
        ack = await asyncio.get_running_loop().run_in_executor(
            None, client.put, key, os.urandom(20_000), ctx
        )
    finally:
        client.close()
    assert ack.ok, ack


def _key_events(sc: Sidecar) -> list[dict[str, Any]]:
    t = table(LedgerEvent)
    query = select(t).where(t.c.kind.in_([str(k) for k in KEY_KINDS])).order_by(t.c.seq)
    with sc.engine.connect() as conn:
        return [dict(r._mapping) for r in conn.execute(query)]


def _wrapped(sc: Sidecar) -> list[bytes]:
    t = table(DataKey)
    with sc.engine.connect() as conn:
        return [bytes(w) for (w,) in conn.execute(select(t.c.wrapped)) if w is not None]


async def _settled(sc: Sidecar) -> list[dict[str, Any]]:
    assert sc.key_events is not None and sc.writer is not None
    await sc.key_events.drain()
    await sc.writer.flush()
    return _key_events(sc)


async def test_a_new_tenants_first_put_records_key_created(sidecar: Sidecar) -> None:
    await _put(sidecar, "vllm-demo-0", _key("demo", "a1"))
    await _put(sidecar, "vllm-demo-0", _key("demo", "a2"))  # same key: nothing new
    events = await _settled(sidecar)
    assert [(e["kind"], e["tenant"], e["attrs"]) for e in events] == [
        ("key:created", "demo", {"key_id": "t:demo", "version": 1}),
    ]
    created = events[0]
    assert created["chain_id"] == sidecar.sidecar_id
    assert created["principal"] == sidecar.sidecar_id
    assert created["actor"] is None and created["outcome"] == "ok"
    assert created["reason"] == "sidecar first use"

    # a user-scoped key: the event names the pseudonym, never the raw user id
    ctx = RequestContext(user="alice-7", sensitivity="confidential")
    await _put(sidecar, "vllm-demo-0", _key("demo", "c1", "alice-7"), ctx)
    events = await _settled(sidecar)
    alice = sidecar.pipeline.pseudonymizer.user("demo", "alice-7")
    assert [(e["kind"], e["actor"], e["attrs"]) for e in events[1:]] == [
        ("key:created", alice, {"key_id": f"u:demo:{alice}", "version": 1}),
    ]
    # never material: no wrapped key (nor any long slice of one) in any ledger row
    rows = repr(events).encode()
    assert b"alice-7" not in rows
    for wrapped in _wrapped(sidecar):
        assert wrapped.hex() not in rows.decode() and wrapped[:16] not in rows
    assert sidecar.writer is not None
    await sidecar.writer.flush()
    assert verify(sidecar.engine).ok


async def test_an_automatic_rotation_is_recorded_once_and_an_explicit_one_once(
    sidecar: Sidecar,
) -> None:
    for i in range(4):  # rotate_after_chunks = 3: the fourth put seals under v2
        await _put(sidecar, "vllm-acme-0", _key("acme", f"b{i}"))
    events = await _settled(sidecar)
    assert [(e["kind"], e["attrs"]["version"], e["principal"]) for e in events] == [
        ("key:created", 1, sidecar.sidecar_id),
        ("key:rotated", 2, sidecar.sidecar_id),
    ]
    assert events[1]["reason"] == "sidecar automatic"

    # POST /v1/keys/rotate's path on the sidecar's own keyring: recorded by the caller only
    keyring = sidecar.pipeline.keyring
    assert keyring is not None and sidecar.writer is not None
    done = await asyncio.get_running_loop().run_in_executor(
        None,
        lambda: keys_service.rotate_key(keyring, "acme", None, principal="admin-1", reason="api"),
    )
    await keys_service.record(sidecar.writer, done.events)
    events = await _settled(sidecar)
    assert [(e["kind"], e["attrs"]["version"], e["principal"]) for e in events[2:]] == [
        ("key:rotated", 3, "admin-1"),
    ]
    await sidecar.writer.flush()
    assert verify(sidecar.engine).ok

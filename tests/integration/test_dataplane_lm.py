"""kvgov's ``lm://`` listener driven by LMCache 0.5.6's OWN ``lm://`` remote connector
(``LMCServerConnector``, built on LMCache's ``LocalCPUBackend``), and by a real LMCache engine
configured with ``remote_url: lm://host:port``: byte for byte, tenant tags honoured, and a key
LMCache cannot send (over its 150-byte limit) or a key field that is not a key refused without
harming the listener. The sidecar is the real one (Postgres ledger, Rego policy, keyring).
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

pytest.importorskip("lmcache")

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.storage_backend.connector.lm_connector import LMCServerConnector
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
from sqlalchemy import func, select

from kvgov.db.models import LedgerEvent
from kvgov.types import EventKind
from tests import lmcache_harness as h
from tests.integration.live import recv_exact

pytestmark = [pytest.mark.lmcache, pytest.mark.postgres]

T = TypeVar("T")
SHAPE = torch.Size([2, 2, 256, 64])  # [kv, layers, tokens, hidden], bf16: 128 KiB


@pytest.fixture
def sidecar(tmp_path: Path, pg_url: str) -> Iterator[h.SidecarThread]:
    env = h.sidecar_env(tmp_path / "data", tenants=["demo", "globex"], database_url=pg_url)
    env.update(h.lm_env(["demo", "globex"]))
    sc = h.SidecarThread(env).start()
    try:
        yield sc
    finally:
        sc.stop()


class Connector:
    """LMCache's own ``LMCServerConnector`` on its own event loop thread, as LMCache runs it."""

    def __init__(self, port: int) -> None:
        config = h.lm_config(f"lm://127.0.0.1:{port}")
        self.backend = LocalCPUBackend(config, h.metadata(h.Geometry()))
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.conn = LMCServerConnector("127.0.0.1", port, self.loop, self.backend)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def obj(self, seed: int) -> MemoryObj:
        obj = self.backend.allocate(SHAPE, torch.bfloat16, MemoryFormat.KV_2LTD)
        assert obj is not None
        gen = torch.Generator().manual_seed(seed)
        obj.tensor.copy_(torch.randn(SHAPE, generator=gen).to(torch.bfloat16))
        return obj

    def close(self) -> None:
        self.run(self.conn.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()
        self.backend.close()


@pytest.fixture
def connector(sidecar: h.SidecarThread) -> Iterator[Connector]:
    c = Connector(sidecar.sidecar.lm_server.port)
    try:
        yield c
    finally:
        c.close()


def _key(chunk_hash: int, tenant: str | None = "demo", model: str = h.MODEL) -> CacheEngineKey:
    configs = {h.TENANT_TAG: tenant} if tenant is not None else None
    return CacheEngineKey(model, 1, 0, chunk_hash, torch.bfloat16, configs)


def _count(sc: h.SidecarThread, kind: EventKind) -> int:
    with sc.session() as s:
        stmt = select(func.count()).select_from(LedgerEvent).where(LedgerEvent.kind == kind)
        return int(s.scalar(stmt) or 0)


def test_put_get_exists_through_lmcaches_own_connector(
    sidecar: h.SidecarThread, connector: Connector
) -> None:
    key = _key(0x1F2C0F2EB05C3455)
    obj = connector.obj(seed=1)
    sent = bytes(obj.byte_array)
    assert not connector.run(connector.conn.exists(key))
    connector.run(connector.conn.put(key, obj))
    assert connector.run(connector.conn.exists(key))  # the put has no reply: exists orders it
    got = connector.run(connector.conn.get(key))
    assert got is not None
    assert bytes(got.byte_array) == sent
    assert got.get_shape() == SHAPE
    assert got.get_dtype() == torch.bfloat16
    assert got.get_memory_format() == MemoryFormat.KV_2LTD
    assert _count(sidecar, EventKind.KV_PUT) == 1
    assert _count(sidecar, EventKind.KV_GET) == 1
    with sidecar.session() as s:
        puts = s.scalars(select(LedgerEvent).where(LedgerEvent.kind == EventKind.KV_PUT)).all()
        assert [e.request_id for e in puts] == [None]  # lm:// carries no request: unattributed
        assert [e.principal for e in puts] == ["lm:lm-engine"]


def test_tenant_tags_are_honoured(sidecar: h.SidecarThread, connector: Connector) -> None:
    chunk = 0xABCDEF0123456789
    demo, other = connector.obj(seed=2), connector.obj(seed=3)
    demo_bytes = bytes(demo.byte_array)
    connector.run(connector.conn.put(_key(chunk, "demo"), demo))
    assert connector.run(connector.conn.exists(_key(chunk, "demo")))
    # the same chunk under another tenant's tag is another entry: a miss
    assert not connector.run(connector.conn.exists(_key(chunk, "globex")))
    assert connector.run(connector.conn.get(_key(chunk, "globex"))) is None
    # that tenant stores its own bytes; neither sees the other's
    other_bytes = bytes(other.byte_array)
    connector.run(connector.conn.put(_key(chunk, "globex"), other))
    got_demo = connector.run(connector.conn.get(_key(chunk, "demo")))
    got_other = connector.run(connector.conn.get(_key(chunk, "globex")))
    assert got_demo is not None
    assert got_other is not None
    assert bytes(got_demo.byte_array) == demo_bytes
    assert bytes(got_other.byte_array) == other_bytes
    # a tenant the policy does not know, and a key with no tenant tag: nothing is stored
    connector.run(connector.conn.put(_key(chunk, "initech"), connector.obj(seed=4)))
    connector.run(connector.conn.put(_key(chunk, None), connector.obj(seed=5)))
    assert not connector.run(connector.conn.exists(_key(chunk, "initech")))
    assert not connector.run(connector.conn.exists(_key(chunk, None)))
    assert _count(sidecar, EventKind.KV_DENIED) >= 2


def test_overlong_keys_are_refused_and_the_listener_lives_on(
    sidecar: h.SidecarThread, connector: Connector
) -> None:
    long_key = _key(0x77, model="m" * 200)
    assert len(long_key.to_string()) > 150
    # LMCache's own client refuses to send it (its protocol cannot carry it) ...
    with pytest.raises(AssertionError, match="exceeds maximum"):
        connector.run(connector.conn.put(long_key, connector.obj(seed=6)))
    # ... and a 150-byte key field that is the cut-off start of a longer key is not a key:
    # refused (FAIL) on every command, the connection and listener keep working
    port = sidecar.sidecar.lm_server.port
    cut = ("m" * 200 + "@1@0@77@bfloat16@tenant%demo").encode()[:150]
    req = struct.Struct("=iiiiiiiii150s")
    reply = struct.Struct("=iiiiiiiii")
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(req.pack(1, 4, 1, 3, 0, 4, 0, 0, 0, cut) + b"abcd")  # PUT: no reply
        for command in (2, 3):  # GET, EXIST
            s.sendall(req.pack(command, 0, 0, 0, 0, 0, 0, 0, 0, cut))
            assert reply.unpack(recv_exact(s, reply.size))[0] == 400
        s.sendall(req.pack(5, 0, 0, 0, 0, 0, 0, 0, 0, b"".ljust(150)))  # HEALTH
        assert reply.unpack(recv_exact(s, reply.size))[0] == 200
    # LMCache's connector (its own connection) still round-trips
    key = _key(0x78)
    obj = connector.obj(seed=7)
    sent = bytes(obj.byte_array)
    connector.run(connector.conn.put(key, obj))
    got = connector.run(connector.conn.get(key))
    assert got is not None
    assert bytes(got.byte_array) == sent


def test_lmcache_engines_share_kv_through_kvgov(sidecar: h.SidecarThread) -> None:
    """Two real LMCache engines with ``remote_url: lm://`` pointing at kvgov: A stores, B (an
    empty local tier) retrieves the same KV byte for byte; another tenant's request misses."""
    g = h.Geometry()
    url = f"lm://127.0.0.1:{sidecar.sidecar.lm_server.port}"
    toks = h.tokens(3 * g.chunk, seed=11)
    with h.engines(h.lm_config(url), h.lm_config(url)) as (a, b):
        a.fill(len(toks), seed=12)
        a.store(toks, h.identity("demo"))
        a.wait_remote_puts()
        # an lm:// PUT has no reply: the sidecar commits it after A's socket write returned
        deadline = time.monotonic() + 10
        while b.lookup(toks, h.identity("demo")) < 3 * g.chunk:
            assert time.monotonic() < deadline, "the puts never became visible"
            time.sleep(0.02)
        assert b.lookup(toks, h.identity("globex")) == 0
        assert b.retrieve(toks, h.identity("demo")) == 3 * g.chunk
        assert b.kv_bytes(3 * g.chunk) == a.kv_bytes(3 * g.chunk)

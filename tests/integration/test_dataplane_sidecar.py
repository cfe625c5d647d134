"""The sidecar end to end over real sockets: real Postgres ledger, real Rego policy, real
keyring, real memory + filesystem tiers, the kvgov wire client and the ``lm://`` listener."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from kvgov.config import Settings
from kvgov.connectors.tiers.memory import MemoryTier
from kvgov.proxy.app import Sidecar
from kvgov.types import EventKind
from kvgov.wire import ErrorCode, RequestContext, WireClient
from tests.integration.live import loopback_settings, start_sidecar

pytestmark = pytest.mark.postgres

PATTERN = b"KVGOV-PLAINTEXT-MARKER-0123456789" * 64  # recognisable, 2112 bytes


def _key(tenant: str = "demo", user: str | None = "u42", h: str = "1f2c0f2eb05c3455") -> str:
    key = f"meta-llama/Llama-3.1-8B@1@0@{h}@bfloat16@tenant%{tenant}"
    return key + (f"@user%{user}" if user else "")


def _settings(tmp: Path, pg_url: str) -> Settings:
    return loopback_settings(
        tmp / "data",
        pg_url,
        lm=True,
        tiers={"chain": ["memory", "filesystem"], "filesystem_fsync": False},
    )


@pytest.fixture
async def sidecar(tmp_path: Path, pg_url: str) -> AsyncIterator[Sidecar]:
    sc = await start_sidecar(_settings(tmp_path, pg_url))
    try:
        yield sc
    finally:
        await sc.stop()


def _client(sc: Sidecar, engine: str = "vllm-demo-0") -> WireClient:
    return WireClient(f"tcp://127.0.0.1:{sc.server.tcp_port}", engine_id=engine, timeout=10)


async def _run(fn, *args):  # type: ignore[no-untyped-def]
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


def _count(sc: Sidecar, kind: EventKind) -> int:
    from kvgov.db.models import LedgerEvent

    with Session(sc.engine) as s:
        return int(
            s.scalar(select(func.count()).select_from(LedgerEvent).where(LedgerEvent.kind == kind))
            or 0
        )


async def test_round_trip_byte_for_byte(sidecar: Sidecar) -> None:
    client = _client(sidecar)
    ctx = RequestContext(request_id="req-1", user="u42")
    data = os.urandom((3 << 20) + 1)
    small = os.urandom(17)
    try:
        acks = await _run(
            lambda: client.put_many([(_key(), data, {"fmt": 1}), (_key(h="ab"), small)], ctx)
        )
        assert [a.ok for a in acks] == [True, True]
        buf = bytearray(len(data) + 100)
        hit = await _run(client.get_into, _key(), buf, ctx)
        assert hit is not None
        assert hit.length == len(data)
        assert hit.meta == {"fmt": 1}
        assert bytes(buf[: hit.length]) == data
        many = await _run(client.get_many, [_key(h="ab"), _key(h="missing"), _key()], ctx)
        assert bytes(many[0][1]) == small
        assert many[1] == (None, None)
        assert bytes(many[2][1]) == data
        assert await _run(client.exists_many, [_key(), _key(h="missing")], ctx) == [True, False]
        assert await _run(client.remove, _key(h="ab"), ctx) is True
        assert await _run(client.exists, _key(h="ab"), ctx) is False
    finally:
        client.close()
    assert sidecar.writer is not None
    await sidecar.writer.flush()
    assert _count(sidecar, EventKind.KV_PUT) == 2
    assert _count(sidecar, EventKind.KV_GET) == 3
    assert _count(sidecar, EventKind.KV_DELETE) == 1


async def test_denials_cross_tenant_and_expiry(sidecar: Sidecar) -> None:
    client = _client(sidecar)
    try:
        ack = await _run(client.put, _key(), PATTERN, RequestContext(user="u42"))
        assert ack.ok
        # the context's user differs from the key's user tag: denied, nothing stored
        ack = await _run(client.put, _key(h="beef"), PATTERN, RequestContext(user="mallory"))
        assert ack.error is ErrorCode.DENIED
        assert ack.reason == "user_mismatch"
        assert await _run(client.exists, _key(h="beef"), RequestContext(user="u42")) is False
        # the context's tenant differs from the key's tag: a denied get is a miss
        ctx = RequestContext(user="u42", tenant="acme")
        assert await _run(client.get_into, _key(), bytearray(4096), ctx) is None
        # another tenant's key for the same chunk is another entry: a miss
        assert await _run(client.get_into, _key(tenant="acme"), bytearray(4096), None) is None
        # unknown tenant: the policy denies the put
        ack = await _run(client.put, _key(tenant="nobody"), PATTERN, None)
        assert ack.error is ErrorCode.DENIED
        # expired entries miss, and the sweeper deletes them (recorded once)
        sidecar.pipeline.clock = lambda: time.time() + 10**6
        assert (
            await _run(client.get_into, _key(), bytearray(4096), RequestContext(user="u42")) is None
        )
        await sidecar.sweep()
        await sidecar.sweep()
    finally:
        client.close()
    assert sidecar.writer is not None
    await sidecar.writer.flush()
    assert _count(sidecar, EventKind.KV_DENIED) >= 3
    assert _count(sidecar, EventKind.KV_EXPIRED) == 1


async def test_no_plaintext_on_disk_and_restart(tmp_path: Path, pg_url: str) -> None:
    settings = _settings(tmp_path, pg_url)
    sc = await start_sidecar(settings)
    data = PATTERN * 100
    client = _client(sc)
    try:
        assert (await _run(client.put, _key(), data, RequestContext(user="u42"))).ok
    finally:
        client.close()
    await sc.stop()
    files = [p for p in (settings.filesystem_tier_path).rglob("*") if p.is_file()]
    assert files
    for path in files:
        assert PATTERN[:32] not in path.read_bytes()
    sc = await start_sidecar(settings)  # memory tier is gone; the filesystem tier and index survive
    client = _client(sc)
    try:
        buf = bytearray(len(data))
        hit = await _run(client.get_into, _key(), buf, RequestContext(user="u42"))
        assert hit is not None
        assert bytes(buf) == data
    finally:
        client.close()
        await sc.stop()


async def test_disconnect_mid_put_stores_nothing(sidecar: Sidecar) -> None:
    from kvgov.wire.codec import FrameType, encode_frame

    port = sidecar.server.tcp_port
    assert port is not None
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(encode_frame(FrameType.HELLO, 1, {"version": 1, "engine": "e"}))
    meta = {"items": [{"key": _key(h="cut"), "len": 1 << 20}], "ctx": {"user": "u42"}}
    sock.sendall(encode_frame(FrameType.PUT, 2, meta, 1 << 20) + b"x" * 1000)
    await asyncio.sleep(0.2)
    sock.close()
    await asyncio.sleep(0.2)
    client = _client(sidecar)
    try:
        assert await _run(client.exists, _key(h="cut"), RequestContext(user="u42")) is False
    finally:
        client.close()
    assert sidecar.pipeline.pool.in_use_bytes == 0
    memory = sidecar.pipeline.tiers.tier("memory")
    assert isinstance(memory, MemoryTier)
    assert memory.reserved_bytes == 0  # the buffer it was being sealed into went back


async def test_garbage_closes_only_that_connection(sidecar: Sidecar) -> None:
    port = sidecar.server.tcp_port
    assert port is not None
    client = _client(sidecar)
    try:
        assert (await _run(client.put, _key(), b"abc", RequestContext(user="u42"))).ok

        def garbage() -> tuple[bytes, bytes]:
            with socket.create_connection(("127.0.0.1", port)) as bad:
                bad.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + os.urandom(64))
                bad.settimeout(5)
                reply = bad.recv(4096)
                try:
                    after = bad.recv(4096)
                except ConnectionResetError:  # closed with our unread garbage pending
                    after = b""
                return reply, after

        reply, after = await _run(garbage)
        assert reply[:4] == b"KVGV"  # an ERROR frame, then the close
        assert after == b""
        assert await _run(client.exists, _key(), RequestContext(user="u42")) is True
    finally:
        client.close()


async def test_lm_listener_round_trip(sidecar: Sidecar) -> None:
    assert sidecar.lm_server is not None
    port = sidecar.lm_server.port
    data = os.urandom(1 << 20)
    key = _key(user=None).encode().ljust(150)
    req = struct.Struct("=iiiiiiiii150s")

    def talk() -> bytes:
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(req.pack(1, len(data), 1, 3, 0, 2, 4, 256, 128, key) + data)
            s.sendall(req.pack(2, 0, 0, 0, 0, 0, 0, 0, 0, key))
            head = b""
            while len(head) < 36:
                head += s.recv(36 - len(head))
            code, length, fmt, dtype, s0, s1, s2, s3, _ = struct.unpack("=iiiiiiiii", head)
            assert (code, length, fmt, dtype, s0, s1, s2, s3) == (
                200,
                len(data),
                1,
                3,
                2,
                4,
                256,
                128,
            )
            body = bytearray()
            while len(body) < length:
                body += s.recv(length - len(body))
            too_long = b"x" * 150
            s.sendall(req.pack(3, 0, 0, 0, 0, 0, 0, 0, 0, too_long))
            miss = s.recv(36)
            assert struct.unpack("=iiiiiiiii", miss)[0] == 400
            return bytes(body)

    assert await _run(talk) == data

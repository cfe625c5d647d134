"""Graceful shutdown drains in-flight puts, over a real socket against a real sidecar (Postgres
ledger, Rego policy, keyring, memory tier).

A PUT whose payload is half sent when ``Sidecar.stop`` begins is received to the end, stored,
recorded in the ledger and acknowledged; a request that arrives after it on the same connection
is refused with ``busy``; new connections are refused; and the stop then completes, with the
put's ``kv:put`` event committed.
"""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from kvgov.db.engine import make_engine
from kvgov.wire.codec import (
    HEADER_SIZE,
    ErrorCode,
    FrameType,
    decode_header,
    decode_meta,
    encode_frame,
)
from tests.integration.live import loopback_settings, recv_exact, start_sidecar

pytestmark = pytest.mark.postgres

MIB = 1 << 20
KEY = "meta-llama/Llama-3.1-8B@1@0@d1a@bfloat16@tenant%demo@user%u5"


def _reply(sock: socket.socket) -> tuple[FrameType, int, dict[str, Any]]:
    head = decode_header(recv_exact(sock, HEADER_SIZE))
    meta = decode_meta(recv_exact(sock, head.meta_len))
    if head.payload_len:
        recv_exact(sock, head.payload_len)
    return head.type, head.stream_id, meta


async def _run(fn: Any, *args: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


async def test_stop_drains_a_put_in_flight_then_refuses_more(tmp_path: Path, pg_url: str) -> None:
    sc = await start_sidecar(
        loopback_settings(tmp_path / "data", pg_url, tiers={"chain": ["memory"]})
    )
    port = sc.server.tcp_port
    assert port is not None
    value = os.urandom(4 * MIB + 3)
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    stop: asyncio.Task[None] | None = None
    try:
        sock.sendall(encode_frame(FrameType.HELLO, 1, {"version": 1, "engine": "vllm-d"}))
        assert (await _run(_reply, sock))[0] is FrameType.HELLO
        meta = {"items": [{"key": KEY, "len": len(value)}], "ctx": {"request_id": "req-drain"}}
        half = len(value) // 2
        await _run(sock.sendall, encode_frame(FrameType.PUT, 2, meta, len(value)) + value[:half])
        await asyncio.sleep(0.2)  # the sidecar is now mid-payload

        stop = asyncio.ensure_future(sc.stop(grace_s=20.0))
        while not sc.server.draining:  # noqa: ASYNC110 - the server has no event for it
            await asyncio.sleep(0.01)
        # no new connection is accepted any more
        with pytest.raises(OSError):
            await _run(socket.create_connection, ("127.0.0.1", port), 2)

        # the rest of the payload still goes in, and the put is acknowledged
        await _run(sock.sendall, value[half:])
        ftype, sid, reply = await _run(_reply, sock)
        assert (ftype, sid) == (FrameType.PUT, 2)
        assert reply == {"results": [{"code": 0}]}

        # a request after it is refused (busy), or the drained connection is closed
        try:
            await _run(sock.sendall, encode_frame(FrameType.PING, 3, None))
            ftype, sid, reply = await _run(_reply, sock)
            assert ftype is FrameType.ERROR
            assert reply["code"] == int(ErrorCode.BUSY)
        except (ConnectionError, OSError):
            pass
        await asyncio.wait_for(stop, 60)
    finally:
        sock.close()
        if stop is None:
            await sc.stop()

    # the acknowledged put is in the ledger (the stop flushed the writer)
    engine = make_engine(pg_url)
    try:
        with engine.connect() as conn:
            digest = sc.pipeline.pseudonymizer.key_digest(KEY)
            kinds = conn.execute(
                sa.text(
                    "SELECT kind, request_id, nbytes FROM ledger_events"
                    " WHERE key_digest = :d ORDER BY seq"
                ),
                {"d": digest},
            ).all()
    finally:
        engine.dispose()
    assert [tuple(k) for k in kinds] == [("kv:put", "req-drain", len(value))]


async def test_stop_drains_an_lm_put_in_flight(tmp_path: Path, pg_url: str) -> None:
    """``lm://`` PUTs have no reply: one half sent when the stop begins is still received,
    stored and recorded before the stop completes."""
    import struct

    sc = await start_sidecar(
        loopback_settings(tmp_path / "data", pg_url, lm=True, tiers={"chain": ["memory"]})
    )
    assert sc.lm_server is not None and sc.lm_server.port is not None
    key = "bench@1@0@d1b@bfloat16@tenant%demo"
    value = os.urandom(4 * MIB + 5)
    request = struct.Struct("=iiiiiiiii150s").pack(
        1, len(value), 1, 3, 0, 1, 1, 1, len(value), key.encode().ljust(150)
    )
    sock = socket.create_connection(("127.0.0.1", sc.lm_server.port), timeout=30)
    try:
        half = len(value) // 2
        await _run(sock.sendall, request + value[:half])
        await asyncio.sleep(0.2)
        stop = asyncio.ensure_future(sc.stop(grace_s=20.0))
        await asyncio.sleep(0.1)
        await _run(sock.sendall, value[half:])
        await asyncio.wait_for(stop, 60)
    finally:
        sock.close()
    engine = make_engine(pg_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text("SELECT kind, principal, nbytes FROM ledger_events WHERE key_digest = :d"),
                {"d": sc.pipeline.pseudonymizer.key_digest(key)},
            ).all()
    finally:
        engine.dispose()
    assert [tuple(r) for r in rows] == [("kv:put", "lm:lm-demo", len(value))]

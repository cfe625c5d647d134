"""Deadlines: a connection that does not finish its HELLO, or a frame whose bytes stop coming,
is closed, and what it held (pool buffers) goes back.

Attack (issue 14, "what got through" 5): PUT headers declaring 60 MiB with no payload held the
buffer pool for ever (no read deadline): another engine's 100 kB put timed out.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvgov.wire.codec import HEADER_SIZE, FrameType, encode_frame
from tests.security import doors
from tests.security.doors import (
    LmClient,
    WireProbe,
    closed_within,
    engine,
    key,
    known_dataplane,
    run,
)

pytestmark = pytest.mark.postgres

#: short deadlines so the attack tests run in seconds; one engine may take the whole pool, so
#: only the deadline frees it (test_resource_pool_share.py: the share alone)
FAST = known_dataplane(hello_timeout_s=0.5, frame_timeout_s=1.0, buffer_pool_engine_share=1.0)
MIB = 1 << 20


async def test_a_silent_connection_is_closed_after_the_hello_deadline(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    async with doors.sidecar(tmp_path, prod_db, **FAST) as sc:
        port = sc.server.tcp_port
        assert port is not None
        silent, partial = WireProbe(port), WireProbe(port)
        try:
            partial.sock.sendall(encode_frame(FrameType.HELLO, 1, {"engine": "x"})[:10])
            assert await run(silent.closed_within, 5.0)
            assert await run(partial.closed_within, 5.0)
        finally:
            silent.close()
            partial.close()
        metric = sc.metrics.registry.get_sample_value(
            "kvgov_dataplane_timeouts_total", {"listener": "kvgov", "phase": "hello"}
        )
        assert metric == 2


async def test_an_idle_engine_stays_but_a_stalled_frame_is_closed(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    async with doors.sidecar(tmp_path, prod_db, **FAST) as sc:
        port = sc.server.tcp_port
        assert port is not None
        idle, stalled = WireProbe(port), WireProbe(port)
        try:
            await run(idle.hello, "tok-acme")
            await run(stalled.hello, "tok-globex")
            stalled.sock.sendall(encode_frame(FrameType.PING, 2, None)[: HEADER_SIZE - 4])
            assert await run(stalled.closed_within, 5.0)
            # idle between frames is allowed: an engine's pooled connection is not closed
            assert not await run(idle.closed_within, 2.0)
            idle.send(FrameType.PING, None)
            assert (await run(idle.reply))[0] is FrameType.PING
        finally:
            idle.close()
            stalled.close()


async def test_a_stalled_put_gives_its_buffers_back(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    """Two 60 MiB PUT headers, no payload, on a 64 MiB pool: another engine's put goes
    through once the stalled frames' deadline closes them."""
    async with doors.sidecar(tmp_path, prod_db, **FAST) as sc:
        port = sc.server.tcp_port
        assert port is not None
        attackers = [WireProbe(port), WireProbe(port)]
        acme = engine(sc, "tok-acme")
        acme.timeout = 8.0
        try:
            for n, attacker in enumerate(attackers):
                await run(attacker.hello, "tok-globex")
                item = {"key": key(100 + n, "globex"), "len": 60 * MIB}
                attacker.send(FrameType.PUT, {"items": [item]}, 60 * MIB)
            value = os.urandom(100_000)
            ack = await run(acme.put, key(1, "acme"), value)
            assert ack.ok
            got = await run(acme.get, key(1, "acme"))
            assert got is not None and got[0] == value
            for attacker in attackers:
                assert await run(attacker.closed_within, 5.0)
            assert sc.pipeline.pool.in_use_bytes == 0
        finally:
            for attacker in attackers:
                attacker.close()
            acme.close()


async def test_a_stalled_lm_put_gives_its_buffer_back(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    lm = {"lm_port": 0, "lm_engine_id": "lm-acme", "lm_tenants": ["acme"], **FAST}
    async with doors.sidecar(tmp_path, prod_db, **lm) as sc:
        stalled = [LmClient(sc.lm_server.port) for _ in range(2)]
        acme = engine(sc, "tok-acme")
        acme.timeout = 8.0
        try:
            for n, client in enumerate(stalled):
                head = client._head(doors.LM_PUT, key(7 + n, "acme"), 60 * MIB)
                client.sock.sendall(head + b"x" * 1000)  # a value that stops after 1,000 bytes
            value = os.urandom(100_000)
            assert (await run(acme.put, key(9, "acme"), value)).ok
            for n, client in enumerate(stalled):
                assert await run(closed_within, client.sock, 5.0)  # by its deadline
                assert not await run(acme.exists, key(7 + n, "acme"))  # nothing of it stored
            assert sc.pipeline.pool.in_use_bytes == 0
        finally:
            for client in stalled:
                client.close()
            acme.close()

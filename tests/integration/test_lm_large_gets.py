"""Large ``lm://`` hits served side by side: each is written by a sender thread while the crypto
pool opens its segments ahead of it, into two segment buffers taken in turn
(:class:`~kvgov.proxy.dataplane.conn._OpenAhead`). With more connections than crypto threads,
and one reader that takes its bytes slowly, every hit must still arrive whole and byte for byte
(no segment opened into a buffer still being written, no hit's bytes in another's reply) and
no connection may wait for ever on a crypto thread another one holds.
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
import struct
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvgov.proxy.app import Sidecar
from kvgov.proxy.dataplane import lm
from tests.integration.live import loopback_settings, recv_exact, running_sidecar

pytestmark = pytest.mark.postgres

MIB = 1 << 20
LM_REQUEST = struct.Struct("=iiiiiiiii150s")
LM_REPLY = struct.Struct("=iiiiiiiii")
#: larger than lm.STREAM_LOOP_MAX_BYTES (written by a sender thread), not whole segments
SIZE = 9 * MIB + 5
VALUES = 4
READERS = 4
ROUNDS = 3


def _key(i: int) -> bytes:
    return f"bench@1@0@{0x1A46E + i:x}@bfloat16@tenant%demo".encode().ljust(150)


@pytest.fixture
async def sidecar(tmp_path: Path, pg_url: str) -> AsyncIterator[Sidecar]:
    settings = loopback_settings(
        tmp_path / "data",
        pg_url,
        pool_mib=256,
        lm=True,
        # one crypto thread for four readers: a job that waited for its reader would starve
        # the others
        dataplane={"crypto_threads": 1, "send_threads": 4, "buffer_pool_engine_share": 1.0},
        tiers={"chain": ["memory"]},
    )
    async with running_sidecar(settings) as sc:
        yield sc


def _put(port: int, key: bytes, value: bytes) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(LM_REQUEST.pack(1, len(value), 1, 3, 0, 1, 1, 1, len(value), key) + value)
        s.sendall(LM_REQUEST.pack(5, 0, 0, 0, 0, 0, 0, 0, 0, key))  # HEALTH: after the PUT
        assert LM_REPLY.unpack(recv_exact(s, LM_REPLY.size))[0] == 200


def _reader(port: int, values: dict[bytes, bytes], seed: int, slow: bool) -> int:
    """GET every value ``ROUNDS`` times in a shuffled order on one connection; ``slow``:
    take each reply in 256 KiB pieces with pauses (the socket fills, the sender waits)."""
    order = [k for _ in range(ROUNDS) for k in values]
    random.Random(seed).shuffle(order)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        for key in order:
            s.sendall(LM_REQUEST.pack(2, 0, 0, 0, 0, 0, 0, 0, 0, key))
            head = LM_REPLY.unpack(recv_exact(s, LM_REPLY.size))
            assert (head[0], head[1]) == (200, SIZE)
            if slow:
                got = bytearray()
                while len(got) < SIZE:
                    got += recv_exact(s, min(256 * 1024, SIZE - len(got)))
                    time.sleep(0.002)
            else:
                got = bytearray(recv_exact(s, SIZE))
            assert got == values[key], "a hit's bytes differ from what was put"
    return len(order)


async def test_large_lm_hits_side_by_side_arrive_whole(sidecar: Sidecar) -> None:
    assert SIZE > lm.STREAM_LOOP_MAX_BYTES
    assert sidecar.lm_server is not None
    port = sidecar.lm_server.port
    loop = asyncio.get_running_loop()
    values = {_key(i): os.urandom(SIZE) for i in range(VALUES)}
    for key, value in values.items():
        await loop.run_in_executor(None, _put, port, key, value)
    readers = [
        loop.run_in_executor(None, _reader, port, values, seed, seed == 0)
        for seed in range(READERS)
    ]
    done = await asyncio.wait_for(asyncio.gather(*readers), 120)
    assert done == [VALUES * ROUNDS] * READERS

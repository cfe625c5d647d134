"""A ``kv:get`` says bytes were served: it is recorded once the hit's segments were
authenticated and handed to the socket, not when the hit was found.

Attack (issue 16, item 1): the listeners recorded the ``kv:get`` when the value was loaded,
before any of it was sent; a reader that announced a GET and never took the bytes (or a
connection that died mid-send) left a ledger saying the value was served.
"""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import pytest

from kvgov.types import EventKind
from tests.integration.live import recv_exact
from tests.security import doors
from tests.security.doors import LM_GET, LM_REPLY, LmClient, key, run

pytestmark = pytest.mark.postgres

VALUE = 12 << 20  # beyond what the socket buffers hold (4 MiB each way at most)


async def test_a_hit_is_recorded_only_once_its_bytes_left(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    lm_on = {"lm_port": 0, "lm_engine_id": "lm-acme", "lm_tenants": ["acme"]}
    lm_on["buffer_pool_bytes"] = 256 << 20  # a 12 MiB value fits one engine's share
    async with doors.sidecar(tmp_path, prod_db, **lm_on) as sc:
        assert sc.lm_server is not None and sc.lm_server.port is not None
        assert sc.writer is not None
        value = os.urandom(VALUE)
        raw = key(3, "acme")
        lm = LmClient(sc.lm_server.port)
        try:
            await run(lm.put, raw, value)
            assert await run(lm.exists, raw)
        finally:
            lm.close()
        reader = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        reader.settimeout(30)
        try:
            reader.connect(("127.0.0.1", sc.lm_server.port))
            reader.sendall(lm._head(LM_GET, raw))  # a raw request (the helper's framing)
            head = LM_REPLY.unpack(await run(recv_exact, reader, LM_REPLY.size))
            assert head[0] == 200 and head[1] == VALUE  # the hit is announced ...
            await sc.writer.flush()
            # ... but its bytes wait for the reader: nothing says they were served
            assert doors.events(sc, EventKind.KV_GET) == []
            assert await run(recv_exact, reader, VALUE) == value
        finally:
            reader.close()
        for _ in range(200):  # recorded once the last byte was handed to the socket
            await sc.writer.flush()
            got = doors.events(sc, EventKind.KV_GET)
            if got:
                break
            await asyncio.sleep(0.05)
        assert [(e.principal, e.nbytes) for e in got] == [("lm:lm-acme", VALUE)]

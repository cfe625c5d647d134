"""One engine holds at most its share of the buffer pool (``dataplane.buffer_pool_engine_share``):
its stalled or pipelined frames wait for its own buffers, so a stalling engine cannot make
another engine's put wait for its deadline, however long that is.

Attack (issue 14, "what got through" 5): PUT headers declaring 60 MiB with no payload held
the buffer pool; another engine's 100 kB put timed out. A deadline alone frees the pool only
for as long as the attacker does not send the next such header.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvgov.wire.codec import FrameType
from tests.security import doors
from tests.security.doors import LmClient, WireProbe, engine, key, known_dataplane, run

pytestmark = pytest.mark.postgres

MIB = 1 << 20
#: deadlines far beyond the test's patience: only the share can let the honest engine through
SLOW = known_dataplane(frame_timeout_s=600.0, buffer_pool_bytes=128 * MIB)


async def test_a_stalling_engine_waits_for_its_own_buffers(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    lm = {"lm_port": 0, "lm_engine_id": "lm-acme", "lm_tenants": ["initech"], **SLOW}
    async with doors.sidecar(tmp_path, prod_db, **lm) as sc:
        port = sc.server.tcp_port
        assert port is not None
        hogs = [WireProbe(port) for _ in range(4)]
        lm_hogs = [LmClient(sc.lm_server.port) for _ in range(4)]
        acme = engine(sc, "tok-acme")
        acme.timeout = 8.0
        try:
            for n, hog in enumerate(hogs):  # globex: 4 x 30 MiB declared, none sent
                await run(hog.hello, "tok-globex")
                item = {"key": key(100 + n, "globex"), "len": 30 * MIB}
                hog.send(FrameType.PUT, {"items": [item]}, 30 * MIB)
            for n, client in enumerate(lm_hogs):  # the lm:// engine: the same
                head = client._head(doors.LM_PUT, key(200 + n, "initech"), 30 * MIB)
                client.sock.sendall(head)
            value = os.urandom(100_000)
            for i in range(5):
                ack = await run(acme.put, key(i, "acme"), value)
                assert ack.ok
                got = await run(acme.get, key(i, "acme"))
                assert got is not None and got[0] == value
            share = sc.pipeline.pool.owner_max_bytes
            assert sc.pipeline.pool.owned_bytes("vllm-globex") <= share
            assert sc.pipeline.pool.owned_bytes("lm-acme") <= share
        finally:
            for hog in hogs:
                hog.close()
            for client in lm_hogs:
                client.close()
            acme.close()

"""Large GET replies under concurrency, over real sockets against a real sidecar (Postgres
ledger, Rego policy, keyring, memory tier): the sends that write straight from the buffers
(and fall back to the transport when a socket is full) deliver every value byte for byte,
frames never interleave, and puts acked on the same connections meanwhile stay intact."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvgov.proxy.app import Sidecar
from kvgov.wire import RequestContext, WireClient
from tests.integration.live import CRYPTO_PATHS, loopback_settings, running_sidecar

pytestmark = pytest.mark.postgres

MIB = 1 << 20
CTX = RequestContext(request_id="req-sends", user="u7")
SIZES = (9 * MIB + 5, 200_000, MIB - 3, 3 * MIB + 11)


def _key(h: str) -> str:
    return f"meta-llama/Llama-3.1-8B@1@0@{h}@bfloat16@tenant%demo@user%u7"


@pytest.fixture(params=CRYPTO_PATHS)
async def sidecar(
    tmp_path: Path, pg_url: str, request: pytest.FixtureRequest
) -> AsyncIterator[Sidecar]:
    settings = loopback_settings(
        tmp_path / "data",
        pg_url,
        pool_mib=128,
        lm=True,
        dataplane={"inline_crypto_bytes": request.param},
        tiers={"chain": ["memory"], "memory_max_bytes": 256 * MIB},
    )
    async with running_sidecar(settings) as sc:
        yield sc


def _worker(port: int, index: int, values: dict[str, bytes], errors: list[str]) -> None:
    client = WireClient(f"tcp://127.0.0.1:{port}", engine_id=f"vllm-{index}", timeout=30)
    try:
        keys = list(values)
        for round_ in range(3):
            order = keys[round_ % len(keys) :] + keys[: round_ % len(keys)]
            for (result, buf), key in zip(client.get_many(order, CTX), order, strict=True):
                if result is None or bytes(buf) != values[key]:
                    errors.append(f"client {index}: {key} came back wrong")
            own = os.urandom(2 * MIB + index)
            ack = client.put(_key(f"own{index:02x}{round_:02x}"), own, CTX)
            got = client.get(_key(f"own{index:02x}{round_:02x}"), CTX)
            if not ack.ok or got is None or got[0] != own:
                errors.append(f"client {index}: its own put did not round-trip")
    except Exception as exc:  # reported by the test
        errors.append(f"client {index}: {exc!r}")
    finally:
        client.close()


async def test_concurrent_large_gets_round_trip_byte_for_byte(sidecar: Sidecar) -> None:
    values = {_key(f"{i:016x}"): os.urandom(size) for i, size in enumerate(SIZES)}
    client = WireClient(f"tcp://127.0.0.1:{sidecar.server.tcp_port}", engine_id="vllm-w")
    try:
        loop = asyncio.get_running_loop()
        acks = await loop.run_in_executor(None, lambda: client.put_stream(values.items(), CTX))
        assert all(a.ok for a in acks)
    finally:
        client.close()
    errors: list[str] = []
    threads = [
        threading.Thread(target=_worker, args=(sidecar.server.tcp_port, i, values, errors))
        for i in range(6)
    ]

    def run_all() -> None:
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    await asyncio.get_running_loop().run_in_executor(None, run_all)
    assert errors == []

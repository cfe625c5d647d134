"""Data-plane throughput on loopback, side by side in one run (quote the ratios, not absolutes).

1. kvgov wire: governed (Rego policy + AES-GCM sealing + Postgres ledger) vs the same sidecar
   with governance off; same client (``kvgov.wire.WireClient``), same workload: N puts then N
   gets of 1, 4 and 32 MiB chunks.
2. ``lm://``: kvgov's governed ``lm://`` listener vs LMCache's own ``lmcache_server``
   (subprocess), both driven by one blocking client that speaks LMCache's protocol with
   LMCache's own ``ClientMetaMessage``/``ServerMetaMessage`` classes.

Usage: ``python bench/dataplane.py [--rounds N]`` (needs Postgres on 127.0.0.1:5432).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MIB = 1 << 20
SIZES = (1 * MIB, 4 * MIB, 32 * MIB)


class SidecarThread:
    """A sidecar on its own event loop thread."""

    def __init__(self, settings: Any) -> None:
        self.settings = settings
        self.loop = asyncio.new_event_loop()
        self.sidecar: Any = None
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> SidecarThread:
        from kvgov.proxy.app import build_sidecar

        self.thread.start()

        async def up() -> Any:
            sc = await build_sidecar(self.settings)
            await sc.start()
            return sc

        self.sidecar = asyncio.run_coroutine_threadsafe(up(), self.loop).result(120)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.sidecar.stop(), self.loop).result(120)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def settings_for(tmp: Path, db_url: str, *, governance: bool) -> Any:
    from kvgov.config import Settings

    return Settings(
        data_dir=tmp,
        database={"url": db_url},
        ledger={"batch_max_delay_ms": 0.0},
        dataplane={
            "port": 0,
            "lm_port": 0,
            "governance": governance,
            "buffer_pool_bytes": 512 * MIB,
        },
        tiers={"chain": ["memory"], "memory_max_bytes": 1024 * MIB},
    )


def key(i: int, size: int) -> str:
    return f"bench-model@1@0@{i:016x}{size:x}@bfloat16@tenant%demo@user%u1"


def timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_wire(port: int, size: int, n: int) -> tuple[float, float]:
    from kvgov.wire import RequestContext, WireClient

    data = os.urandom(size)
    buf = bytearray(size)
    ctx = RequestContext(request_id="bench", user="u1")
    with WireClient(f"tcp://127.0.0.1:{port}", engine_id="bench", pool_size=1) as client:
        client.put(key(10**6, size), data, ctx)  # warm: keys, buffers, policy cache

        def puts() -> None:
            for i in range(n):
                if not client.put(key(i, size), data, ctx).ok:
                    raise RuntimeError("put refused")

        def gets() -> None:
            for i in range(n):
                if client.get_into(key(i, size), buf, ctx) is None:
                    raise RuntimeError("get missed")

        tput = timed(puts)
        tget = timed(gets)
    if bytes(buf) != data:
        raise RuntimeError("bytes differ")
    return size * n / tput / 1e9, size * n / tget / 1e9


class LmClient:
    """LMCache's ``lm://`` wire exchange, built with LMCache's own message classes."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def put(self, k: Any, data: bytes, shape: Any) -> None:
        import torch
        from lmcache.v1.memory_management import MemoryFormat
        from lmcache.v1.protocol import ClientCommand, ClientMetaMessage

        msg = ClientMetaMessage(
            ClientCommand.PUT, k, len(data), MemoryFormat.KV_2LTD, torch.bfloat16, shape
        )
        self.sock.sendall(msg.serialize())
        self.sock.sendall(data)

    def get_into(self, k: Any, buf: memoryview) -> bool:
        import torch
        from lmcache.v1.memory_management import MemoryFormat
        from lmcache.v1.protocol import ClientCommand, ClientMetaMessage, ServerMetaMessage

        msg = ClientMetaMessage(
            ClientCommand.GET, k, 0, MemoryFormat.KV_2LTD, torch.bfloat16, torch.Size([0])
        )
        self.sock.sendall(msg.serialize())
        head = bytearray(ServerMetaMessage.packlength())
        self._recv_into(memoryview(head))
        meta = ServerMetaMessage.deserialize(bytes(head))
        if meta.code != 200:
            return False
        self._recv_into(buf[: meta.length])
        return True

    def _recv_into(self, view: memoryview) -> None:
        got = 0
        while got < view.nbytes:
            n = self.sock.recv_into(view[got:])
            if n == 0:
                raise ConnectionError("closed")
            got += n

    def close(self) -> None:
        self.sock.close()


def run_lm(port: int, size: int, n: int) -> tuple[float, float]:
    import torch
    from lmcache.utils import CacheEngineKey

    data = os.urandom(size)
    buf = memoryview(bytearray(size))
    shape = torch.Size([2, size // (2 * 256 * 2 * 64), 256, 128])
    keys = [
        CacheEngineKey(
            "bench", 1, 0, i * 7919 + size, torch.bfloat16, {"lmcache.tag.tenant": "demo"}
        )
        for i in range(n)
    ]
    client = LmClient(port)
    try:
        client.put(keys[0], data, shape)
        client.get_into(keys[0], buf)
        tput = timed(lambda: [client.put(k, data, shape) for k in keys] and None)
        # PUT has no reply: a GET of the last key waits until the server processed them all
        tput += timed(lambda: client.get_into(keys[-1], buf) and None)
        tget = timed(lambda: [client.get_into(k, buf) for k in keys] and None)
    finally:
        client.close()
    if bytes(buf) != data:
        raise RuntimeError("lm:// bytes differ")
    return size * n / tput / 1e9, size * n / tget / 1e9


def rounds_for(size: int, budget_mib: int) -> int:
    return max(4, budget_mib * MIB // size)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=256, help="bytes moved per size and side")
    args = parser.parse_args()
    import psycopg
    from tests.lmcache_harness import free_port, lmcache_server

    name = f"kvgov_bench_{uuid.uuid4().hex[:8]}"
    admin = "postgresql://postgres@127.0.0.1:5432/postgres"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    db_url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    try:
        with tempfile.TemporaryDirectory() as tmp:
            gov = SidecarThread(settings_for(Path(tmp) / "g", db_url, governance=True))
            off = SidecarThread(settings_for(Path(tmp) / "o", db_url, governance=False))
            with gov, off, lmcache_server(free_port()) as lm_url:
                lm_port = int(lm_url.rsplit(":", 1)[1])
                print("kvgov wire, same client: governed vs governance off (GB/s)")
                print(
                    f"{'chunk':>7} {'put gov':>8} {'put off':>8} {'ratio':>6}"
                    f" {'get gov':>8} {'get off':>8} {'ratio':>6}"
                )
                for size in SIZES:
                    n = rounds_for(size, args.mib)
                    g = run_wire(gov.sidecar.server.tcp_port, size, n)
                    o = run_wire(off.sidecar.server.tcp_port, size, n)
                    print(
                        f"{size // MIB:>5}MiB {g[0]:8.2f} {o[0]:8.2f} {o[0] / g[0]:5.2f}x"
                        f" {g[1]:8.2f} {o[1]:8.2f} {o[1] / g[1]:5.2f}x"
                    )
                print("\nlm:// protocol: kvgov governed listener vs lmcache_server (GB/s)")
                print(
                    f"{'chunk':>7} {'put kvgov':>9} {'put lmc':>8} {'speedup':>7}"
                    f" {'get kvgov':>9} {'get lmc':>8} {'speedup':>7}"
                )
                for size in SIZES:
                    n = rounds_for(size, args.mib)
                    k = run_lm(gov.sidecar.lm_server.port, size, n)
                    m = run_lm(lm_port, size, n)
                    print(
                        f"{size // MIB:>5}MiB {k[0]:9.2f} {m[0]:8.2f} {k[0] / m[0]:6.2f}x"
                        f" {k[1]:9.2f} {m[1]:8.2f} {k[1] / m[1]:6.2f}x"
                    )
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


if __name__ == "__main__":
    main()

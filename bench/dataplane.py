"""Data-plane throughput on loopback, side by side in one run (quote the ratios, not absolutes).

1. kvgov wire: governed (Rego policy + AES-GCM sealing + Postgres ledger) vs the same sidecar
   with governance off (the named null collaborators: ``unsafe-allow-all`` policy,
   ``unsafe-plaintext`` sealer, ``unsafe-null`` event sink; development only); same client
   (``kvgov.wire.WireClient``), same workload: N puts then N gets of 1, 4 and 32 MiB chunks,
   ``--inflight`` chunks (default 4) and at least ``--inflight-mib`` (default 32) in flight
   on one connection both ways (puts: ``put_stream`` with that many PUT frames outstanding,
   as LMCache's connector keeps several chunks of a batched put in flight; gets: GET frames
   of that many keys, as ``batched_get`` asks), into preallocated client buffers.
2. ``lm://``: kvgov's governed ``lm://`` listener vs LMCache's own ``lmcache_server``, both
   driven by one blocking client that speaks LMCache's protocol with LMCache's own
   ``ClientMetaMessage``/``ServerMetaMessage`` classes (what its ``lm://`` connector sends).

3. The floor (``bench/floor.py``): the same transport with no kvgov code, plain vs with AES-GCM
   beside the copies: the least any governed path can add here, to read the ratios of 1. against.
   Measured first, in the same run, and its sealed put and opened get again beside each repeat
   of 1.: the ``/floor`` column of 1. is the median over the repeats of governed GB/s as a
   fraction of the floor's sealed (put) and opened (get) GB/s measured right beside it (this
   machine's throughput drifts by up to 2x over a run; a ratio of two measurements taken
   seconds apart drifts much less); that of 2. is read against the floor measured first. The
   CPU table sets the governed sidecar's CPU per operation beside the floor server's CPU per
   sealed put and opened get (beside the repeats): what receiving and sealing (sending and
   opening) cost with no kvgov code.

Every server runs in its own process (like ``lmcache_server``), so no side shares the client's
GIL. Tier chain on both kvgov sidecars: ``memory`` only (2 GiB: every size's chunks fit);
``lmcache_server`` keeps chunks in memory too. Each size runs ``--repeat`` times, sides
interleaved; the median is printed.

Usage: ``python bench/dataplane.py [--mib N] [--repeat R] [--inflight K] [--inflight-mib M]``
(needs Postgres on 127.0.0.1:5432).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from floor import chunks_for as floor_chunks  # noqa: E402
from floor import cpu_ticks, machine_busy, print_floor  # noqa: E402
from floor import measure as floor_measure  # noqa: E402

MIB = 1 << 20
SIZES = (1 * MIB, 4 * MIB, 32 * MIB)
#: "governance off": values unsealed, no events (with policy.engine = unsafe-allow-all)
UNSAFE_NULL_COLLABORATORS: dict[str, Any] = {"sealer": "unsafe-plaintext", "events": "unsafe-null"}


def settings_for(tmp: Path, db_url: str, *, governance: bool, tier_mib: int = 2048) -> Any:
    """A development sidecar with a ``tier_mib`` memory tier; ``governance=False``: with the
    named null collaborators."""
    from kvgov.config import Settings

    off: dict[str, Any] = {} if governance else UNSAFE_NULL_COLLABORATORS
    return Settings(
        data_dir=tmp,
        database={"url": db_url},
        policy={"engine": "unsafe-allow-all"} if not governance else {},
        dataplane={
            "port": 0,
            # the shipped example policy names lm-demo for demo ("*" does not admit lm://)
            "lm_port": 0,
            "lm_engine_id": "lm-demo",
            "lm_tenants": ["demo"],
            "buffer_pool_bytes": 512 * MIB,
            # one engine per sidecar, as in a pod: it may use the whole pool (the default
            # share, 0.25, is for sidecars several engines share; 4 x 33 MiB would not fit)
            "buffer_pool_engine_share": 1.0,
            **off,
        },
        tiers={"chain": ["memory"], "memory_max_bytes": tier_mib * MIB},
    )


def serve(data_dir: Path, db_url: str, governance: bool, tier_mib: int) -> None:
    """Child process: run one sidecar, print ``READY <wire port> <lm port>``, stop on SIGTERM."""
    from kvgov.proxy.app import build_sidecar

    async def run() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        sidecar = await build_sidecar(
            settings_for(data_dir, db_url, governance=governance, tier_mib=tier_mib)
        )
        await sidecar.start()
        print(f"READY {sidecar.server.tcp_port} {sidecar.lm_server.port}", flush=True)
        await stop.wait()
        await sidecar.stop()

    asyncio.run(run())


@contextmanager
def sidecar_process(
    data_dir: Path, db_url: str, *, governance: bool, tier_mib: int = 2048
) -> Iterator[tuple[int, int, int]]:
    """A sidecar in its own process; yields its (kvgov wire port, lm:// port, pid)."""
    cmd = [sys.executable, __file__, "--serve", str(data_dir), "--db", db_url]
    cmd += ["--tier-mib", str(tier_mib)]
    if governance:
        cmd.append("--governed")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        line = proc.stdout.readline() if proc.stdout is not None else ""
        if not line.startswith("READY "):
            raise RuntimeError(f"sidecar did not start: {line!r}")
        wire, lm = (int(x) for x in line.split()[1:3])
        yield wire, lm, proc.pid
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


#: each run stores fresh keys: a put of a live key is kept (acknowledged, not rewritten), and
#: timing those would not measure a put
_RUNS = itertools.count(1)


def key(i: int, size: int, run: int = 0) -> str:
    return f"bench-model@1@0@{run:x}{i:016x}{size:x}@bfloat16@tenant%demo@user%u1"


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def depth_for(size: int, args: argparse.Namespace) -> int:
    """Chunks in flight: ``--inflight`` chunks and at least ``--inflight-mib`` of them."""
    return max(args.inflight, args.inflight_mib * MIB // size)


Cpu = tuple[float, float, float]


def cpu_snapshot(pid: int) -> Cpu:
    """CPU seconds used so far by the sidecar process, by every Postgres server process, and
    by the whole machine (:func:`machine_busy`), from /proc (Linux)."""
    hz = os.sysconf("SC_CLK_TCK")
    postgres = 0
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if (proc / "comm").read_text().strip() != "postgres":
                    continue
            except OSError:
                continue
            postgres += cpu_ticks(proc / "stat")
    return cpu_ticks(Path(f"/proc/{pid}/stat")) / hz, postgres / hz, machine_busy()


def per_op(before: Cpu, after: Cpu, n: int) -> Cpu:
    """Milliseconds of CPU per operation: (sidecar, postgres, whole machine)."""
    a, b, c = (1000 * (y - x) / n for x, y in zip(before, after, strict=True))
    return a, b, c


@dataclass(frozen=True, slots=True)
class WireRun:
    put: float  # GB/s
    get: float
    put_cpu: Cpu  # ms per operation: sidecar, postgres, whole machine
    get_cpu: Cpu


def run_wire(port: int, pid: int, size: int, n: int, depth: int) -> WireRun:
    """GB/s and CPU per operation for ``n`` puts then ``n`` gets of ``size`` bytes on the kvgov
    wire, ``depth`` chunks in flight both ways (sidecar process ``pid``)."""
    from kvgov.wire import GetResult, RequestContext, WireClient

    data = os.urandom(size)
    bufs = [memoryview(bytearray(size)) for _ in range(depth)]
    ctx = RequestContext(request_id="bench", user="u1")
    run = next(_RUNS)
    with WireClient(f"tcp://127.0.0.1:{port}", engine_id="bench", pool_size=1) as client:
        client.put(key(10**6, size, run), data, ctx)  # warm: keys, buffers, policy cache
        client.get_into(key(10**6, size, run), bufs[0], ctx)

        def puts() -> None:
            items = ((key(i, size, run), data) for i in range(n))
            acks = client.put_stream(items, ctx, depth=depth)
            if not all(a.ok for a in acks):
                raise RuntimeError("put refused")

        def gets() -> None:
            for start in range(0, n, depth):
                keys = [key(i, size, run) for i in range(start, min(n, start + depth))]
                slots = iter(bufs)

                def alloc(result: GetResult, slots: Iterator[memoryview] = slots) -> memoryview:
                    return next(slots)[: result.length]

                if any(r is None for r, _ in client.get_many(keys, ctx, alloc)):
                    raise RuntimeError("get missed")

        c0 = cpu_snapshot(pid)
        tput = timed(puts)
        c1 = cpu_snapshot(pid)
        tget = timed(gets)
        c2 = cpu_snapshot(pid)
    if bytes(bufs[(n - 1) % depth]) != data:
        raise RuntimeError("bytes differ")
    return WireRun(
        size * n / tput / 1e9, size * n / tget / 1e9, per_op(c0, c1, n), per_op(c1, c2, n)
    )


def fill_wire(port: int, pid: int, size: int, total_mib: int, depth: int) -> float:
    """Put fresh keys of ``size`` bytes until ``total_mib`` are stored (the memory tier is then
    full of buffers of this size, as a sidecar's is after its first minutes); returns the
    sidecar's CPU ms per put meanwhile (fresh buffers: every page faulted in)."""
    from kvgov.wire import RequestContext, WireClient

    data = os.urandom(size)
    ctx = RequestContext(request_id="bench-fill", user="u1")
    run = next(_RUNS)
    n = max(1, total_mib * MIB // size)
    with WireClient(f"tcp://127.0.0.1:{port}", engine_id="bench", pool_size=1) as client:
        c0 = cpu_snapshot(pid)
        acks = client.put_stream(((key(i, size, run), data) for i in range(n)), ctx, depth=depth)
        c1 = cpu_snapshot(pid)
    if not all(a.ok for a in acks):
        raise RuntimeError("fill put refused")
    return per_op(c0, c1, n)[0]


def median_cpu(samples: list[Cpu]) -> Cpu:
    a, b, c = (statistics.median(s[i] for s in samples) for i in range(3))
    return a, b, c


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


def fill_lm(port: int, size: int, total_mib: int) -> None:
    """:func:`fill_wire` over ``lm://`` (kvgov's listener or ``lmcache_server``)."""
    run_lm(port, size, max(1, total_mib * MIB // size), get=False)


@dataclass(frozen=True, slots=True)
class LmRun:
    put: float  # GB/s
    get: float
    #: busy CPU seconds of the whole machine (server and client) per get
    get_machine_cpu: float


def run_lm(port: int, size: int, n: int, *, get: bool = True) -> LmRun:
    import torch
    from lmcache.utils import CacheEngineKey

    data = os.urandom(size)
    buf = memoryview(bytearray(size))
    shape = torch.Size([2, size // (2 * 256 * 2 * 64), 256, 128])
    run = next(_RUNS) << 40
    tags = {"lmcache.tag.tenant": "demo"}
    keys = [
        CacheEngineKey("bench", 1, 0, run + i * 7919 + size, torch.bfloat16, tags) for i in range(n)
    ]
    warm = CacheEngineKey("bench", 1, 0, run + (1 << 39), torch.bfloat16, tags)
    client = LmClient(port)
    try:
        client.put(warm, data, shape)
        client.get_into(warm, buf)
        tput = timed(lambda: [client.put(k, data, shape) for k in keys] and None)
        # PUT has no reply: a GET of the last key waits until the server processed them all
        tput += timed(lambda: client.get_into(keys[-1], buf) and None)
        if not get:
            return LmRun(size * n / tput / 1e9, 0.0, 0.0)
        busy = machine_busy()
        tget = timed(lambda: [client.get_into(k, buf) for k in keys] and None)
        busy = machine_busy() - busy
    finally:
        client.close()
    if bytes(buf) != data:
        raise RuntimeError("lm:// bytes differ")
    return LmRun(size * n / tput / 1e9, size * n / tget / 1e9, busy / n)


def rounds_for(size: int, budget_mib: int) -> int:
    return max(8, budget_mib * MIB // size)


def median_pair(runs: list[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=512, help="bytes moved per size, side, run")
    parser.add_argument("--repeat", type=int, default=3, help="runs per size and side")
    parser.add_argument(
        "--inflight", type=int, default=4, help="chunks in flight on the kvgov wire, both ways"
    )
    parser.add_argument(
        "--inflight-mib", type=int, default=32, help="... and at least this many MiB of them"
    )
    parser.add_argument("--only", choices=("wire", "lm", "floor"), help="run only one part")
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=[s // MIB for s in SIZES], help="chunk MiB"
    )
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--db", help=argparse.SUPPRESS)
    parser.add_argument("--governed", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tier-mib", type=int, default=2048, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        serve(args.serve, args.db, args.governed, args.tier_mib)
        return
    sizes = [m * MIB for m in args.sizes]
    if args.only == "floor":
        print_floor(sizes, args.mib, args.repeat)
        return
    # the floor first, in the same run: the governed columns are read against it
    floors = print_floor(sizes, args.mib, args.repeat) if args.only != "lm" else {}
    import psycopg
    from tests.lmcache_harness import free_port, lmcache_server

    name = f"kvgov_bench_{uuid.uuid4().hex[:8]}"
    admin = "postgresql://postgres@127.0.0.1:5432/postgres"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    db_url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    # the memory tier holds two runs: measured puts find it full (steady state) and each evicts
    # the oldest entry, whose buffer it reuses; every get of a run still hits
    tier_mib = max(256, 2 * args.mib)
    print(
        f"tiers: memory only ({tier_mib} MiB, filled before each size: measured puts run in the"
        " steady state of a sidecar whose tier is full, each evicting the oldest entry and"
        f" reusing its buffer); {args.repeat} runs per size, medians; kvgov wire, both sides:"
        f" max({args.inflight} chunks, {args.inflight_mib} MiB) in flight both ways (put_stream"
        f" depth, keys per GET frame): {', '.join(str(depth_for(s, args)) for s in SIZES)}"
        " for 1/4/32 MiB; lm://: LMCache's protocol, one request at a time"
    )
    try:
        with tempfile.TemporaryDirectory() as tmp:
            gov_dir, off_dir = Path(tmp) / "g", Path(tmp) / "o"
            with (
                sidecar_process(gov_dir, db_url, governance=True, tier_mib=tier_mib) as gov,
                sidecar_process(off_dir, db_url, governance=False, tier_mib=tier_mib) as off,
                lmcache_server(free_port()) as lm_url,
            ):
                lm_port = int(lm_url.rsplit(":", 1)[1])
                if args.only != "lm":
                    print(
                        "\nkvgov wire, same client: governed vs governance off (GB/s); /floor:"
                        " the median, over the repeats, of governed GB/s over the floor's sealed"
                        " put (opened get) measured right beside it"
                    )
                    print(
                        f"{'chunk':>7} {'put gov':>8} {'put off':>8} {'ratio':>6} {'/floor':>6}"
                        f" {'get gov':>8} {'get off':>8} {'ratio':>6} {'/floor':>6}"
                    )
                    cpu_rows = []
                    fills = []
                    floors_beside: dict[int, dict[str, float]] = {}
                    for size in sizes:
                        n = rounds_for(size, args.mib)
                        gs: list[WireRun] = []
                        os_: list[WireRun] = []
                        depth = depth_for(size, args)
                        fills.append(
                            (
                                size,
                                fill_wire(gov[0], gov[2], size, tier_mib, depth),
                                fill_wire(off[0], off[2], size, tier_mib, depth),
                            )
                        )
                        # the floor's sealed put and opened get, measured beside each
                        # repeat: a ratio to it is read against the machine as it was then
                        beside: list[tuple[float, float, float, float]] = []
                        for _ in range(args.repeat):
                            gs.append(run_wire(gov[0], gov[2], size, n, depth))
                            os_.append(run_wire(off[0], off[2], size, n, depth))
                            fp = floor_measure("put-sealed", size, floor_chunks(size, args.mib))
                            fg = floor_measure("get-sealed", size, floor_chunks(size, args.mib))
                            beside.append((fp[0], fp[1], fg[0], fg[1]))
                        g = median_pair([(r.put, r.get) for r in gs])
                        o = median_pair([(r.put, r.get) for r in os_])
                        put_vs = statistics.median(
                            r.put / f[0] for r, f in zip(gs, beside, strict=True)
                        )
                        get_vs = statistics.median(
                            r.get / f[2] for r, f in zip(gs, beside, strict=True)
                        )
                        floors_beside[size] = {
                            "put-sealed cpu": statistics.median(f[1] for f in beside),
                            "get-sealed cpu": statistics.median(f[3] for f in beside),
                        }
                        print(
                            f"{size // MIB:>5}MiB {g[0]:8.2f} {o[0]:8.2f} {o[0] / g[0]:5.2f}x"
                            f" {put_vs:6.2f} {g[1]:8.2f} {o[1]:8.2f} {o[1] / g[1]:5.2f}x"
                            f" {get_vs:6.2f}",
                            flush=True,
                        )
                        cpu_rows.append(
                            (
                                size,
                                median_cpu([r.put_cpu for r in gs]),
                                median_cpu([r.put_cpu for r in os_]),
                                median_cpu([r.get_cpu for r in gs]),
                                median_cpu([r.get_cpu for r in os_]),
                            )
                        )
                    print(
                        "\nCPU per operation, ms: sidecar process / Postgres / whole machine"
                        " (the client included)"
                    )
                    print(
                        f"{'chunk':>7} {'put gov':>17} {'put off':>17}"
                        f" {'get gov':>17} {'get off':>17}"
                        "  sidecar put gov / floor sealed, get gov / floor opened"
                    )
                    for size, *cells in cpu_rows:
                        text = " ".join(f"{c[0]:5.2f}/{c[1]:4.2f}/{c[2]:5.2f}" for c in cells)
                        f = floors_beside.get(size, {})
                        vs = (
                            f"  {cells[0][0]:5.2f}/{f['put-sealed cpu']:5.2f}"
                            f" {cells[2][0]:5.2f}/{f['get-sealed cpu']:5.2f}"
                            if "put-sealed cpu" in f
                            else ""
                        )
                        print(f"{size // MIB:>5}MiB {text}{vs}", flush=True)
                    print(
                        "while the tier fills (fresh buffers, every page faulted in), put CPU"
                        " per operation, ms, sidecar: "
                        + "; ".join(f"{s // MIB} MiB gov {g:.2f} off {o:.2f}" for s, g, o in fills)
                    )
                if args.only != "wire":
                    print(
                        "\nlm:// protocol: kvgov governed listener vs lmcache_server (GB/s);"
                        " CPU/get: the whole machine's busy CPU ms per get (client included),"
                        " kvgov / lmcache_server"
                    )
                    print(
                        f"{'chunk':>7} {'put kvgov':>9} {'put lmc':>8} {'speedup':>7}"
                        f" {'/floor':>6} {'get kvgov':>9} {'get lmc':>8} {'speedup':>7}"
                        f" {'/floor':>6} {'CPU/get kvgov/lmc':>17}"
                    )
                    for size in sizes:
                        n = rounds_for(size, args.mib)
                        fill_lm(gov[1], size, tier_mib)
                        ks, ms = [], []
                        for _ in range(args.repeat):
                            ks.append(run_lm(gov[1], size, n))
                            ms.append(run_lm(lm_port, size, n))
                        k = median_pair([(r.put, r.get) for r in ks])
                        m = median_pair([(r.put, r.get) for r in ms])
                        k_cpu = 1000 * statistics.median(r.get_machine_cpu for r in ks)
                        m_cpu = 1000 * statistics.median(r.get_machine_cpu for r in ms)
                        print(
                            f"{size // MIB:>5}MiB {k[0]:9.2f} {m[0]:8.2f} {k[0] / m[0]:6.2f}x"
                            f" {of_floor(floors, size, 'put-sealed', k[0])}"
                            f" {k[1]:9.2f} {m[1]:8.2f} {k[1] / m[1]:6.2f}x"
                            f" {of_floor(floors, size, 'get-sealed', k[1])}"
                            f" {k_cpu:8.2f} /{m_cpu:7.2f}",
                            flush=True,
                        )
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def of_floor(floors: dict[int, dict[str, float]], size: int, mode: str, gbps: float) -> str:
    """Governed GB/s as a fraction of the floor's ``mode`` GB/s at ``size`` (``-``: none)."""
    f = floors.get(size, {}).get(mode)
    return f"{gbps / f:6.2f}" if f else f"{'-':>6}"


if __name__ == "__main__":
    main()

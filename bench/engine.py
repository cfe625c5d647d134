"""A real LMCache engine's store and retrieve throughput: kvgov (governed) vs LMCache's ``lm://``.

Both sides run in one process tree, their rounds interleaved (the order alternating), with the
same geometry and tokens:

* **ungoverned**: LMCache's built-in ``remote_url: lm://`` connector to LMCache's own
  ``lmcache_server`` (subprocess);
* **governed**: ``KvgovConnector`` (``remote_storage_plugins: ["kvgov"]``) to a ``kvgov serve``
  sidecar (subprocess, embedded defaults in a temp dir: policy, per-tenant encryption, ledger).

Engine A stores (timed until every async remote put is acknowledged); engine B, a fresh engine
with no local hits, retrieves the same tokens (timed) and its KV bytes are compared with A's.
Throughput is the KV bytes moved per second; the ratio governed / ungoverned is printed
(higher is better for kvgov; the target is >= 1.0 for both directions).

    python bench/engine.py                 # 32 MiB chunks (Llama-3.1-8B bf16 geometry)
    python bench/engine.py --chunk-mib 4 --chunks 16 --rounds 3
    python bench/engine.py --connector get_frame_bytes=33554432   # a connector setting, A/B
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import logging

from tests import lmcache_harness as h

from floor import machine_busy


def geometry_for(chunk_mib: float, chunks: int) -> h.Geometry:
    # bf16, 256 tokens, hidden 1024 (8 heads x 128): 1 MiB per layer
    layers = max(2, round(chunk_mib))
    return h.Geometry(layers=layers, heads=8, head_dim=128, slots=chunks * 256)


class Side:
    """One side's two engines (A stores, B retrieves) and its measurements."""

    def __init__(self, name: str, a: h.Engine, b: h.Engine, g: h.Geometry, chunks: int) -> None:
        self.name, self.a, self.b, self.g, self.chunks = name, a, b, g, chunks
        self.stores: list[float] = []
        self.loads: list[float] = []
        #: busy CPU seconds of the whole machine per retrieve (both engines, the server)
        self.load_cpu: list[float] = []

    def round(self, r: int, ids: dict[str, str], *, record: bool) -> None:
        """Store ``chunks`` fresh chunks from A (timed until every async remote put is
        acknowledged), then retrieve them from B (timed) and compare the KV bytes."""
        g, a, b = self.g, self.a, self.b
        nbytes = self.chunks * g.chunk_bytes
        toks = h.tokens(self.chunks * g.chunk, seed=1000 + r)
        a.fill(len(toks), seed=r)
        b.zero()
        t0 = time.perf_counter()
        a.store(toks, ids)
        a.wait_remote_puts(timeout_s=300)
        t1 = time.perf_counter()
        # lm:// PUT has no reply: the server may still be storing the last chunk
        deadline = time.monotonic() + 60
        while b.lookup(toks, ids) < len(toks) and time.monotonic() < deadline:
            time.sleep(0.01)
        t1b = time.perf_counter()
        busy = machine_busy()
        got = b.retrieve(toks, ids)
        t2 = time.perf_counter()
        busy = machine_busy() - busy
        if got != len(toks) or b.kv_bytes(len(toks)) != a.kv_bytes(len(toks)):
            raise SystemExit(f"{self.name}: got {got}/{len(toks)} tokens back, or other bytes")
        if record:
            self.stores.append(nbytes / (t1 - t0) / 1e9)
            self.loads.append(nbytes / (t2 - t1b) / 1e9)
            self.load_cpu.append(busy)

    def medians(self) -> tuple[float, float]:
        return statistics.median(self.stores), statistics.median(self.loads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunk-mib", type=float, default=32.0)
    parser.add_argument("--chunks", type=int, default=8, help="chunks per request")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", choices=["lm", "kvgov"], default=None)
    parser.add_argument("--tiers", default="memory", help="kvgov tier chain, comma separated")
    parser.add_argument(
        "--transport",
        choices=["unix", "tcp"],
        default="unix",
        help="KvgovConnector to sidecar: a Unix socket (a sidecar's normal set-up) or loopback "
        "TCP (the transport lm:// always uses)",
    )
    parser.add_argument(
        "--connector",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a KvgovConnector setting (kvgov.NAME in extra_config), e.g. get_frame_bytes=8388608",
    )
    args = parser.parse_args()
    extra = {"kvgov." + k: v for k, _, v in (s.partition("=") for s in args.connector)}
    logging.disable(logging.WARNING)  # LMCache logs every store/retrieve at INFO/WARNING

    g = geometry_for(args.chunk_mib, args.chunks)
    staging_gb = 3 * args.chunks * g.chunk_bytes / 1e9 + 0.05
    ids = h.identity("bench", request_id="bench-1", user="bench-user", sensitivity="internal")
    print(
        f"geometry: {g.layers} layers x {g.heads} heads x {g.head_dim} dim, bf16, chunk "
        f"{g.chunk} tokens = {g.chunk_bytes / 2**20:.1f} MiB; {args.chunks} chunks/request, "
        f"{args.rounds} rounds (median)"
    )
    sides: list[Side] = []
    with ExitStack() as stack:
        if args.only in (None, "lm"):
            url = stack.enter_context(h.lmcache_server())
            cfg = h.lm_config(url, geometry=g, cpu_staging_gb=staging_gb)
            a, b = stack.enter_context(h.engines(cfg, cfg, geometry=g))
            sides.append(Side("lm:// + lmcache_server (ungoverned)", a, b, g, args.chunks))
        if args.only in (None, "kvgov"):
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvgov-bench-")))
            # memory tier only, like lmcache_server; policy, encryption and the ledger all on
            endpoint = stack.enter_context(
                h.kvgov_sidecar(
                    tmp, tenants=["bench"], tiers=args.tiers.split(","), tcp=args.transport == "tcp"
                )
            )
            cfg = h.kvgov_config(
                endpoint,
                geometry=g,
                cpu_staging_gb=staging_gb,
                engine_id="bench-engine",
                extra=extra,
            )
            a, b = stack.enter_context(h.engines(cfg, cfg, geometry=g))
            sides.append(Side("KvgovConnector + kvgov serve (governed)", a, b, g, args.chunks))
        # round 0 warms connections and allocators; then the sides take turns, the order
        # alternating, so drift on a shared machine hits both alike
        for r in range(args.rounds + 1):
            for side in sides if r % 2 == 0 else sides[::-1]:
                side.round(r, ids, record=r > 0)
    results = {side.name: side.medians() for side in sides}
    width = max(len(k) for k in results)
    print(f"{'':{width}}  {'store GB/s':>10}  {'retrieve GB/s':>13}")
    for label, (st, ld) in results.items():
        print(f"{label:{width}}  {st:10.3f}  {ld:13.3f}")
    if len(results) == 2:
        (lm_st, lm_ld), (kv_st, kv_ld) = results.values()
        print(
            f"ratio governed/ungoverned: store {kv_st / lm_st:.2f}x, retrieve {kv_ld / lm_ld:.2f}x"
        )
        lm_cpu, kv_cpu = (statistics.median(side.load_cpu) for side in sides)
        print(
            "whole-machine busy CPU per retrieve (client included):"
            f" governed {1000 * kv_cpu:.0f} ms, ungoverned {1000 * lm_cpu:.0f} ms"
        )


if __name__ == "__main__":
    main()

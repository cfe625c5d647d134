"""Policy decisions per second for each engine, uncached and cached, with 1000 tenants in data.

Engines, all evaluating the shipped ``authz.rego`` over the shipped data plus 1000 generated
tenants, on the same varied inputs in one run:

- embedded, regorus RVM bytecode (kvgov's default);
- embedded, regorus tree-walking interpreter (the fallback; for comparison);
- real OPA in process (``opa-golib-python-bindings``; the reference engine, if installed);
- OPA over REST through ``opa-python-client`` against a loopback STAND-IN of OPA's REST API
  (aiohttp + the real OPA engine: no OPA server binary can be installed here), so its numbers
  are HTTP + JSON + OPA, a floor for a real OPA sidecar rather than a measurement of one.

"cached" is ``CachingPolicyEngine.decide_cached`` (the data plane's synchronous fast path) on
inputs already decided, plus the awaited ``decide`` on a hit. Targets: cached < 5 us; embedded
uncached < 100 us per decision.

    python bench/policy.py [--decisions 3000] [--rest 300]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvgov.policy.bundle import PolicyBundle, load_bundle
from kvgov.policy.cache import CachingPolicyEngine
from kvgov.policy.embedded import EmbeddedPolicyEngine
from kvgov.policy.interfaces import EntryFacts, PolicyInput, safe_digest, validated_document
from kvgov.policy.opa import OpaRestPolicyEngine

TENANTS = 1000
CACHED_TARGET_US = 5.0
UNCACHED_TARGET_US = 100.0


def bundle_with_tenants(tmp: Path) -> PolicyBundle:
    config = json.loads(json.dumps(load_bundle().config))
    for i in range(TENANTS):
        config["tenants"][f"t{i:04d}"] = {
            "enabled": i % 50 != 0,
            "engines": [f"vllm-{i:04d}-0", f"vllm-{i:04d}-1"],
            "allowed_labels": ["phi"] if i % 3 == 0 else [],
            "tiers": ["memory", "filesystem"] if i % 2 else ["memory", "filesystem", "redis"],
            "max_ttl_s": {"internal": 600 + i},
        }
    data = tmp / "data.json"
    data.write_text(json.dumps(config))
    return load_bundle(None, data)


def inputs(n: int) -> list[PolicyInput]:
    sens = [None, "public", "internal", "confidential", "phi", "restricted"]
    out = []
    for i in range(n):
        t = f"t{(i * 7919) % TENANTS:04d}"
        user = f"user-{i % 97}"
        read = i % 3 == 0
        out.append(
            PolicyInput(
                operation="get" if read else "put",
                tenant=t,
                engine=f"vllm-{t[1:]}-{i % 2}",
                key_tenant=t,
                key_user=user if i % 4 == 0 else None,
                model="meta-llama/Llama-3.1-8B",
                actor_user=user,
                request_id=f"req-{i}",
                sensitivity=sens[i % len(sens)],
                entry=EntryFacts(owner=user, scope_user=None, sensitivity="internal")
                if read
                else None,
            )
        )
    return out


def per_call_us(fn: Callable[[PolicyInput], object], items: list[PolicyInput]) -> list[float]:
    times = []
    clock = time.perf_counter_ns
    for inp in items:
        t0 = clock()
        fn(inp)
        times.append((clock() - t0) / 1000)
    return times


def row(name: str, times: list[float], target: float | None = None) -> dict[str, Any]:
    times = sorted(times)
    p50 = statistics.median(times)
    p99 = times[int(len(times) * 0.99) - 1]
    mean = statistics.fmean(times)
    verdict = "" if target is None else ("PASS" if p50 < target else "MISS")
    print(
        f"{name:<44} {1e6 / mean:>11,.0f} {p50:>9.2f} {p99:>9.2f}"
        f"  {verdict + f' (<{target:g} us p50)' if target else ''}"
    )
    return {"p50": p50, "mean": mean}


class GolibEngine:
    def __init__(self, bundle: PolicyBundle) -> None:
        import opa_bindings

        self.engine = opa_bindings.OpaEngine()
        for m in bundle.modules:
            self.engine.add_policy(m.name, m.source)
        self.engine.add_data(bundle.data_document())

    def decide(self, inp: PolicyInput) -> object:
        doc, _ = validated_document(inp)
        safe_digest(inp)
        return self.engine.eval_document("kvgov.authz.decision", doc)


async def rest_rows(bundle: PolicyBundle, items: list[PolicyInput]) -> None:
    from aiohttp import web

    golib = GolibEngine(bundle)

    async def query(request: web.Request) -> web.Response:
        body = await request.json()
        path = request.match_info["path"].replace("/", ".")
        return web.json_response({"result": golib.engine.eval_document(path, body["input"])})

    app = web.Application()
    app.router.add_post("/v1/data/{path:.*}", query)
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    opa = OpaRestPolicyEngine(bundle, url=f"http://127.0.0.1:{port}", timeout_s=2.0)
    cached = CachingPolicyEngine(opa)
    try:
        await opa.decide(items[0])  # open the client
        times = []
        for inp in items:
            t0 = time.perf_counter_ns()
            await cached.decide(inp)
            times.append((time.perf_counter_ns() - t0) / 1000)
        row("opa REST (stand-in), uncached", times)
        allows = [inp for inp in items if cached.decide_cached(inp) is not None]
        row("opa REST (stand-in), cached decide_cached", per_call_us(cached.decide_cached, allows))
    finally:
        await opa.aclose()
        await runner.cleanup()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--decisions", type=int, default=3000)
    parser.add_argument("--rest", type=int, default=300)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        bundle = bundle_with_tenants(Path(tmp))
    items = inputs(args.decisions)
    rvm = EmbeddedPolicyEngine(bundle)
    interp = EmbeddedPolicyEngine(bundle, rvm=False)
    cached = CachingPolicyEngine(rvm, max_entries=args.decisions * 2)
    allowed = sum(rvm.decide_sync(i).allowed for i in items)
    print(
        f"{len(bundle.config['tenants'])} tenants, {len(items)} distinct inputs "
        f"({allowed} allowed), {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}"
    )
    print(f"{'engine':<44} {'decisions/s':>11} {'p50 us':>9} {'p99 us':>9}")
    warm = items[: min(200, len(items))]
    per_call_us(rvm.decide_sync, warm)
    embedded = row("embedded regorus RVM, uncached", per_call_us(rvm.decide_sync, items), 100.0)
    interp_items = items[: max(len(items) // 5, 1)]
    slow = row(
        "embedded regorus interpreter, uncached", per_call_us(interp.decide_sync, interp_items)
    )
    try:
        golib = GolibEngine(bundle)
    except ImportError:
        print("opa in process (golib): not installed")
    else:
        per_call_us(golib.decide, warm)
        row("opa in process (golib), uncached", per_call_us(golib.decide, items))
    for inp in items:
        await cached.decide(inp)
    # hits are allows: denies are never served by the fast path (each is evaluated-from-cache
    # and recorded through decide())
    allows = [inp for inp in items if cached.decide_cached(inp) is not None]
    hit = row(
        "cached: decide_cached (sync fast path)", per_call_us(cached.decide_cached, allows), 5.0
    )

    def awaited_hit(inp: PolicyInput) -> object:
        coro = cached.decide(inp)
        try:
            coro.send(None)
        except StopIteration as done:  # a hit completes without suspending
            return done.value
        raise RuntimeError("a cache hit suspended")

    row("cached: await decide() on a hit", per_call_us(awaited_hit, allows))
    print(
        f"ratios: interpreter/RVM {slow['p50'] / embedded['p50']:.1f}x, "
        f"RVM/cached {embedded['p50'] / hit['p50']:.0f}x"
    )
    await rest_rows(bundle, items[: args.rest])


if __name__ == "__main__":
    asyncio.run(main())

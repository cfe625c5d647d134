"""Denied vs absent: can a probe for another tenant's key tell, by latency, whether it is cached?

Issue 14's attack measured an EXISTS frame of 512 copies of another tenant's key: median 63 ms
when the key was stored (the policy ran and a denial was recorded) vs 13 ms when it was not
(answered before the policy). Since then the policy decides before anything looks at the
store, so both are the same denial. This prints, side by side in one run, the latency of:

* kvgov wire, an ``acme`` engine probing ``globex`` keys: EXISTS frames of 512 copies and
  single GETs, of a key globex **stored** vs one it **never stored**; beside them, for scale, the
  same engine's own absent key (an allowed miss) and own stored key (a hit);
* ``lm://`` (declared for acme): 512 EXISTs and GETs, one request at a time, of the stored vs
  the never-stored globex key.

A governed production-like sidecar (Postgres ledger, Rego policy, keyring, memory + filesystem
tiers) runs in-process on its own event loop thread; the client is blocking, on the main
thread. Rounds of each condition are interleaved; medians and the present/absent ratio are
printed (1.00 means no signal; the attack's was 4.8).

Usage: ``python bench/oracle.py [--rounds 30]`` (needs Postgres on 127.0.0.1:5432).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

COPIES = 512


class LoopThread:
    """A sidecar on its own event loop thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, coro: Any, timeout: float = 120.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def report(title: str, samples: dict[str, list[float]], present: str, absent: str) -> None:
    print(f"\n{title}")
    print(f"  {'condition':<34} {'median ms':>10} {'p10':>8} {'p90':>8}")
    for name, raw in samples.items():
        xs = sorted(raw)
        p90 = xs[min(len(xs) - 1, (len(xs) * 9) // 10)]
        med, p10, p90 = (1e3 * v for v in (statistics.median(xs), xs[len(xs) // 10], p90))
        print(f"  {name:<34} {med:>10.3f} {p10:>8.3f} {p90:>8.3f}")
    ratio = statistics.median(samples[present]) / statistics.median(samples[absent])
    print(f"  present/absent (denied): {ratio:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()

    from tests.pgroles import role_database
    from tests.security import doors

    from kvgov.db.engine import upgrade
    from kvgov.proxy.app import build_sidecar
    from kvgov.wire import RequestContext

    runner = LoopThread()
    try:
        with tempfile.TemporaryDirectory() as tmp, role_database() as db:
            upgrade(db.owner_url, runtime_role=db.runtime)  # production: a runtime role
            settings = doors.settings(
                Path(tmp),
                doors.ProdDatabase(db.runtime_url, db.runtime),
                lm_port=0,
                lm_engine_id="lm-acme",
                lm_tenants=["acme"],
            )

            async def start() -> Any:
                sc = await build_sidecar(settings)
                await sc.start()
                return sc

            sc = runner.call(start())
            try:
                run_probes(sc, args.rounds, doors, RequestContext)
            finally:
                runner.call(sc.stop())
    finally:
        runner.close()


def run_probes(sc: Any, rounds: int, doors: Any, context: Any) -> None:
    acme, globex = doors.engine(sc, "tok-acme"), doors.engine(sc, "tok-globex")
    probe = context(request_id="probe")  # no tenant: the attack's engine did not say
    own = context(request_id="own", tenant="acme")
    value = os.urandom(64 << 10)
    present, absent = doors.key(1, "globex"), doors.key(2, "globex")
    mine, mine_absent = doors.key(3, "acme"), doors.key(4, "acme")
    try:
        assert globex.put(present, value, context(request_id="g", tenant="globex")).ok
        assert acme.put(mine, value, own).ok
        lm = doors.LmClient(sc.lm_server.port)
        wire: dict[str, list[float]] = {
            "EXISTS x512, globex stored": [],
            "EXISTS x512, globex never stored": [],
            "EXISTS x512, own key absent (miss)": [],
            "EXISTS x512, own key stored (hit)": [],
            "GET, globex stored": [],
            "GET, globex never stored": [],
        }
        lm_samples: dict[str, list[float]] = {
            "EXIST x512, globex stored": [],
            "EXIST x512, globex never stored": [],
            "GET x512, globex stored": [],
            "GET x512, globex never stored": [],
        }
        for i in range(rounds):
            # which goes first alternates: the first probe of a second takes that second's
            # share of recorded denials (the rest are summarised), a cost of order, not presence
            pair = [(present, "stored"), (absent, "never stored")]
            for k, name in pair if i % 2 == 0 else pair[::-1]:
                wire[f"EXISTS x512, globex {name}"].append(
                    timed(lambda k=k: acme.exists_many([k] * COPIES, probe))
                )
                wire[f"GET, globex {name}"].append(timed(lambda k=k: acme.get(k, probe)))
                lm_samples[f"EXIST x512, globex {name}"].append(
                    timed(lambda k=k: [lm.exists(k) for _ in range(COPIES)])
                )
                lm_samples[f"GET x512, globex {name}"].append(
                    timed(lambda k=k: [lm.get(k) for _ in range(COPIES)])
                )
            wire["EXISTS x512, own key absent (miss)"].append(
                timed(lambda: acme.exists_many([mine_absent] * COPIES, own))
            )
            wire["EXISTS x512, own key stored (hit)"].append(
                timed(lambda: acme.exists_many([mine] * COPIES, own))
            )
        lm.close()
    finally:
        acme.close()
        globex.close()
    print(f"{rounds} rounds, conditions interleaved; an acme engine probes globex's keys")
    report(
        "kvgov wire",
        wire,
        "EXISTS x512, globex stored",
        "EXISTS x512, globex never stored",
    )
    get_ratio = statistics.median(wire["GET, globex stored"]) / statistics.median(
        wire["GET, globex never stored"]
    )
    print(f"  GET present/absent (denied): {get_ratio:.2f}x")
    report(
        "lm:// (declared for acme)",
        lm_samples,
        "EXIST x512, globex stored",
        "EXIST x512, globex never stored",
    )


if __name__ == "__main__":
    main()

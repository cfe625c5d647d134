"""Ledger append throughput on Postgres: batched writer vs one commit per event.

Creates its own database, runs both sides in one run (the batched sides ``--runs`` times,
interleaved, median reported), prints events/s and the ratio, checks that every chain verifies,
and drops the database. Run: ``python bench/ledger.py [--events N] [--runs R]``.

The "small batches" scenario is the sidecar's shape: puts (each upserting a cache entry) in
bursts of 16, each burst awaited before the next, so every commit carries a handful of events.
It reports events/s and the process's CPU time per event (``time.process_time()``: all threads,
so the writer's sequencer and committer too), the cost that competes with the data plane for
the GIL. ``--small-only`` runs just that scenario (to compare two trees: run this file with
``PYTHONPATH`` pointing at each ``src``, interleaved).
Needs the local Postgres (``KVGOV_TEST_PG_DSN`` overrides the admin DSN).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
import uuid

import psycopg
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kvgov.db.engine import make_engine, upgrade
from kvgov.ledger.events import EntryChange, Event
from kvgov.ledger.verify import verify
from kvgov.ledger.writer import LedgerWriter
from kvgov.types import EntryState, EventKind, Outcome

ADMIN_DSN = os.environ.get("KVGOV_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")


def access_event(i: int) -> Event:
    """A data-plane hit: the most frequent event."""
    return Event(
        kind=EventKind.KV_GET,
        tenant=f"tenant-{i % 8}",
        actor=f"{i % 1000:032x}",
        request_id=f"req-{i // 16}",
        key_digest=f"{i:064x}",
        tier="memory",
        nbytes=2 << 20,
        outcome=Outcome.HIT,
        decision_id=f"dec-{i % 50}",
        policy_revision="rev-1",
        principal="engine-1",
        attrs={"model": "llama-3-8b", "chunk": i % 256},
    )


def put_event(i: int) -> Event:
    """A put that also creates a cache-entry index row and touches requests/user refs."""
    base = access_event(i)
    entry = EntryChange(
        key_digest=base.key_digest or "",
        state=EntryState.LIVE,
        tenant=base.tenant,
        owner=base.actor,
        tiers=("memory",),
        size=base.nbytes,
    )
    return Event(
        kind=EventKind.KV_PUT,
        tenant=base.tenant,
        actor=base.actor,
        request_id=base.request_id,
        key_digest=base.key_digest,
        tier="memory",
        nbytes=base.nbytes,
        outcome=Outcome.OK,
        attrs=base.attrs,
        entry=entry,
    )


async def run(url: str, chain: str, events: list[Event], *, batch: int) -> float:
    engine = make_engine(url)
    writer = LedgerWriter(
        engine, chain_id=chain, signing_key=Ed25519PrivateKey.generate(), batch_max_events=batch
    )
    await writer.start()
    started = time.perf_counter()
    if batch == 1:
        for event in events:  # the baseline: each event committed before the next
            await writer.append(event)
    else:
        futures = [writer.submit(e) for e in events]
        # batches commit in order, so the last future resolving means all have; gather()
        # would add its own per-future bookkeeping to the measurement
        await futures[-1]
        await writer.flush()
        assert all(f.done() and f.exception() is None for f in futures)
    elapsed = time.perf_counter() - started
    await writer.write_checkpoint()
    await writer.close()
    engine.dispose()
    return len(events) / elapsed


async def run_bursts(
    url: str, chain: str, events: list[Event], *, burst: int
) -> tuple[float, float]:
    """Submit ``events`` in bursts of ``burst``, awaiting each burst before the next (the
    sidecar acknowledges a put once its event is committed). Returns (events/s, CPU us/event)."""
    engine = make_engine(url)
    writer = LedgerWriter(engine, chain_id=chain, signing_key=Ed25519PrivateKey.generate())
    await writer.start()
    # warm up: the connection, prepared statements and caches (not measured)
    for event in events[:burst]:
        await writer.append(event)
    events = events[burst:]
    started, cpu = time.perf_counter(), time.process_time()
    for start in range(0, len(events), burst):
        futures = [writer.submit(e) for e in events[start : start + burst]]
        for fut in futures:
            await fut
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    await writer.close()
    engine.dispose()
    return len(events) / elapsed, cpu / len(events) * 1e6


def small_batches(url: str, n: int, runs: int, offset: int) -> None:
    rates, cpus = [], []
    for r in range(runs):
        puts = [put_event(offset + r * n + i) for i in range(n)]
        rate, cpu = asyncio.run(run_bursts(url, f"small-{offset}-{r}", puts, burst=16))
        rates.append(rate)
        cpus.append(cpu)
    runs_s = ", ".join(f"{x:,.0f}/{c:.0f}" for x, c in zip(rates, cpus, strict=True))
    print(
        f"  small batches (16)   : {statistics.median(rates):10,.0f} events/s, "
        f"{statistics.median(cpus):6.0f} CPU us/event  ({n:,} puts with entries)"
    )
    print(f"    median of {runs} runs (events/s / CPU us): {runs_s}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--events", type=int, default=60_000)
    parser.add_argument("--baseline-events", type=int, default=3_000)
    parser.add_argument("--runs", type=int, default=3, help="batched runs (median reported)")
    parser.add_argument("--small-events", type=int, default=4_000)
    parser.add_argument("--small-only", action="store_true", help="only the small-batch scenario")
    args = parser.parse_args()
    name = f"kvgov_bench_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(ADMIN_DSN, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    url = ADMIN_DSN.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://") + "/" + name
    try:
        upgrade(url)
        if args.small_only:
            print(f"postgres ledger append ({os.cpu_count()} cpus)")
            small_batches(url, args.small_events, args.runs, 0)
            _verify_or_exit(url)
            return
        n, b = args.events, args.baseline_events
        baseline = asyncio.run(run(url, "baseline", [access_event(i) for i in range(b)], batch=1))
        # interleaved: each round one access run and one put run, each on a chain of its own
        access_runs, put_runs = [], []
        for r in range(args.runs):
            events = [access_event(i) for i in range(n)]
            access_runs.append(asyncio.run(run(url, f"batched-{r}", events, batch=2000)))
            puts = [put_event(i + r * n) for i in range(n // 2)]
            put_runs.append(asyncio.run(run(url, f"mixed-{r}", puts, batch=2000)))
        batched, mixed = statistics.median(access_runs), statistics.median(put_runs)
        t = time.perf_counter()
        engine = make_engine(url)
        report = verify(engine)
        engine.dispose()
        verify_s = time.perf_counter() - t
        total = sum(c.events for c in report.chains)
        print(f"postgres ledger append ({os.cpu_count()} cpus)")
        print(f"  one commit per event : {baseline:10,.0f} events/s  ({b:,} events)")
        runs = ", ".join(f"{x:,.0f}" for x in access_runs)
        print(f"  batched writer (COPY): {batched:10,.0f} events/s  ({n:,} access events)")
        print(f"    median of {args.runs} runs: {runs}")
        runs = ", ".join(f"{x:,.0f}" for x in put_runs)
        print(f"  batched, puts+index  : {mixed:10,.0f} events/s  ({n // 2:,} puts with entries)")
        print(f"    median of {args.runs} runs: {runs}")
        print(f"  ratio batched/baseline: {batched / baseline:.1f}x")
        small_batches(url, args.small_events, args.runs, args.runs * n)
        print(
            f"  verify: {'intact' if report.ok else 'BROKEN'}, {total:,} events in {verify_s:.2f}s"
        )
        target = 20_000
        print(
            f"  target batched >= {target:,} events/s: {'met' if batched >= target else 'MISSED'}"
        )
        if not report.ok:
            raise SystemExit(1)
    finally:
        with psycopg.connect(ADMIN_DSN, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _verify_or_exit(url: str) -> None:
    engine = make_engine(url)
    report = verify(engine)
    engine.dispose()
    print(f"  verify: {'intact' if report.ok else 'BROKEN'}")
    if not report.ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()

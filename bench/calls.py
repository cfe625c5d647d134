"""Python function calls per governed operation in the sidecar: a deterministic measure of the
put and get paths' interpreter work (``bench/dataplane.py`` measures time, which this machine's
noise moves by 2x; a call count does not move with it).

A governed sidecar is started the way ``bench/dataplane.py`` starts one (its
:func:`~dataplane.settings_for`: Rego policy, AES-GCM sealing, the Postgres ledger, a memory
tier), in its own process, with a ``cProfile`` profiler in every thread (the event loop's, the
crypto and sender pools', the ledger writer's). The client (``kvgov.wire.WireClient``, as in
``bench/dataplane.py``: ``put_stream`` with ``max(4 chunks, 32 MiB)`` in flight, GET frames of
as many keys) first puts until the tier is full and every cache is warm, then the sidecar's
counts are snapshotted before and after ``--puts`` puts (and as many gets) of each size. It
prints calls per operation, the event loop's thread alone and every thread together (``py``:
Python functions only, ``all``: builtins and C methods too), and the top functions by calls.

Usage: ``python bench/calls.py [--sizes 1 4] [--puts 64] [--top 30] [--threads]``
(needs Postgres on 127.0.0.1:5432). Counts vary by a few percent between runs where the work
depends on timing (how many ``recv_into`` a segment takes, how many events share a ledger
batch); compare medians of a few runs when a change is that small.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import signal
import subprocess
import sys
import tempfile
import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from dataplane import MIB, key, settings_for  # noqa: E402

#: a function: (file, line, name); "~" files are builtins
Func = tuple[str, int, str]
Counts = dict[tuple[str, Func], int]  # (thread name, function) -> calls


class Profilers:
    """One ``cProfile.Profile`` per thread of the sidecar, each started by the thread itself
    (a profiler hooks only the thread that enables it): threads started later enable theirs
    on their first event (``threading.setprofile``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.by_thread: list[tuple[threading.Thread, cProfile.Profile]] = []
        #: also count caller -> callee edges (for ``--dump``)
        self.edges = os.environ.get("KVGOV_CALLS_EDGES") == "1"

    def start_here(self) -> None:
        prof = cProfile.Profile()
        with self._lock:
            self.by_thread.append((threading.current_thread(), prof))
        prof.enable()

    def _first_event(self, frame: Any, event: str, arg: Any) -> None:
        sys.setprofile(None)
        self.start_here()

    def install(self) -> None:
        threading.setprofile(self._first_event)
        self.start_here()

    def snapshot(self) -> Counts:
        """Calls so far by thread kind and function (read from another thread: the GIL keeps
        each profiler's table still while it is read)."""
        out: Counts = {}
        with self._lock:
            profs = list(self.by_thread)
        for thread, prof in profs:
            kind = _thread_kind(thread.name)
            for entry in prof.getstats():
                func = _func(entry.code)
                k = (kind, func)
                out[k] = out.get(k, 0) + entry.callcount
                if self.edges:  # who calls whom: "<caller> -> <callee>" pseudo-functions
                    for sub in entry.calls or ():
                        callee = _func(sub.code)
                        e = (kind, ("->", 0, f"{_short(func)} -> {_short(callee)}"))
                        out[e] = out.get(e, 0) + sub.callcount
        return out


def _func(code: Any) -> Func:
    if isinstance(code, str):
        return ("~", 0, code)
    return (code.co_filename, code.co_firstlineno, code.co_name)


def _thread_kind(name: str) -> str:
    if name == "MainThread":
        return "loop"
    return name.rstrip("0123456789_").rstrip("-_") or name


def serve(data_dir: Path, db_url: str, tier_mib: int) -> None:
    """Child process: a governed sidecar with every thread profiled; prints ``READY <port>``,
    then answers each ``SNAP`` line on stdin with a pickled snapshot file's path."""
    import pickle

    from kvgov.proxy.app import build_sidecar

    profilers = Profilers()

    def control() -> None:  # started before the profilers: its own work is not counted
        n = 0
        for line in sys.stdin:
            if line.strip() == "SNAP":
                n += 1
                path = data_dir / f"snap{n}.pickle"
                with path.open("wb") as fh:
                    pickle.dump(profilers.snapshot(), fh)
                print(f"SNAP {path}", flush=True)

    async def run() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        sidecar = await build_sidecar(
            settings_for(data_dir, db_url, governance=True, tier_mib=tier_mib)
        )
        await sidecar.start()
        print(f"READY {sidecar.server.tcp_port}", flush=True)
        await stop.wait()
        await sidecar.stop()

    threading.Thread(target=control, name="control", daemon=True).start()
    profilers.install()
    asyncio.run(run())


class Sidecar:
    """The profiled sidecar process, from the client's side."""

    def __init__(self, data_dir: Path, db_url: str, tier_mib: int) -> None:
        cmd = [sys.executable, __file__, "--serve", str(data_dir), "--db", db_url]
        cmd += ["--tier-mib", str(tier_mib)]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT
        )
        line = self._line()
        if not line.startswith("READY "):
            raise RuntimeError(f"sidecar did not start: {line!r}")
        self.port = int(line.split()[1])

    def _line(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline()

    def snapshot(self) -> Counts:
        import pickle

        assert self.proc.stdin is not None
        self.proc.stdin.write("SNAP\n")
        self.proc.stdin.flush()
        line = self._line()
        if not line.startswith("SNAP "):
            raise RuntimeError(f"no snapshot: {line!r}")
        with Path(line.split(" ", 1)[1].strip()).open("rb") as fh:
            counts: Counts = pickle.load(fh)
        return counts

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def depth_for(size: int) -> int:
    """bench/dataplane.py's default: 4 chunks and at least 32 MiB in flight."""
    return max(4, 32 * MIB // size)


def puts(client: Any, size: int, run: int, n: int) -> None:
    from kvgov.wire import RequestContext

    data = os.urandom(size)
    ctx = RequestContext(request_id="bench-calls", user="u1")
    items = ((key(i, size, run), data) for i in range(n))
    acks = client.put_stream(items, ctx, depth=depth_for(size))
    if not all(a.ok for a in acks):
        raise RuntimeError("put refused")


def gets(client: Any, size: int, run: int, n: int, first: int = 0) -> None:
    from kvgov.wire import GetResult, RequestContext

    depth = depth_for(size)
    bufs = [memoryview(bytearray(size)) for _ in range(depth)]
    ctx = RequestContext(request_id="bench-calls", user="u1")
    for start in range(first, first + n, depth):
        keys = [key(i, size, run) for i in range(start, min(first + n, start + depth))]
        slots = iter(bufs)

        def alloc(result: GetResult, slots: Iterator[memoryview] = slots) -> memoryview:
            return next(slots)[: result.length]

        if any(r is None for r, _ in client.get_many(keys, ctx, alloc)):
            raise RuntimeError("get missed")


def diff(before: Counts, after: Counts) -> Counter[tuple[str, Func]]:
    out: Counter[tuple[str, Func]] = Counter()
    for k, v in after.items():
        d = v - before.get(k, 0)
        if d:
            out[k] = d
    return out


def _short(func: Func) -> str:
    file, line, name = func
    if file in ("~", "->"):
        return name
    path = Path(file)
    for base in (ROOT / "src", Path(sys.prefix)):
        try:
            path = path.relative_to(base)
            break
        except ValueError:
            continue
    else:
        path = Path(*path.parts[-2:])
    return f"{path}:{line}({name})"


def report(
    label: str,
    counts: Counter[tuple[str, Func]],
    n: int,
    top: int,
    threads: bool,
    dump: Path | None = None,
) -> None:
    edges = Counter({k: v for k, v in counts.items() if k[1][0] == "->"})
    counts = Counter({k: v for k, v in counts.items() if k[1][0] != "->"})
    loop_all = sum(v for (t, _), v in counts.items() if t == "loop")
    loop_py = sum(v for (t, f), v in counts.items() if t == "loop" and f[0] != "~")
    every = sum(counts.values())
    every_py = sum(v for (_, f), v in counts.items() if f[0] != "~")
    print(
        f"\n{label}: calls per operation: event loop thread {loop_py / n:.0f} py /"
        f" {loop_all / n:.0f} all; every thread {every_py / n:.0f} py / {every / n:.0f} all"
    )
    if threads:
        kinds: Counter[str] = Counter()
        for (t, _), v in counts.items():
            kinds[t] += v
        print("  by thread: " + ", ".join(f"{t} {v / n:.0f}" for t, v in kinds.most_common()))
    merged: Counter[Func] = Counter()
    for (_, f), v in counts.items():
        merged[f] += v
    print(f"  top {top} functions (every thread), calls per operation:")
    for func, v in merged.most_common(top):
        print(f"  {v / n:8.2f}  {_short(func)}")
    if dump is not None:
        with dump.open("a") as fh:
            fh.write(f"# {label}\n")
            for (t, func), v in (counts + edges).most_common():
                fh.write(f"{v / n:8.2f} {t:14} {_short(func)}\n")
    python = Counter({f: v for f, v in merged.items() if f[0] != "~"})
    print(f"  top {top} Python functions (every thread), calls per operation:")
    for func, v in python.most_common(top):
        print(f"  {v / n:8.2f}  {_short(func)}")


def measure(client: Any, sidecar: Sidecar, args: argparse.Namespace) -> None:
    """Per size: warm up (fill the tier, so each measured put evicts the oldest entry as in a
    sidecar's steady state; every cache hot), then count ``args.puts`` puts and gets."""
    run = 1
    for mib in args.sizes:
        size = mib * MIB
        fill = args.tier_mib // mib + 2 * depth_for(size)
        puts(client, size, run, fill)
        gets(client, size, run, 2 * depth_for(size), fill - 2 * depth_for(size))  # still held
        run += 1
        s0 = sidecar.snapshot()
        puts(client, size, run, args.puts)
        s1 = sidecar.snapshot()
        report(f"put {mib} MiB", diff(s0, s1), args.puts, args.top, args.threads, args.dump)
        if not args.no_get:
            gets(client, size, run, args.puts)
            s2 = sidecar.snapshot()
            report(f"get {mib} MiB", diff(s1, s2), args.puts, args.top, args.threads, args.dump)
        run += 1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 4], help="chunk MiB")
    parser.add_argument("--puts", type=int, default=64, help="measured puts (and gets) per size")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--threads", action="store_true", help="calls by thread too")
    parser.add_argument("--dump", type=Path, help="append every function's calls/op here")
    parser.add_argument("--no-get", action="store_true", help="puts only")
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--db", help=argparse.SUPPRESS)
    parser.add_argument("--tier-mib", type=int, default=384, help="memory tier (filled first)")
    args = parser.parse_args()
    if args.serve is not None:
        serve(args.serve, args.db, args.tier_mib)
        return
    import psycopg

    if args.dump is not None:
        os.environ["KVGOV_CALLS_EDGES"] = "1"  # the sidecar counts who calls whom too
    name = f"kvgov_calls_{uuid.uuid4().hex[:8]}"
    admin = "postgresql://postgres@127.0.0.1:5432/postgres"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    db_url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    print(
        f"governed sidecar, memory tier {args.tier_mib} MiB, filled first (measured puts each"
        f" evict the oldest entry); {args.puts} puts then {args.puts} gets per size, depth"
        " max(4, 32 MiB) both ways; cProfile in every sidecar thread"
    )
    try:
        with tempfile.TemporaryDirectory() as tmp:
            from kvgov.wire import WireClient

            sidecar = Sidecar(Path(tmp), db_url, args.tier_mib)
            url = f"tcp://127.0.0.1:{sidecar.port}"
            try:
                # one connection throughout: its HELLO is not counted against the puts
                with WireClient(url, engine_id="bench", pool_size=1) as client:
                    measure(client, sidecar, args)
            finally:
                sidecar.stop()
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


if __name__ == "__main__":
    main()

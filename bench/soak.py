"""Soak: a production-like sidecar under a long hostile load, while an honest engine works.

The sidecar (Postgres ledger with a runtime role, Rego policy, keyring, memory + filesystem
tiers, kvgov wire on TCP and ``lm://`` declared as ``lm-acme`` for ``initech``; the attack
suite's settings, ``tests/security/doors.py``) runs in a child process, so its RSS and open
descriptors are its own and a crash is visible. On loopback only, the attacker sends:

* random and mutated frames over both listeners (``--frames``, default 1,000,000): pipelined
  batches of valid and semi-valid frames (PING, EXISTS/GET/REMOVE of random keys of every
  tenant, denied and allowed PUTs, wrong-typed metadata, odd request contexts; ``lm://``
  PUT/GET/EXIST/HEALTH/LIST with random keys and shapes), each batch ending with a mutated one
  (flipped bytes, truncation, bad magic, oversize lengths, unknown commands) that usually
  closes the connection, then a new connection (a HELLO with a good, bad or missing token);
* slowloris: connections that trickle a HELLO or a frame one byte at a time (``--slow``);
* pool exhaustion: PUT headers declaring 60 MiB that never send the payload, on both
  listeners, and GETs whose replies are never read (``--hogs``);
* a connection flood beyond the connection caps, every few seconds.

An honest engine (``vllm-acme``, its own process) puts and reads back 100 kB values before,
during and after the attack; every value read must equal what it stored.

Printed: frames sent (by listener and kind), connections (opened, closed by the sidecar),
crashes (sidecar exits plus connection handlers that died with a traceback: must be 0), the
sidecar's RSS and descriptors before and after, and the honest engine's throughput and
latency before, during and after.

Usage: ``python bench/soak.py`` (needs Postgres on 127.0.0.1:5432): attacks until
``--frames`` (1,000,000) were sent and at least ``--min-seconds`` (300) passed, at most
``--max-seconds`` (840); ``--frames 100000 --min-seconds 30 --max-seconds 120`` for a short
run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MIB = 1 << 20
LM_REQUEST = struct.Struct("=iiiiiiiii150s")
LM_REPLY_SIZE = 36
MODEL = "meta-llama/Llama-3.1-8B"
TENANTS = ("acme", "globex", "demo", "initech", "nobody", "")
TOKENS = ("tok-globex", "tok-demo", "tok-acme-wrong", "")


# -- the sidecar (child process) ------------------------------------------------------------


def serve(args: argparse.Namespace) -> None:
    """``--serve``: run the sidecar until SIGTERM; print its ports once it is up."""
    import logging

    from tests.security import doors

    from kvgov.proxy.app import build_sidecar

    logging.basicConfig(
        filename=args.log, level=logging.WARNING, format="%(levelname)s %(name)s %(message)s"
    )
    settings = doors.settings(
        Path(args.tmp),
        doors.ProdDatabase(args.db_url, args.db_role),
        lm_port=0,
        lm_engine_id="lm-acme",
        lm_tenants=["initech"],
        buffer_pool_bytes=args.pool_mib * MIB,
        max_frame_bytes=64 * MIB,
    )
    # a bounded memory tier: RSS before/after then says whether anything else grows
    tiers = settings.tiers.model_copy(update={"memory_max_bytes": args.memory_mib * MIB})
    settings = settings.model_copy(update={"tiers": tiers})

    async def main() -> None:
        sc = await build_sidecar(settings)
        await sc.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        print(json.dumps({"tcp": sc.server.tcp_port, "lm": sc.lm_server.port}), flush=True)
        await stop.wait()
        await sc.stop()

    asyncio.run(main())


def fd_kinds(pid: int) -> dict[str, int]:
    """Open descriptors of a process by kind (socket, pipe, file, ...)."""
    kinds: dict[str, int] = {}
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = str(fd.readlink())
            kind = target.split(":", 1)[0] if ":" in target else "file"
            kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def proc_stats(pid: int) -> tuple[float, int]:
    """(RSS in MiB, open descriptors) of a process."""
    rss = 0.0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) / 1024
    return rss, sum(1 for _ in Path(f"/proc/{pid}/fd").iterdir())


# -- the honest engine (child process) ------------------------------------------------------


def honest(args: argparse.Namespace) -> None:
    """``--honest``: put and read back 100 kB acme values until stdin closes; print one JSON
    line per second: ops done, failures (an error, a timeout or a wrong value), latencies."""
    import threading

    from tests.security.doors import key

    from kvgov.wire import RequestContext, WireClient

    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    ctx = RequestContext(request_id="honest", tenant="acme")
    client = WireClient(f"tcp://127.0.0.1:{args.port}", engine_id="x", token="tok-acme", timeout=30)
    rng = random.Random(7)
    n = 0
    tick = time.monotonic() + 1
    ops = fails = 0
    lat: list[float] = []
    while not done.is_set():
        value = rng.randbytes(100_000)
        k = key(1_000_000 + n, "acme")
        n += 1
        t0 = time.perf_counter()
        try:
            ok = client.put(k, value, ctx).ok
            got = client.get(k, ctx)
            ok = ok and got is not None and got[0] == value
        except Exception:  # counted: the point is whether it keeps working
            ok = False
            client.close()
            client = WireClient(
                f"tcp://127.0.0.1:{args.port}", engine_id="x", token="tok-acme", timeout=30
            )
        lat.append(time.perf_counter() - t0)
        ops += ok
        fails += not ok
        if time.monotonic() >= tick:
            print(
                json.dumps({"t": time.time(), "ops": ops, "fails": fails, "lat": lat}), flush=True
            )
            ops = fails = 0
            lat = []
            tick += 1
    client.close()


# -- frames ---------------------------------------------------------------------------------


def rand_key(rng: random.Random) -> str:
    tenant = rng.choice(TENANTS)
    r = rng.random()
    if r < 0.05:
        return rng.choice(["", "@", "x" * 300, "\x00", "../../etc/passwd", "a@b@c"])
    tags = f"@tenant%{tenant}" if tenant else ""
    if rng.random() < 0.2:
        tags += f"@user%u{rng.randrange(10)}"
    return f"{MODEL}@1@0@{rng.getrandbits(40):x}@bfloat16{tags}"


def rand_ctx(rng: random.Random) -> Any:
    r = rng.random()
    if r < 0.5:
        return {"request_id": f"r{rng.randrange(1000)}", "tenant": rng.choice(TENANTS)}
    if r < 0.7:
        return {"user": "alice", "sensitivity": rng.choice(["confidential", "public", "x"])}
    return rng.choice([None, 1, "x", [], {"tenant": 5}, {"request_id": "x" * 500}])


def wire_frame(rng: random.Random) -> bytes:
    """One valid or semi-valid (non-fatal) kvgov wire frame."""
    from kvgov.wire.codec import FrameType, encode_frame

    r = rng.random()
    if r < 0.15:
        return encode_frame(FrameType.PING, rng.randrange(1 << 20), None)
    if r < 0.45:
        ftype = rng.choice([FrameType.EXISTS, FrameType.GET, FrameType.REMOVE])
        keys: Any = [rand_key(rng) for _ in range(rng.choice([1, 1, 2, 8, 64]))]
        if rng.random() < 0.1:
            keys = rng.choice([[], "k", [1, 2], None, [rand_key(rng)] * 5000])
        return encode_frame(ftype, rng.randrange(1 << 20), {"keys": keys, "ctx": rand_ctx(rng)})
    if r < 0.75:
        n = rng.choice([1, 1, 2, 4])
        lens = [rng.choice([0, 1, 100, 4096, 70_000]) for _ in range(n)]
        items: Any = [{"key": rand_key(rng), "len": ln} for ln in lens]
        total = sum(lens)
        if rng.random() < 0.1:
            items = rng.choice([[], "x", [{"key": 1, "len": 1}], [{"key": "k", "len": -1}]])
            total = rng.choice([0, 1])
        meta = {"items": items, "ctx": rand_ctx(rng)}
        return encode_frame(FrameType.PUT, rng.randrange(1 << 20), meta, total) + bytes(total)
    if r < 0.85:  # frames a client should not send (non-fatal errors)
        ftype = rng.choice([FrameType.EVICT, FrameType.EVICT_ACK, FrameType.HELLO])
        return encode_frame(ftype, rng.randrange(1 << 32), {"x": rng.random()})
    meta = rng.choice([{}, {"keys": None}, {"items": None}, {"ctx": "x"}, {"a": [1] * 100}])
    ftype = rng.choice([FrameType.EXISTS, FrameType.GET, FrameType.PUT, FrameType.REMOVE])
    return encode_frame(ftype, rng.randrange(1 << 20), meta)


def mutate(frame: bytes, rng: random.Random) -> bytes:
    """A frame with its bytes damaged: usually fatal (the sidecar closes the connection)."""
    b = bytearray(frame)
    r = rng.random()
    if r < 0.4:
        for _ in range(rng.randrange(1, 6)):
            b[rng.randrange(len(b))] = rng.randrange(256)
    elif r < 0.6:
        b = b[: rng.randrange(1, len(b))]
    elif r < 0.8:  # header fields: huge lengths, odd versions and types
        off = rng.choice([0, 4, 5, 6, 8, 12, 16])
        b[off : off + 4] = rng.randbytes(4)
    else:
        b = bytearray(rng.randbytes(rng.randrange(1, 200)))
    return bytes(b)


def lm_frame(rng: random.Random) -> bytes:
    """One valid or semi-valid ``lm://`` request (PUTs carry their value)."""
    command = rng.choice([1, 2, 2, 3, 3, 3, 4, 5])
    length = rng.choice([0, 1, 100, 4096, 70_000]) if command == 1 else 0
    shape = [rng.randrange(-2, 70000) for _ in range(4)]
    k = rand_key(rng) if rng.random() < 0.7 else rand_key(rng).replace("acme", "initech")
    head = LM_REQUEST.pack(
        command,
        length,
        rng.randrange(-1, 5),
        rng.randrange(-1, 20),
        rng.randrange(3),
        *shape,
        k.encode()[:150],
    )
    return head + bytes(length)


def lm_mutate(frame: bytes, rng: random.Random) -> bytes:
    b = bytearray(frame[: LM_REQUEST.size])
    r = rng.random()
    if r < 0.4:
        b[0:4] = struct.pack("=i", rng.choice([0, 6, 99, -1, 1 << 30]))
    elif r < 0.7:
        b[4:8] = struct.pack("=i", rng.choice([-1, -(1 << 31), 1 << 30, 2**31 - 1]))
    else:
        b = b[: rng.randrange(1, len(b))]
    return bytes(b)


# -- the attack (this process) --------------------------------------------------------------


class Stats:
    def __init__(self) -> None:
        self.frames: dict[str, int] = {}
        self.opened = 0
        self.closed_by_server = 0
        self.refused = 0
        self.errors: dict[str, int] = {}

    def add(self, kind: str, n: int = 1) -> None:
        self.frames[kind] = self.frames.get(kind, 0) + n

    @property
    def total(self) -> int:
        return sum(self.frames.values())


async def drain_reader(reader: asyncio.StreamReader) -> None:
    with contextlib.suppress(Exception):
        while await reader.read(1 << 16):
            pass


async def connect(port: int, stats: Stats) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    stats.opened += 1
    return reader, writer


async def wire_hello(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, token: str, engine: str
) -> bool:
    """HELLO on the kvgov wire, through the token handshake when ``token`` is given
    (:func:`kvgov.wire.handshake.start`); False when the sidecar refused it."""
    from kvgov.wire import handshake
    from kvgov.wire.codec import (
        HEADER_SIZE,
        PROTOCOL_VERSION,
        FrameType,
        decode_header,
        decode_meta,
        encode_frame,
    )

    meta: dict[str, Any] = {"engine": engine, "version": PROTOCOL_VERSION}
    if not token:
        writer.write(encode_frame(FrameType.HELLO, 1, meta))
        return True
    first, answer = handshake.start(token, meta)
    writer.write(encode_frame(FrameType.HELLO, 1, first))
    head = decode_header(await reader.readexactly(HEADER_SIZE))
    challenge = decode_meta(await reader.readexactly(head.meta_len))
    await reader.readexactly(head.payload_len)
    mine = answer(challenge) if head.type is FrameType.HELLO else None
    if mine is None:
        return False
    writer.write(encode_frame(FrameType.HELLO, 1, mine))
    return True


async def fuzzer(
    listener: str, port: int, stats: Stats, stop: asyncio.Event, seed: int, batch: int
) -> None:

    rng = random.Random(seed)
    pool = [wire_frame(rng) if listener == "wire" else lm_frame(rng) for _ in range(4000)]
    while not stop.is_set():
        try:
            reader, writer = await connect(port, stats)
        except OSError as exc:
            stats.errors[type(exc).__name__] = stats.errors.get(type(exc).__name__, 0) + 1
            await asyncio.sleep(0.05)
            continue
        try:
            if listener == "wire":
                token = rng.choice(TOKENS[:2]) if rng.random() < 0.9 else rng.choice(TOKENS)
                await wire_hello(reader, writer, token, "fuzz")
                stats.add("wire:hello")
        except (OSError, asyncio.IncompleteReadError, ValueError):
            writer.close()
            continue
        drain = asyncio.ensure_future(drain_reader(reader))
        try:
            for _ in range(rng.randrange(1, 20)):  # batches on this connection
                if stop.is_set() or drain.done():
                    break
                frames = [rng.choice(pool) for _ in range(batch)]
                writer.write(b"".join(frames))
                await writer.drain()
                stats.add(f"{listener}:valid", len(frames))
            if not drain.done():
                last = rng.choice(pool)
                writer.write(mutate(last, rng) if listener == "wire" else lm_mutate(last, rng))
                await writer.drain()
                stats.add(f"{listener}:mutated")
                writer.write_eof()
                await asyncio.wait_for(asyncio.shield(drain), 10)
                stats.closed_by_server += 1
        except (OSError, TimeoutError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            drain.cancel()
        # refresh a few pool entries: the corpus keeps changing
        for _ in range(10):
            pool[rng.randrange(len(pool))] = (
                wire_frame(rng) if listener == "wire" else lm_frame(rng)
            )


async def slowloris(port: int, listener: str, stats: Stats, stop: asyncio.Event, seed: int) -> None:
    """Trickle a HELLO (wire) or a request (lm://) one byte every 0.2 s; count the closes."""
    from kvgov.wire import handshake
    from kvgov.wire.codec import PROTOCOL_VERSION, FrameType, encode_frame

    rng = random.Random(seed)
    while not stop.is_set():
        try:
            reader, writer = await connect(port, stats)
        except OSError:
            await asyncio.sleep(0.5)
            continue
        try:
            if listener == "wire":
                meta = {"engine": "slow", "version": PROTOCOL_VERSION}
                data = encode_frame(FrameType.HELLO, 1, handshake.start("tok-globex", meta)[0])
                # authenticated at once, then a frame trickled
                if rng.random() < 0.5 and await wire_hello(reader, writer, "tok-globex", "slow"):
                    data = encode_frame(FrameType.EXISTS, 2, {"keys": [rand_key(rng)]})
            else:
                data = lm_frame(rng)
            for byte in data:
                if stop.is_set():
                    break
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(0.2)
                if reader.at_eof():
                    break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(drain_reader(reader), 1)
            if reader.at_eof():
                stats.closed_by_server += 1
                stats.add("slowloris:closed")
        except (OSError, asyncio.IncompleteReadError):
            stats.add("slowloris:closed")
        finally:
            writer.close()


async def hog(port: int, listener: str, stats: Stats, stop: asyncio.Event, seed: int) -> None:
    """Declare a 60 MiB PUT and never send it (or GET and never read): hold the pool."""
    from kvgov.wire.codec import FrameType, encode_frame

    rng = random.Random(seed)
    while not stop.is_set():
        try:
            reader, writer = await connect(port, stats)
        except OSError:
            await asyncio.sleep(0.5)
            continue
        try:
            if listener == "wire":
                await wire_hello(reader, writer, "tok-globex", "hog")
                k = rand_key(rng).replace("@tenant%", "@tenant%globex#")
                items = (
                    [
                        {
                            "key": f"{MODEL}@1@0@{rng.getrandbits(40):x}@bfloat16@tenant%globex",
                            "len": 60 * MIB,
                        }
                    ]
                    if rng.random() < 0.7
                    else [{"key": k, "len": 60 * MIB}]
                )
                writer.write(encode_frame(FrameType.PUT, 2, {"items": items}, 60 * MIB))
                writer.write(bytes(rng.randrange(1, 4096)))
            else:
                k = f"{MODEL}@1@0@{rng.getrandbits(40):x}@bfloat16@tenant%initech"
                writer.write(LM_REQUEST.pack(1, 60 * MIB, 1, 3, 0, 1, 1, 1, 1, k.encode()))
                writer.write(bytes(rng.randrange(1, 4096)))
            await writer.drain()
            stats.add(f"hog:{listener}")
            # wait (not reading) until the sidecar closes it
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(drain_reader(reader), 120)
            if reader.at_eof():
                stats.closed_by_server += 1
        except OSError:
            pass
        finally:
            writer.close()


async def flood(port: int, stats: Stats, stop: asyncio.Event, count: int) -> None:
    """Every 10 s: ``count`` idle connections at once (beyond the caps), held 3 s."""
    while not stop.is_set():
        socks = []
        for _ in range(count):
            try:
                socks.append(await connect(port, stats))
            except OSError:
                stats.refused += 1
        try:
            await asyncio.sleep(3)
            for r, _ in socks:  # what the sidecar closed (a cap) reads as EOF
                with contextlib.suppress(TimeoutError, OSError):
                    await asyncio.wait_for(r.read(1), 0.001)
            stats.refused += sum(1 for r, _ in socks if r.at_eof())
            stats.add("flood:connections", len(socks))
        finally:
            for _, w in socks:
                w.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 7)


# -- orchestration --------------------------------------------------------------------------


class Honest:
    def __init__(self, port: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--honest", "--port", str(port)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.samples: list[dict[str, Any]] = []
        self._task = asyncio.get_running_loop().run_in_executor(None, self._read)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.samples.append(json.loads(line))

    def window(self, start: float, end: float) -> str:
        got = [s for s in self.samples if start <= s["t"] < end]
        if not got:
            return "no samples"
        ops = sum(s["ops"] for s in got)
        fails = sum(s["fails"] for s in got)
        lat = sorted(x for s in got for x in s["lat"])
        p50 = statistics.median(lat) * 1e3 if lat else 0.0
        p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3 if lat else 0.0
        secs = max(1e-9, end - start)
        return (
            f"{ops / secs:8.1f} put+get/s  fails {fails}  "
            f"p50 {p50:7.1f} ms  p99 {p99:8.1f} ms  ({len(got)} s sampled)"
        )

    async def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        await self._task
        self.proc.wait(30)


async def attack(
    args: argparse.Namespace, ports: dict[str, int], pid: int, sidecar: subprocess.Popen[str]
) -> Stats:
    stats = Stats()
    honest = Honest(ports["tcp"])
    t0 = time.time()
    await asyncio.sleep(args.phase)
    t1 = time.time()
    rss0, fds0 = proc_stats(pid)
    stop = asyncio.Event()
    tasks = []
    for i in range(args.fuzzers):
        tasks.append(fuzzer("wire", ports["tcp"], stats, stop, 100 + i, args.batch))
        tasks.append(fuzzer("lm", ports["lm"], stats, stop, 200 + i, args.batch))
    for i in range(args.slow):
        tasks.append(slowloris(ports["tcp"], "wire", stats, stop, 300 + i))
        tasks.append(slowloris(ports["lm"], "lm", stats, stop, 400 + i))
    for i in range(args.hogs):
        tasks.append(hog(ports["tcp"], "wire", stats, stop, 500 + i))
        tasks.append(hog(ports["lm"], "lm", stats, stop, 600 + i))
    tasks.append(flood(ports["tcp"], stats, stop, args.flood))
    running = [asyncio.ensure_future(t) for t in tasks]
    deadline = time.monotonic() + args.max_seconds
    last = 0.0
    at_least = time.monotonic() + args.min_seconds
    while (
        (stats.total < args.frames or time.monotonic() < at_least)
        and time.monotonic() < deadline
        and sidecar.poll() is None
    ):
        await asyncio.sleep(1)
        if time.monotonic() - last >= 30:
            last = time.monotonic()
            rss, fds = proc_stats(pid) if sidecar.poll() is None else (0.0, 0)
            print(
                f"  [{time.time() - t1:6.0f} s] frames {stats.total:>9,}  sidecar RSS "
                f"{rss:7.1f} MiB  fds {fds:5}",
                flush=True,
            )
    stop.set()
    t2 = time.time()
    for r in running:
        r.cancel()
    await asyncio.gather(*running, return_exceptions=True)
    await asyncio.sleep(args.settle)  # deadlines close what the attack left behind
    t3 = time.time()
    rss1, fds1 = proc_stats(pid) if sidecar.poll() is None else (0.0, 0)
    await asyncio.sleep(args.phase)
    t4 = time.time()
    rss2, fds2 = proc_stats(pid) if sidecar.poll() is None else (0.0, 0)
    kinds = fd_kinds(pid) if sidecar.poll() is None else {}
    await honest.close()
    print(
        f"\nattack: {t2 - t1:.0f} s, {stats.total:,} frames sent "
        f"({stats.total / max(1e-9, t2 - t1):,.0f}/s)"
    )
    for kind, n in sorted(stats.frames.items()):
        print(f"  {kind:<22} {n:>10,}")
    print(
        f"connections opened {stats.opened:,}; closed by the sidecar (fatal frame, deadline, "
        f"cap) {stats.closed_by_server:,}; flood connections refused {stats.refused:,}"
    )
    if stats.errors:
        print(f"client-side connect errors: {stats.errors}")
    print(
        f"sidecar RSS   before {rss0:7.1f} MiB  after {rss1:7.1f} MiB  "
        f"after +{args.phase:.0f} s {rss2:7.1f} MiB"
    )
    print(
        f"sidecar fds   before {fds0:7}      after {fds1:7}      after +{args.phase:.0f} s {fds2:7}"
    )
    print(f"sidecar fds at the end by kind: {kinds}")
    print("honest engine (vllm-acme, 100 kB put + get, verified):")
    print(f"  before  {honest.window(t0, t1)}")
    print(f"  during  {honest.window(t1, t2)}")
    print(f"  after   {honest.window(t3, t4)}")
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=1_000_000)
    parser.add_argument("--max-seconds", type=float, default=840.0)
    parser.add_argument(
        "--min-seconds",
        type=float,
        default=300.0,
        help="attack at least this long (deadlines, floods and hogs cycle many times)",
    )
    parser.add_argument("--phase", type=float, default=15.0, help="honest-only seconds")
    parser.add_argument("--settle", type=float, default=5.0)
    parser.add_argument("--fuzzers", type=int, default=4, help="per listener")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--slow", type=int, default=50, help="slowloris per listener")
    parser.add_argument("--hogs", type=int, default=4, help="pool hogs per listener")
    parser.add_argument("--flood", type=int, default=1500)
    parser.add_argument("--pool-mib", type=int, default=256)
    parser.add_argument("--memory-mib", type=int, default=256, help="memory tier bytes")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--honest", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--tmp", default="", help=argparse.SUPPRESS)
    parser.add_argument("--log", default="", help=argparse.SUPPRESS)
    parser.add_argument("--db-url", default="", help=argparse.SUPPRESS)
    parser.add_argument("--db-role", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args)
        return
    if args.honest:
        honest(args)
        return

    from tests.pgroles import role_database

    from kvgov.db.engine import upgrade

    with tempfile.TemporaryDirectory() as tmp, role_database() as db:
        upgrade(db.owner_url, runtime_role=db.runtime)
        log = Path(tmp) / "sidecar.log"
        sidecar = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--serve",
                "--tmp",
                tmp,
                "--log",
                str(log),
                "--db-url",
                db.runtime_url,
                "--db-role",
                db.runtime,
                "--pool-mib",
                str(args.pool_mib),
                "--memory-mib",
                str(args.memory_mib),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert sidecar.stdout is not None
            ports = json.loads(sidecar.stdout.readline())
            print(
                f"sidecar pid {sidecar.pid}: kvgov wire :{ports['tcp']}, lm:// :{ports['lm']}; "
                f"pool {args.pool_mib} MiB, memory tier {args.memory_mib} MiB; "
                f"target {args.frames:,} frames, "
                f"<= {args.max_seconds:.0f} s",
                flush=True,
            )
            asyncio.run(attack(args, ports, sidecar.pid, sidecar))
            exited = sidecar.poll()
        finally:
            if sidecar.poll() is None:
                sidecar.send_signal(signal.SIGTERM)
                sidecar.wait(60)
        text = log.read_text() if log.exists() else ""
        failed = text.count("dataplane.connection.failed")
        tracebacks = text.count("Traceback")
        errors = [ln for ln in text.splitlines() if ln.startswith(("ERROR", "CRITICAL"))]
        crashes = (exited is not None) + failed
        print(
            f"crashes: {crashes} (sidecar exited during the attack: {exited is not None}; "
            f"handlers died: {failed}); tracebacks logged: {tracebacks}; "
            f"ERROR lines: {len(errors)}; sidecar exit code at stop: {sidecar.returncode}"
        )
        for line in sorted(set(errors))[:10]:
            print(f"  {line[:200]}")
        warnings = [
            ln.split(" ", 2)[2] if ln.count(" ") >= 2 else ln
            for ln in text.splitlines()
            if ln.startswith("WARNING")
        ]
        counts: dict[str, int] = {}
        for w in warnings:
            counts[w[:80]] = counts.get(w[:80], 0) + 1
        print(
            f"sidecar log: {len(text.splitlines())} lines; warnings by message: "
            + ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())[:8])
        )


if __name__ == "__main__":
    main()

"""The floor under bench/dataplane.py's ratios: what encryption alone costs on this machine's
loopback, with no kvgov code at all.

Raw sockets, one server process per side (like the sidecars), one blocking client:

* **put**: the client sends ``n`` chunks back to back (an 8-byte length, then the bytes), and
  waits for a 1-byte acknowledgement after the last. The plain server receives each chunk into
  one preallocated buffer; the sealed one also encrypts each 1 MiB segment with AES-256-GCM
  (``encrypt_into``, the data path's call) as soon as it has arrived, in a second thread, so
  sealing overlaps receiving (what the sidecar does).
* **get**: the client asks for a chunk (1 byte) and receives it into a preallocated buffer. The
  plain server ``sendall``\\ s it from memory (what ``lmcache_server`` does); the sealed one opens
  each 1 MiB segment (``decrypt_into``) in a second thread while the segments before it are being
  sent. A one-segment chunk is sealed or opened inline (a thread hand-off costs more).

The sealed/plain time ratio is the least any governed data path can add to the same transport
here: on a 2-core machine encryption competes with the copies into and out of the kernel for
the same cores. ``python bench/floor.py [--mib 128] [--repeat 3]`` prints GB/s and the ratios,
and the server's CPU per chunk (ms, from ``/proc``: every thread, kernel time included): the CPU
a sealed put or an opened get costs on this transport before any governance.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import socket
import statistics
import struct
import threading
import time
from multiprocessing.queues import Queue
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

MIB = 1 << 20
SEGMENT = MIB
TAG = 16
LENGTH = struct.Struct("!Q")


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < view.nbytes:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("closed")
        got += n


def _segments(size: int) -> list[tuple[int, int]]:
    return [(off, min(SEGMENT, size - off)) for off in range(0, size, SEGMENT)]


def _serve(mode: str, size: int, ready: Queue[Any]) -> None:
    """Child process: serve one client in ``mode`` (put-plain, put-sealed, get-plain,
    get-sealed) until it disconnects."""
    listener = socket.create_server(("127.0.0.1", 0))
    ready.put(listener.getsockname()[1])
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    aead = AESGCM(os.urandom(32))
    nonce = os.urandom(12)
    plain = memoryview(bytearray(os.urandom(size)))
    spans = _segments(size)
    sealed = memoryview(bytearray(size + TAG * len(spans)))
    for i, (off, n) in enumerate(spans):
        aead.encrypt_into(nonce, plain[off : off + n], None, sealed[off + i * TAG :][: n + TAG])
    head = memoryview(bytearray(LENGTH.size))
    one = bytearray(1)
    # one long-lived crypto thread, fed segment by segment (a one-segment chunk is done inline:
    # a hand-off costs more than its ~0.1 ms of AES-GCM)
    jobs: queue.SimpleQueue[tuple[memoryview, memoryview, threading.Event | None]] = (
        queue.SimpleQueue()
    )

    def crypto() -> None:
        while True:
            src, dst, done = jobs.get()
            if mode.startswith("put"):
                aead.encrypt_into(nonce, src, None, dst)
            else:
                aead.decrypt_into(nonce, src, None, dst)
            if done is not None:
                done.set()

    threading.Thread(target=crypto, daemon=True).start()
    try:
        if mode.startswith("put"):
            while True:
                _recv_into(conn, head)
                (n,) = LENGTH.unpack(head)
                if n == 0:
                    conn.sendall(b"k")
                    continue
                chunk = _segments(n)
                last = threading.Event()
                for i, (off, ln) in enumerate(chunk):
                    _recv_into(conn, plain[off : off + ln])
                    if mode == "put-plain":
                        continue
                    out = sealed[off + i * TAG :][: ln + TAG]
                    if len(chunk) == 1:
                        aead.encrypt_into(nonce, plain[off : off + ln], None, out)
                    else:
                        jobs.put(
                            (plain[off : off + ln], out, last if i == len(chunk) - 1 else None)
                        )
                if mode == "put-sealed" and len(chunk) > 1:
                    last.wait()  # sealed before the next chunk reuses the buffer
        else:
            while conn.recv_into(one):
                if mode == "get-plain":
                    conn.sendall(plain)
                    continue
                if len(spans) == 1:
                    aead.decrypt_into(nonce, sealed, None, plain)
                    conn.sendall(plain)
                    continue
                opened = [threading.Event() for _ in spans]
                for i, (off, ln) in enumerate(spans):
                    jobs.put(
                        (sealed[off + i * TAG :][: ln + TAG], plain[off : off + ln], opened[i])
                    )
                for i, (off, ln) in enumerate(spans):
                    opened[i].wait()
                    conn.sendall(plain[off : off + ln])
    except (ConnectionError, OSError):
        pass
    finally:
        conn.close()
        listener.close()


def cpu_ticks(stat: Path) -> int:
    """utime + stime of a /proc/<pid>/stat (the whole process: every thread; 0 once gone)."""
    try:
        fields = stat.read_text().rsplit(")", 1)[1].split()
    except OSError:  # gone meanwhile
        return 0
    return int(fields[11]) + int(fields[12])


def machine_busy() -> float:
    """Busy CPU seconds of the whole machine so far (all cores, /proc/stat)."""
    times = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(times) - times[3] - times[4]) / os.sysconf("SC_CLK_TCK")  # all but idle, iowait


def _server_cpu(pid: int) -> float:
    """CPU seconds the server process used so far."""
    return cpu_ticks(Path(f"/proc/{pid}/stat")) / os.sysconf("SC_CLK_TCK")


def _client(mode: str, port: int, size: int, n: int, pid: int) -> tuple[float, float]:
    """GB/s and the server's CPU ms per chunk for ``n`` chunks of ``size`` bytes (one warm-up
    chunk first)."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    data = memoryview(os.urandom(size))
    buf = memoryview(bytearray(size))
    ack = memoryview(bytearray(1))

    def puts(count: int) -> None:
        for _ in range(count):
            sock.sendall(LENGTH.pack(size))
            sock.sendall(data)
        sock.sendall(LENGTH.pack(0))
        _recv_into(sock, ack)

    def gets(count: int) -> None:
        for _ in range(count):
            sock.sendall(b"g")
            _recv_into(sock, buf)

    run = puts if mode.startswith("put") else gets
    try:
        run(1)
        cpu = _server_cpu(pid)
        start = time.perf_counter()
        run(n)
        elapsed = time.perf_counter() - start
        return size * n / elapsed / 1e9, 1000 * (_server_cpu(pid) - cpu) / n
    finally:
        sock.close()


def measure(mode: str, size: int, n: int) -> tuple[float, float]:
    ctx = mp.get_context("spawn")
    ready: Queue[Any] = ctx.Queue()
    proc = ctx.Process(target=_serve, args=(mode, size, ready), daemon=True)
    proc.start()
    try:
        port = ready.get(timeout=30)
        assert proc.pid is not None
        return _client(mode, port, size, n, proc.pid)
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()


MODES = ("put-plain", "put-sealed", "get-plain", "get-sealed")


def chunks_for(size: int, budget_mib: int) -> int:
    """Chunks of ``size`` bytes one measurement moves: ``budget_mib``, at least eight."""
    return max(8, budget_mib * MIB // size)


def floor(size: int, budget_mib: int, repeat: int) -> dict[str, float]:
    """Median GB/s per mode and (``<mode> cpu``) the server's median CPU ms per chunk, the modes
    interleaved ``repeat`` times."""
    n = chunks_for(size, budget_mib)
    runs: dict[str, list[tuple[float, float]]] = {}
    for _ in range(repeat):
        for mode in MODES:
            runs.setdefault(mode, []).append(measure(mode, size, n))
    out = {mode: statistics.median(r[0] for r in v) for mode, v in runs.items()}
    out.update({f"{mode} cpu": statistics.median(r[1] for r in v) for mode, v in runs.items()})
    return out


def aes_gbps(rounds: int = 3) -> tuple[float, float]:
    """One core's AES-256-GCM seal and open of 1 MiB segments, GB/s, the best of ``rounds``
    passes over 32 MiB (sealed into a value's buffer, opened into one warm segment buffer, as
    the sidecar does): what sets most of the distance between the floor's plain and sealed
    columns, and between machines."""
    aead = AESGCM(os.urandom(32))
    nonce = os.urandom(12)
    plain = bytearray(os.urandom(MIB)) * 32
    sealed = bytearray(len(plain) + 32 * TAG)
    seg = bytearray(MIB)
    best_seal = best_open = 0.0
    for _ in range(rounds):
        t0 = time.perf_counter()
        for i in range(32):
            dst = memoryview(sealed)[i * (MIB + TAG) : (i + 1) * (MIB + TAG)]
            aead.encrypt_into(nonce, memoryview(plain)[i * MIB : (i + 1) * MIB], None, dst)
        t1 = time.perf_counter()
        for i in range(32):
            src = memoryview(sealed)[i * (MIB + TAG) : (i + 1) * (MIB + TAG)]
            aead.decrypt_into(nonce, src, None, seg)
        t2 = time.perf_counter()
        best_seal = max(best_seal, 32 * MIB / (t1 - t0) / 1e9)
        best_open = max(best_open, 32 * MIB / (t2 - t1) / 1e9)
    return best_seal, best_open


def print_floor(sizes: list[int], budget_mib: int, repeat: int) -> dict[int, dict[str, float]]:
    """Measure and print the floor; returns each size's medians (GB/s by mode)."""
    out: dict[int, dict[str, float]] = {}
    seal, opened = aes_gbps()
    print(
        f"\nthis machine: {os.cpu_count()} CPUs; AES-256-GCM on one core, 1 MiB segments:"
        f" seal {seal:.1f} GB/s, open {opened:.1f} GB/s"
    )
    print("floor: raw sockets, no kvgov code; AES-256-GCM in 1 MiB segments beside the copies")
    print("(GB/s; the ratio is the least that encryption alone adds to this transport here)")
    print(
        f"{'chunk':>7} {'put plain':>9} {'sealed':>7} {'ratio':>6}"
        f" {'get plain':>9} {'opened':>7} {'ratio':>6}"
        "   server CPU ms/chunk: put plain/sealed, get plain/opened"
    )
    for size in sizes:
        f = out[size] = floor(size, budget_mib, repeat)
        print(
            f"{size // MIB:>5}MiB {f['put-plain']:9.2f} {f['put-sealed']:7.2f}"
            f" {f['put-plain'] / f['put-sealed']:5.2f}x {f['get-plain']:9.2f}"
            f" {f['get-sealed']:7.2f} {f['get-plain'] / f['get-sealed']:5.2f}x"
            f"   {f['put-plain cpu']:6.2f}/{f['put-sealed cpu']:6.2f}"
            f" {f['get-plain cpu']:6.2f}/{f['get-sealed cpu']:6.2f}",
            flush=True,
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=128, help="bytes moved per size, mode, run")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 32], help="chunk MiB")
    args = parser.parse_args()
    print_floor([m * MIB for m in args.sizes], args.mib, args.repeat)


if __name__ == "__main__":
    main()

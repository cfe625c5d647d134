"""Load on loopback: ``kvgov serve`` in a subprocess (real Postgres ledger, Rego policy,
keyring, memory tier), 16 client threads with the blocking wire client doing mixed
put/get/exists on four tenants for a bounded time.

Asserts: no errors; after a graceful stop, the ledger holds exactly one event per operation
performed, per kind (``kv:put`` per stored put, ``kv:get`` per hit, ``kv:miss`` per miss,
``kv:exists`` per exists); and the server's resident memory stays bounded.

The memory bound: each client rewrites a fixed set of keys (16 MiB of values at most), so the
stored data stops growing once every key has been written. What can still grow: in-flight
buffers, capped by ``buffer_pool_bytes``; the memory tier, whose live values plus the buffers
it keeps for reuse are capped by ``tiers.memory_max_bytes`` (with values of varying sizes its
reuse pool fills up to that cap: by design, so the cap is set here); plus allocator and
ledger-batch slack. So RSS may grow from its first sample by at most
``buffer_pool_bytes + memory_max_bytes + SLACK``; a leak of one buffer per operation (several
GiB over this run) would blow through it.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import BinaryIO

import pytest
from sqlalchemy import create_engine, func, select

from kvgov.db.models import LedgerEvent
from kvgov.types import EventKind
from kvgov.wire import RequestContext, WireClient, WireError

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

MIB = 1 << 20
CLIENTS = 16
DURATION_S = 20.0
KEYS_PER_CLIENT = 8
MAX_VALUE = 128 * 1024
POOL = 32 * MIB
TIER = 48 * MIB
SLACK = 64 * MIB
TENANTS = ("demo", "t-blue", "t-green", "t-red")
ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def _policy_data(path: Path) -> Path:
    data = json.loads((ROOT / "src/kvgov/policy/rego/data.json").read_text())
    data["tenants"] = {t: {"enabled": True, "engines": ["*"]} for t in TENANTS}
    data["revision"] = "load-test"
    path.write_text(json.dumps(data))
    return path


def _key(tenant: str, client: int, slot: int) -> str:
    return f"meta-llama/Llama-3.1-8B@1@0@{client:02x}{slot:04x}@bfloat16@tenant%{tenant}"


class Worker(threading.Thread):
    def __init__(self, address: str, index: int, deadline: float) -> None:
        super().__init__(name=f"load-{index}", daemon=True)
        self.address = address
        self.index = index
        self.deadline = deadline
        self.tenant = TENANTS[index % len(TENANTS)]
        self.ops: Counter[str] = Counter()
        self.errors: list[str] = []
        self.written: dict[int, bytes] = {}

    def run(self) -> None:
        rng = random.Random(self.index)
        ctx = RequestContext(request_id=f"load-{self.index}", user=f"user-{self.index}")
        client = WireClient(self.address, engine_id=f"vllm-load-{self.index}", pool_size=1)
        try:
            while time.monotonic() < self.deadline:
                slot = rng.randrange(KEYS_PER_CLIENT)
                key = _key(self.tenant, self.index, slot)
                roll = rng.random()
                if roll < 0.4:
                    value = rng.randbytes(rng.randrange(1, MAX_VALUE))
                    ack = client.put(key, value, ctx)
                    if not ack.ok:
                        self.errors.append(f"put {ack.error} {ack.reason}")
                        continue
                    # a live key keeps its first bytes (a second put is acknowledged, not
                    # rewritten, and recorded as kept): an engine then reads the first bytes
                    self.ops["kept" if slot in self.written else "put"] += 1
                    self.written.setdefault(slot, value)
                elif roll < 0.8:
                    hit = client.get(key, ctx)
                    expected = self.written.get(slot)
                    if hit is None:
                        self.ops["miss"] += 1
                        if expected is not None:
                            self.errors.append("get missed a stored value")
                    else:
                        self.ops["get"] += 1
                        if hit[0] != expected:
                            self.errors.append("get returned other bytes")
                else:
                    found = client.exists(key, ctx)
                    self.ops["exists"] += 1
                    if found != (slot in self.written):
                        self.errors.append("exists disagrees")
        except WireError as exc:
            self.errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            client.close()


def _serve(tmp: Path, pg_url: str, port: int, log: BinaryIO) -> subprocess.Popen[bytes]:
    env = dict(
        os.environ,
        KVGOV_DATA_DIR=str(tmp / "data"),
        KVGOV_LOG_LEVEL="warning",
        KVGOV_DATABASE__URL=pg_url,
        KVGOV_DATAPLANE__HOST="127.0.0.1",
        KVGOV_DATAPLANE__PORT=str(port),
        KVGOV_DATAPLANE__LM_PORT="-1",
        KVGOV_DATAPLANE__BUFFER_POOL_BYTES=str(POOL),
        KVGOV_API__PORT=str(_free_port()),
        KVGOV_POLICY__DATA_FILE=str(_policy_data(tmp / "policy-data.json")),
        KVGOV_TIERS__CHAIN='["memory"]',
        KVGOV_TIERS__MEMORY_MAX_BYTES=str(TIER),
    )
    return subprocess.Popen(
        [sys.executable, "-m", "kvgov", "serve"],
        env=env,
        cwd=tmp,
        stdout=subprocess.DEVNULL,
        stderr=log,
    )


def _wait_ready(proc: subprocess.Popen[bytes], address: str, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"kvgov serve exited with {proc.returncode}")
        try:
            with WireClient(address, engine_id="probe", connect_timeout=0.5) as c:
                c.ping()
            return
        except WireError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _ledger_counts(pg_url: str) -> dict[EventKind, int]:
    engine = create_engine(pg_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                select(LedgerEvent.kind, func.count()).group_by(LedgerEvent.kind)
            ).all()
    finally:
        engine.dispose()
    return {EventKind(kind): int(n) for kind, n in rows}


def test_sixteen_clients_mixed_load(tmp_path: Path, pg_url: str) -> None:
    port = _free_port()
    address = f"tcp://127.0.0.1:{port}"
    log = (tmp_path / "serve.log").open("wb")
    proc = _serve(tmp_path, pg_url, port, log)
    samples: list[tuple[float, int]] = []
    try:
        _wait_ready(proc, address)
        start = time.monotonic()
        deadline = start + DURATION_S
        workers = [Worker(address, i, deadline) for i in range(CLIENTS)]
        stop_sampling = threading.Event()

        def sample() -> None:
            while not stop_sampling.is_set():
                samples.append((time.monotonic() - start, _rss(proc.pid)))
                stop_sampling.wait(0.2)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        for w in workers:
            w.start()
        for w in workers:
            w.join(DURATION_S + 60)
        elapsed = time.monotonic() - start
        stop_sampling.set()
        sampler.join(5)
        assert not any(w.is_alive() for w in workers), "a client hung"
    finally:
        proc.send_signal(signal.SIGTERM)  # graceful: drains and flushes the ledger
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        finally:
            log.close()
    assert code == 0, (tmp_path / "serve.log").read_text()[-4000:]

    errors = [e for w in workers for e in w.errors]
    assert not errors, errors[:10]
    ops: Counter[str] = Counter()
    for w in workers:
        ops.update(w.ops)
    total = sum(ops.values())

    counts = _ledger_counts(pg_url)
    assert counts.get(EventKind.KV_PUT, 0) == ops["put"]
    assert counts.get(EventKind.KV_PUT_KEPT, 0) == ops["kept"]
    assert counts.get(EventKind.KV_GET, 0) == ops["get"]
    assert counts.get(EventKind.KV_MISS, 0) == ops["miss"]
    assert counts.get(EventKind.KV_EXISTS, 0) == ops["exists"]
    assert counts.get(EventKind.KV_DENIED, 0) == 0

    assert samples, "no RSS samples"
    first = samples[0][1]
    peak = max(rss for _, rss in samples)
    growth = peak - first
    print(
        f"\nload: {CLIENTS} clients, {total} ops in {elapsed:.1f}s = {total / elapsed:.0f} ops/s "
        f"({dict(ops)}); server RSS {first / MIB:.0f} MiB at start, peak {peak / MIB:.0f} MiB, "
        f"growth {growth / MIB:.1f} MiB (bound {(POOL + TIER + SLACK) / MIB:.0f} MiB)"
    )
    assert total >= CLIENTS * 10, "too few operations to say anything"
    assert growth <= POOL + TIER + SLACK

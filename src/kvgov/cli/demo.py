"""``kvgov demo``: kvgov governing two real LMCache engines on this machine, no set-up needed.

It starts a sidecar on embedded defaults in a temporary directory (SQLite ledger, embedded Rego
policy, per-tenant encryption, memory tier) and two real LMCache engines on CPU (a tiny model
geometry) whose only remote tier is ``KvgovConnector``; then runs two tenants and several users
through them and prints what happened: a cross-engine hit, a cross-tenant miss, a policy denial,
the provenance of one request, then the right to be forgotten: one user purged through the
running sidecar's purge service (the one behind ``kvgov purge`` and ``POST /v1/purges``, so its
memory tier and both engines are covered), the signed receipt checked, the user's prompts
missing on both engines while another user's still hit, and the whole ledger verified as
``kvgov audit verify`` does. The demo imports torch and lmcache (the ``lmcache`` extra); the
sidecar it starts does not need them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

from kvgov.cli._common import EXIT_FAILED, echo

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from kvgov.config import Settings
    from kvgov.ledger.writer import LedgerWriter
    from kvgov.proxy.app import Sidecar

T = TypeVar("T")

MODEL = "kvgov-demo/tiny"
LAYERS, HEADS, HEAD_DIM, CHUNK = 4, 4, 64, 256


def register(app: typer.Typer) -> None:
    @app.command("demo")
    def demo(
        keep: Annotated[
            bool, typer.Option("--keep", help="Keep the temporary data directory.")
        ] = False,
    ) -> None:
        """Run the end-to-end demo: two tenants, several users, two real LMCache engines."""
        os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
        logging.disable(logging.WARNING)  # LMCache and the sidecar log every operation
        data_dir = Path(tempfile.mkdtemp(prefix="kvgov-demo-"))
        try:
            ok = _run(data_dir)
        finally:
            logging.disable(logging.NOTSET)
            if not keep:
                import shutil

                shutil.rmtree(data_dir, ignore_errors=True)
        if not ok:
            raise typer.Exit(EXIT_FAILED)


def _run(data_dir: Path) -> bool:
    from kvgov.config import load_settings

    policy_data = json.loads(
        (Path(__file__).resolve().parents[1] / "policy/rego/data.json").read_text()
    )
    policy_data["tenants"] = {t: {"enabled": True, "engines": ["*"]} for t in ("acme", "globex")}
    data_file = data_dir / "policy-data.json"
    data_file.write_text(json.dumps(policy_data))
    settings = load_settings(
        data_dir=data_dir,
        log_level="warning",
        dataplane={"host": "", "unix_path": data_dir / "data.sock", "lm_port": -1},
        policy={"data_file": data_file},
        tiers={"chain": ["memory"]},
        # a purge that cannot finish ends `incomplete` (naming what) well within the demo
        purge={"poll_interval_s": 0.05, "job_timeout_s": 30.0},
    )
    echo(f"kvgov demo: sidecar on unix://{settings.dataplane.unix_path} (data in {data_dir})")
    sidecar = _SidecarThread(settings)
    sidecar.start()
    try:
        return _scenario(sidecar, f"unix://{settings.dataplane.unix_path}")
    finally:
        sidecar.stop()


def _scenario(sidecar: _SidecarThread, endpoint: str) -> bool:
    import torch

    engine_1 = _Engine(endpoint, "vllm-1")
    engine_2 = _Engine(endpoint, "vllm-2")
    ok = True
    try:
        prompt = torch.randint(1, 32_000, (2 * CHUNK,), generator=torch.Generator().manual_seed(1))
        tokens = prompt.tolist()
        notes = (prompt[:CHUNK] + 11).tolist()
        echo(f"\n1. alice@acme sends a {len(tokens)}-token prompt to engine vllm-1 (req-1)")
        engine_1.store(tokens, _ids("acme", "req-1", "alice"))
        engine_1.store(notes, _ids("acme", "req-1", "alice", private=True))
        echo("   stored 2 chunks, encrypted with acme's key; the ledger records alice's pseudonym")
        echo("   (and 1 chunk of her private chat history, tagged user=alice: alice's own key)")

        echo("\n2. bob@acme sends the same prompt to engine vllm-2 (req-2)")
        hits = engine_2.retrieve(tokens, _ids("acme", "req-2", "bob"))
        same = engine_2.kv_bytes(len(tokens)) == engine_1.kv_bytes(len(tokens))
        echo(f"   {hits} of {len(tokens)} tokens loaded from kvgov; KV bytes identical: {same}")
        ok &= hits == len(tokens) and same

        echo("\n3. dave@globex sends the same prompt to vllm-2 (req-3)")
        miss = engine_2.lookup(tokens, _ids("globex", "req-3", "dave"))
        echo(f"   {miss} tokens hit: another tenant's keys never match (cross-tenant miss)")
        ok &= miss == 0

        echo("\n4. carol@acme sends a restricted prompt to vllm-1 (req-4)")
        secret = (prompt + 7).tolist()
        engine_1.store(secret, _ids("acme", "req-4", "carol", "restricted"))
        denied = engine_2.lookup(secret, _ids("acme", "req-5", "carol", "restricted"))
        echo(f"   policy denied the put: {denied} tokens cached (the engine recomputes)")
        ok &= denied == 0

        echo("\n5. provenance of req-2 (which cached chunks fed bob's request?)")
        ok &= _print_provenance(sidecar, "req-2", "acme")

        other = (prompt + 3).tolist()
        echo("\n6. erin@acme caches her own prompt on vllm-2 (req-6)")
        engine_2.store(other, _ids("acme", "req-6", "erin"))

        echo("\n7. alice@acme asks to be forgotten: `kvgov purge --user alice --tenant acme`")
        echo("   (here: the same purge service, run by the demo sidecar as for POST /v1/purges)")
        ok &= _purge(sidecar, "acme", "alice")

        echo("\n8. after the purge")
        engines = (engine_1, engine_2)
        gone = [e.lookup(tokens, _ids("acme", "req-8", "alice")) for e in engines]
        echo(
            f"   alice's prompt: {gone[0]} tokens hit on vllm-1, {gone[1]} on vllm-2 "
            "(alice created it; acme's other users recompute it)"
        )
        private = [e.lookup(notes, _ids("acme", "req-8", "alice", private=True)) for e in engines]
        echo(
            f"   alice's private history: {private[0]} tokens hit on vllm-1, {private[1]} on vllm-2"
        )
        kept = [e.lookup(other, _ids("acme", "req-9", "erin")) for e in engines]
        echo(
            f"   erin's prompt: still {kept[0]} of {len(other)} tokens hit on vllm-1, "
            f"{kept[1]} on vllm-2"
        )
        ok &= gone == [0, 0] and private == [0, 0] and kept == [len(other)] * 2

        echo("\n9. ledger integrity (what `kvgov audit verify` checks)")
        ok &= _verify_ledger(sidecar)
    finally:
        engine_1.close()
        engine_2.close()
    echo("\nkvgov demo: " + ("all steps behaved as expected" if ok else "SOMETHING WENT WRONG"))
    return ok


def _ids(
    tenant: str,
    request_id: str,
    user: str,
    sensitivity: str = "internal",
    *,
    private: bool = False,
) -> dict[str, str]:
    """What a gateway puts in ``kv_transfer_params``: tenant tag first (then the user tag of
    user-scoped data), then kvgov's context."""
    ids = {"lmcache.tag.tenant": tenant}
    if private:
        ids["lmcache.tag.user"] = user
    ids.update(
        {
            "lmcache.kvgov.request_id": request_id,
            "lmcache.kvgov.user": user,
            "lmcache.kvgov.sensitivity": sensitivity,
        }
    )
    return ids


def _print_provenance(sidecar: _SidecarThread, request_id: str, tenant: str) -> bool:
    from kvgov.db.engine import make_sessionmaker
    from kvgov.errors import NotFoundError
    from kvgov.services.provenance import request_provenance

    writer, engine = sidecar.ledger()
    sidecar.call(writer.flush())
    with make_sessionmaker(engine)() as session:
        try:
            answer = request_provenance(session, request_id, tenant)
        except NotFoundError:
            echo(f"   the ledger has no request {request_id}")
            return False
    for chunk in answer.chunks:
        made = chunk.created
        if made is None:
            continue
        echo(
            f"   chunk #{chunk.position} {str(chunk.key_digest)[:12]}: created by "
            f"{made.request_id} (user {str(made.user)[:10]}..., {made.created_at:%H:%M:%S}), "
            f"policy {made.policy_revision}"
        )
    return len(answer.chunks) == 2


def _purge(sidecar: _SidecarThread, tenant: str, user: str) -> bool:
    """Purge through the running sidecar as ``POST /v1/purges`` does (create the job, wake the
    sidecar's executor, wait for the receipt); print the receipt and check its signature."""
    from kvgov.db.purge_views import JobView, PurgeRequest
    from kvgov.ledger.chain import load_public_key
    from kvgov.services.purge.receipts import ReceiptFor, verify_receipt

    executor = sidecar.running.purge
    if executor is None:
        raise RuntimeError("the demo sidecar has no purge executor")
    started = time.monotonic()

    async def run() -> JobView:
        job = await executor.service.create(
            PurgeRequest(tenant=tenant, user=user, requested_by="kvgov demo")
        )
        executor.wake()
        return await executor.service.wait(job.id, run_local=False)

    job = sidecar.call(run(), timeout_s=90.0)
    took = time.monotonic() - started
    receipt = (job.receipt or {}).get("receipt") or {}
    echo(f"   purge {job.id[:8]}: {job.state} in {took:.1f} s; the signed receipt says:")
    tiers = ", ".join(f"{k} {v}" for k, v in sorted(receipt.get("tiers", {}).items()))
    verified = "verified absent" if receipt.get("tiers_verified_absent") else "NOT verified"
    purged = receipt.get("entries_purged")
    echo(f"   - entries purged: {purged}; deleted per tier: {tiers} ({verified})")
    keys = [f"{k['key_id'][:16]}... v{k['version']}" for k in receipt.get("keys_destroyed", [])]
    echo(f"   - keys destroyed: {', '.join(keys) or 'none'} (what they sealed is now unreadable)")
    engines = receipt.get("engines") or {}
    echo(f"   - engines acknowledged EVICT: {', '.join(engines.get('acknowledged') or [])}")
    ledger = receipt.get("ledger") or {}
    event, checkpoint = ledger.get("erasure_event") or {}, ledger.get("checkpoint") or {}
    echo(
        f"   - ledger: erasure event at seq {event.get('seq')}, signed checkpoint at seq "
        f"{checkpoint.get('seq')} (payloads erased: {ledger.get('payloads_erased')})"
    )
    for line in receipt.get("incomplete") or []:
        echo(f"   - NOT DONE: {line}")
    trusted = [load_public_key(sidecar.settings.signing_key_path)]
    check = verify_receipt(job.receipt, trusted, job=ReceiptFor.of(job))
    mark = "valid" if check.ok else f"INVALID: {check.reason}"
    echo(f"   receipt signature: {mark} (Ed25519, this ledger's key {str(check.key_id)[:16]})")
    return bool(check.ok and job.state == "completed" and receipt.get("state") == "completed")


def _verify_ledger(sidecar: _SidecarThread) -> bool:
    """``kvgov audit verify`` on the demo's ledger: every chain recomputed, every checkpoint
    checked, against this node's signing key."""
    from kvgov.ledger.trust import trusted_keys, verify_trusted

    writer, engine = sidecar.ledger()
    sidecar.call(writer.flush())
    report = verify_trusted(
        engine,
        trusted_keys(sidecar.settings),
        expect_chains=[writer.chain_id],
    )
    for c in report.chains:
        bad = c.first_bad
        if bad is None:
            echo(
                f"   ok: {c.events} events, {c.checkpoints} signed checkpoint(s); every hash and "
                f"signature verifies (chain {c.chain_id})"
            )
        else:
            echo(f"   BROKEN chain {c.chain_id}: {bad.problem} at seq {bad.seq}: {bad.detail}")
    return report.ok and bool(report.chains)


class _Engine:
    """One real LMCache engine on CPU with KvgovConnector as its only remote tier."""

    def __init__(self, endpoint: str, engine_id: str) -> None:
        import torch
        from lmcache.v1.cache_engine import LMCacheEngineBuilder
        from lmcache.v1.config import LMCacheEngineConfig

        from kvgov.connectors.lmcache.cpu import CpuKVConnector, cpu_metadata

        config = LMCacheEngineConfig.from_defaults(
            chunk_size=CHUNK,
            local_cpu=False,
            max_local_cpu_size=0.1,
            local_disk=None,
            remote_url=None,
            remote_storage_plugins=["kvgov"],
            extra_config={
                "remote_storage_plugin.kvgov.module_path": "kvgov.connectors.lmcache",
                "remote_storage_plugin.kvgov.class_name": "KvgovConnector",
                "kvgov.endpoint": endpoint,
                "kvgov.engine_id": engine_id,
            },
        )
        self.gpu = CpuKVConnector(LAYERS, HEADS * HEAD_DIM, 4 * CHUNK, torch.bfloat16)
        self.gpu.kv.copy_(torch.randn(self.gpu.kv.shape).to(torch.bfloat16))
        self.instance_id = f"{engine_id}-{uuid.uuid4().hex[:6]}"
        meta = cpu_metadata(
            MODEL, layers=LAYERS, heads=HEADS, head_dim=HEAD_DIM, dtype=torch.bfloat16
        )
        self.engine: Any = LMCacheEngineBuilder.get_or_create(
            self.instance_id, config, meta, self.gpu, lambda t, i: None, lambda o, i: o
        )
        self.engine.post_init()

    def _args(self, tokens: list[int], ids: dict[str, str]) -> dict[str, Any]:
        import torch

        return {
            "slot_mapping": torch.arange(len(tokens), dtype=torch.long),
            "request_configs": ids,
        }

    def store(self, tokens: list[int], ids: dict[str, str]) -> None:
        import torch

        self.engine.store(torch.tensor(tokens), **self._args(tokens, ids))
        self._wait_puts()

    def lookup(self, tokens: list[int], ids: dict[str, str]) -> int:
        import torch

        return int(self.engine.lookup(torch.tensor(tokens), request_configs=ids))

    def retrieve(self, tokens: list[int], ids: dict[str, str]) -> int:
        import torch

        self.gpu.kv.zero_()
        mask = self.engine.retrieve(torch.tensor(tokens), **self._args(tokens, ids))
        return int(mask.sum().item())

    def kv_bytes(self, n: int) -> bytes:
        return bytes(self.gpu.kv[:, :, :n, :].contiguous().view(-1).view(dtype=_u8()).numpy())

    def _wait_puts(self) -> None:
        manager = self.engine.storage_manager
        for backend in manager.storage_backends.values():
            conn = getattr(backend, "connection", None)
            if conn is None:
                continue
            asyncio.run_coroutine_threadsafe(asyncio.sleep(0), backend.loop).result(10)
            conn.getWrappedConnector().wait_idle(30)

    def close(self) -> None:
        from lmcache.v1.cache_engine import LMCacheEngineBuilder

        self._wait_puts()
        manager = self.engine.storage_manager
        LMCacheEngineBuilder.destroy(self.instance_id)
        loop = getattr(manager, "loop", None)
        if loop is not None and not loop.is_running() and not loop.is_closed():
            loop.close()


def _u8() -> Any:
    import torch

    return torch.uint8


class _SidecarThread:
    """The real sidecar (``build_sidecar``) on its own event loop thread."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.app: Sidecar | None = None

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def start(self) -> None:
        from kvgov.proxy.app import build_sidecar

        self.thread.start()

        async def boot() -> Sidecar:
            app = await build_sidecar(self.settings)
            await app.start()
            return app

        self.app = self.call(boot())
        deadline = time.monotonic() + 10
        while not Path(str(self.settings.dataplane.unix_path)).exists():
            if time.monotonic() > deadline:
                raise RuntimeError("sidecar socket did not appear")
            time.sleep(0.01)

    @property
    def running(self) -> Sidecar:
        if self.app is None:
            raise RuntimeError("the demo sidecar is not running")
        return self.app

    def ledger(self) -> tuple[LedgerWriter, Engine]:
        """The running sidecar's ledger writer and engine."""
        app = self.running
        if app.writer is None or app.engine is None:
            raise RuntimeError("the demo sidecar has no ledger")
        return app.writer, app.engine

    def stop(self) -> None:
        if self.app is not None:
            self.call(self.app.stop(grace_s=5.0))
            self.app = None
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

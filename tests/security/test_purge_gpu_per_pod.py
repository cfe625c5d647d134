"""Attack (no attacker needed): a purge whose receipt says ``completed`` while pods' GPU prefix
caches still hold the purged user's KV blocks.

The shipped manifests give every pod ``purge.vllm_engines = ["http://127.0.0.1:8000"]``, its
own vLLM. The purge's ``gpu`` step was one global step, taken by whichever executor came first:
with several replicas one pod's vLLM was reset, the signed receipt said ``gpu_reset: ok`` and the
job ended ``completed``. Now each live sidecar has its own ``gpu@S`` step (review 4a, finding
1). Two "pods" here: two sidecars on one ledger, each with a stand-in for its loopback vLLM.
"""

from __future__ import annotations

import asyncio
import http.server
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kvgov.config import Settings
from kvgov.connectors.tiers.memory import MemoryTier
from kvgov.db import sidecars
from kvgov.db.engine import make_engine, make_sessionmaker, upgrade, utcnow
from kvgov.db.keystore import SqlKeyStore
from kvgov.db.purge_views import PurgeRequest, StepName, plan_steps
from kvgov.keys.kek import FileKekProvider, generate_kek_file
from kvgov.keys.keyring import Keyring
from kvgov.ledger.pseudonym import Pseudonymizer
from kvgov.ledger.writer import LedgerWriter
from kvgov.services.purge.build import make_service, writer_checkpointer
from kvgov.services.purge.ports import KeyringShredder
from kvgov.services.purge.service import PurgeService
from kvgov.types import PurgeState


class _Vllm:
    """A stand-in for one pod's vLLM: records each ``POST /reset_prefix_cache``."""

    def __init__(self) -> None:
        self.resets: list[str] = []
        calls = self.resets

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                calls.append(self.path)
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


@pytest.fixture
def vllms() -> Iterator[tuple[_Vllm, _Vllm]]:
    pods = (_Vllm(), _Vllm())
    yield pods
    for p in pods:
        p.server.shutdown()
        p.server.server_close()


async def _purge(
    pg_url: str, tmp: Path, pods: tuple[_Vllm, _Vllm], *, late: bool = False
) -> object:
    upgrade(pg_url)
    engine = make_engine(pg_url)
    key = Ed25519PrivateKey.generate()
    writer = LedgerWriter(engine, chain_id="pod-a", signing_key=key)
    await writer.start()
    keyring = Keyring(SqlKeyStore(engine), FileKekProvider(generate_kek_file(tmp / "kek.key")))
    pseudo = Pseudonymizer(os.urandom(32))
    base = Settings(
        data_dir=tmp,
        database={"url": pg_url},
        purge={"poll_interval_s": 0.05, "job_timeout_s": 20.0, "http_timeout_s": 2.0},
    )

    def service(sid: str | None, vllm: _Vllm) -> PurgeService:
        # each pod's own settings: its loopback vLLM, as the manifests set it
        settings = base.model_copy(
            update={"purge": base.purge.model_copy(update={"vllm_engines": [vllm.url]})}
        )
        return make_service(
            settings,
            sessions=make_sessionmaker(engine),
            sink=writer,
            tiers=[MemoryTier(8 << 20)],
            shredder=KeyringShredder(keyring),
            signing_key=key,
            pseudonymize=pseudo.user,
            checkpoint=writer_checkpointer(writer, engine, "pod-a"),
            sidecar_id=sid,
            principal=f"sidecar:{sid}" if sid else "cli",
        )

    def heartbeats() -> None:
        with make_sessionmaker(engine).begin() as s:
            for sid in ("sc-a", "sc-b"):
                sidecars.heartbeat(s, sid, now=utcnow(), chain_id=None)

    try:
        a, b = service("sc-a", pods[0]), service("sc-b", pods[1])
        if not late:
            heartbeats()
            job = await a.create(PurgeRequest(tenant="acme", user="alice"))
            await asyncio.gather(a.run_until_idle(), b.run_until_idle())
            await a.run_until_idle()  # the ledger step, once every other step is done
            return await asyncio.wait_for(a.wait(job.id), 30)
        # no sidecar live when the job is made (a rollout, a database blip): one global GPU
        # step, the CLI's; the sidecars that come back must not take it
        job = await a.create(PurgeRequest(tenant="acme", user="alice"))
        heartbeats()
        await asyncio.gather(a.run_until_idle(), b.run_until_idle())
        gpu = [st for st in (await a.get(job.id)).steps if st.name is StepName.GPU]
        assert [(st.sidecar_id, st.state) for st in gpu] == [(None, PurgeState.PENDING)]
        assert pods[0].resets == pods[1].resets == []
        cli = service(None, pods[0])  # an operator's `kvgov purge --wait` (its own engines)
        await cli.run_until_idle()
        return await asyncio.wait_for(cli.wait(job.id), 30)
    finally:
        await writer.close()
        engine.dispose()


def test_a_completed_purge_reset_every_live_pods_gpu_prefix_cache(
    pg_url: str, tmp_path: Path, vllms: tuple[_Vllm, _Vllm]
) -> None:
    job = asyncio.run(_purge(pg_url, tmp_path, vllms))
    assert job.state is PurgeState.COMPLETED  # type: ignore[attr-defined]
    a, b = vllms
    assert a.resets == ["/reset_prefix_cache"], "pod A's GPU prefix cache was not reset"
    assert b.resets == ["/reset_prefix_cache"], "pod B's GPU prefix cache was not reset"
    receipt = job.receipt["receipt"]  # type: ignore[attr-defined]
    # each reset names its pod: in the manifests every pod's vLLM is the same loopback URL
    assert sorted(r["engine"] for r in receipt["gpu_reset"]) == sorted(
        [f"{a.url} on sidecar sc-a", f"{b.url} on sidecar sc-b"]
    )


def test_each_live_sidecar_gets_its_own_gpu_step_and_the_cli_alone_a_global_one() -> None:
    gpu = [(p.name, p.sidecar_id) for p in plan_steps(["sc-b", "sc-a"]) if p.name is StepName.GPU]
    assert gpu == [(StepName.GPU, "sc-a"), (StepName.GPU, "sc-b")]
    alone = plan_steps([])
    assert [p.sidecar_id for p in alone if p.name is StepName.GPU] == [None]


def test_sidecars_that_come_back_leave_the_clis_gpu_step_to_it(
    pg_url: str, tmp_path: Path, vllms: tuple[_Vllm, _Vllm]
) -> None:
    """Review 5, finding F: a job made while no sidecar was live has one global GPU step, and
    the first sidecar back took it, reset its own pod's vLLM and the job said ``completed``.
    Now only a sidecar-less executor (the CLI) takes it; otherwise the job ends incomplete."""
    job = asyncio.run(_purge(pg_url, tmp_path, vllms, late=True))
    a, b = vllms
    assert a.resets == ["/reset_prefix_cache"]  # the CLI's own engine
    assert b.resets == []
    gpu = [st for st in job.steps if st.name is StepName.GPU]  # type: ignore[attr-defined]
    assert [st.detail["executed_by"] for st in gpu] == ["cli"]

"""A serving sidecar signs its chain head periodically (``ledger.checkpoint_interval_s``) and
once more on a graceful stop, and ``kvgov audit verify`` accepts every checkpoint.

Real sidecar (wire server, Rego policy, keyring, tiers) on real Postgres; puts over the wire.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session
from typer.testing import CliRunner

from kvgov.cli.main import build_app
from kvgov.config import Settings
from kvgov.db.models import Checkpoint, LedgerEvent
from kvgov.proxy.app import Sidecar
from kvgov.wire import RequestContext, WireClient
from tests.integration.live import loopback_settings, start_sidecar

pytestmark = pytest.mark.postgres


def _settings(data_dir: Path, pg_url: str, interval_s: float) -> Settings:
    return loopback_settings(
        data_dir,
        pg_url,
        pool_mib=8,
        ledger={"checkpoint_interval_s": interval_s},
        tiers={"chain": ["memory"]},
    )


async def _put(sc: Sidecar, n: int, offset: int) -> None:
    def talk() -> None:
        client = WireClient(f"tcp://127.0.0.1:{sc.server.tcp_port}", engine_id="e0", timeout=10)
        try:
            ctx = RequestContext(request_id=f"req-{offset}", user="u42")
            items = [
                (f"m@1@0@{offset + i:x}@bfloat16@tenant%demo@user%u42", os.urandom(64), None)
                for i in range(n)
            ]
            assert all(a.ok for a in client.put_many(items, ctx))
        finally:
            client.close()

    await asyncio.get_running_loop().run_in_executor(None, talk)


def _checkpoints(sc: Sidecar) -> list[int]:
    with Session(sc.engine) as s:
        return list(
            s.scalars(
                select(Checkpoint.seq)
                .where(Checkpoint.chain_id == sc.settings.chain_id)
                .order_by(Checkpoint.seq)
            )
        )


def _head(sc: Sidecar) -> int:
    with Session(sc.engine) as s:
        return int(
            s.scalar(
                select(func.max(LedgerEvent.seq)).where(
                    LedgerEvent.chain_id == sc.settings.chain_id
                )
            )
            or 0
        )


async def _until(check: object, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_a_serving_sidecar_checkpoints_and_verify_passes(tmp_path: Path, pg_url: str) -> None:
    data_dir = tmp_path / "fresh" / "data"
    sc = await start_sidecar(_settings(data_dir, pg_url, interval_s=0.2))
    try:
        assert stat.S_IMODE(data_dir.stat().st_mode) == 0o700  # created private
        await _put(sc, 3, 0)
        await sc.writer.flush()
        first = _head(sc)
        await _until(lambda: first in _checkpoints(sc))
        await _put(sc, 3, 100)
        await sc.writer.flush()
        second = _head(sc)
        assert second > first
        await _until(lambda: second in _checkpoints(sc))
        await _put(sc, 2, 200)  # after these, only the final checkpoint on stop signs the head
    finally:
        await sc.stop()
    assert sc.engine is not None
    head = _head(sc)
    assert head > second
    assert _checkpoints(sc)[-1] == head
    sc.engine.dispose()  # the reads above opened connections after stop() disposed of it

    env = {"KVGOV_DATABASE_URL": pg_url, "KVGOV_DATA_DIR": str(data_dir)}
    result = CliRunner().invoke(build_app(), ["audit", "verify", "--json"], env=env)
    assert result.exit_code == 0, result.stdout
    report = json.loads(result.stdout)
    [chain] = [c for c in report["chains"] if c["chain_id"] == sc.settings.chain_id]
    assert chain["events"] == head
    assert chain["checkpoints"] >= 3


async def test_interval_zero_writes_no_checkpoints(tmp_path: Path, pg_url: str) -> None:
    sc = await start_sidecar(_settings(tmp_path / "data", pg_url, interval_s=0))
    try:
        await _put(sc, 2, 0)
        await sc.writer.flush()
        await asyncio.sleep(0.3)
    finally:
        await sc.stop()
    assert _head(sc) > 0
    assert _checkpoints(sc) == []
    sc.engine.dispose()


async def test_start_and_stop_are_ledger_events_with_the_policy_revision(
    tmp_path: Path, pg_url: str
) -> None:
    sc = await start_sidecar(_settings(tmp_path / "data", pg_url, interval_s=0))
    revision = sc.pipeline.policy.revision if sc.pipeline.policy is not None else None
    assert revision is not None
    await sc.stop()
    assert sc.engine is not None
    with Session(sc.engine) as s:
        rows = s.execute(
            select(
                LedgerEvent.kind,
                LedgerEvent.principal,
                LedgerEvent.policy_revision,
                LedgerEvent.attrs,
            )
            .where(LedgerEvent.chain_id == sc.settings.chain_id)
            .order_by(LedgerEvent.seq)
        ).all()
    sc.engine.dispose()
    assert [r.kind for r in rows] == ["sidecar:started", "sidecar:stopped"]
    for row in rows:
        assert row.principal == sc.sidecar_id
        assert row.policy_revision == revision.policy
        assert row.attrs["data_revision"] == revision.data
        assert row.attrs["governance"] is True
        assert row.attrs["tiers"] == ["memory"]
        assert any(a.startswith("tcp://127.0.0.1:") for a in row.attrs["listeners"])

"""The sidecar acknowledges puts from its local ledger journal (the default): over real
sockets, with Postgres unable to commit, puts are acknowledged and served; once Postgres can,
every event lands and a clean stop leaves the journal empty. With ``ledger.journal`` off, a put
waits for its commit."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from kvgov.config import Settings
from kvgov.db.models import LedgerEvent
from kvgov.proxy.app import Sidecar
from kvgov.types import EventKind
from kvgov.wire import PutAck, RequestContext, WireClient
from kvgov.wire.codec import WireConnectionError
from tests.integration.live import loopback_settings, running_sidecar

pytestmark = pytest.mark.postgres

KEY = "meta-llama/Llama-3.1-8B@1@0@{:016x}@bfloat16@tenant%demo@user%u42"


def settings(tmp: Path, pg_url: str, **ledger: object) -> Settings:
    return loopback_settings(
        tmp / "data", pg_url, lm=True, tiers={"chain": ["memory"]}, ledger=ledger
    )


def puts(sc: Sidecar, n: int, *, first: int = 0, timeout: float = 10.0) -> list[bool]:
    """Put keys ``first .. first+n-1`` (new keys: a live one would be kept, not recorded)."""
    ctx = RequestContext(request_id="req-j", user="u42")
    with WireClient(
        f"tcp://127.0.0.1:{sc.server.tcp_port}", engine_id="vllm-demo-0", timeout=timeout
    ) as client:
        items = [(KEY.format(i), bytes([i]) * 4096) for i in range(first, first + n)]
        return [a.ok for a in client.put_many(items, ctx)]


def get(sc: Sidecar, i: int) -> bytes | None:
    ctx = RequestContext(request_id="req-j", user="u42")
    with WireClient(
        f"tcp://127.0.0.1:{sc.server.tcp_port}", engine_id="vllm-demo-0", timeout=10
    ) as client:
        hit = client.get(KEY.format(i), ctx)
        return None if hit is None else hit[0]


def puts_recorded(sc: Sidecar) -> int:
    with Session(sc.engine) as s:
        return int(
            s.scalar(
                select(func.count())
                .select_from(LedgerEvent)
                .where(LedgerEvent.kind == EventKind.KV_PUT)
            )
            or 0
        )


def hold_chain(pg_url: str, chain_id: str) -> psycopg.Connection[tuple[object, ...]]:
    """A connection holding the chain's lock: the sidecar's writer cannot commit meanwhile."""
    conn = psycopg.connect(pg_url.replace("postgresql+psycopg://", "postgresql://", 1))
    conn.execute("SELECT 1 FROM chains WHERE chain_id = %s FOR UPDATE", (chain_id,))
    return conn


async def test_puts_are_acknowledged_from_the_journal_while_postgres_cannot_commit(
    tmp_path: Path, pg_url: str
) -> None:
    s = settings(tmp_path, pg_url)
    loop = asyncio.get_running_loop()
    async with running_sidecar(s) as sc:
        await loop.run_in_executor(None, lambda: puts(sc, 1, first=100))  # warm: keys, policy
        assert sc.writer is not None
        await sc.writer.flush()
        holder = hold_chain(pg_url, s.chain_id)
        try:
            acks = await loop.run_in_executor(None, puts, sc, 8)
            assert acks == [True] * 8
            assert puts_recorded(sc) == 1  # acknowledged, not yet in Postgres
            assert await loop.run_in_executor(None, get, sc, 5) == bytes([5]) * 4096
            journal = s.journal_path
            assert any(p.stat().st_size > 8 for p in journal.glob("journal-*.log"))
            reg = sc.metrics.registry
            # the eight puts and the get (journaled too, nothing waiting on it)
            assert reg.get_sample_value("kvgov_ledger_journal_unapplied_events") == 9
            assert (reg.get_sample_value("kvgov_ledger_journal_bytes") or 0) > 8
            assert reg.get_sample_value("kvgov_ledger_journal_failures") == 0
            # the warm-up, the eight puts and the get were synced, in at most one sync each
            assert 1 <= (reg.get_sample_value("kvgov_ledger_journal_syncs") or 0) <= 10
            # nothing but this sidecar wrote its chain (tests/security/test_foreign_append.py)
            assert reg.get_sample_value("kvgov_ledger_foreign_appends") == 0
            # and nobody took a key of its own seals (tests/security/test_seal_squatting.py)
            assert reg.get_sample_value("kvgov_ledger_seal_keys_taken") == 0
            assert reg.get_sample_value("kvgov_ledger_seal_failures") == 0
        finally:
            holder.rollback()
            holder.close()
        await sc.writer.flush()
        assert puts_recorded(sc) == 9  # the warm-up's and the eight
    assert list(s.journal_path.glob("journal-*.log")) == []  # a clean stop: all applied


async def test_without_the_journal_a_put_waits_for_its_commit(tmp_path: Path, pg_url: str) -> None:
    s = settings(tmp_path, pg_url, journal=False)
    loop = asyncio.get_running_loop()
    async with running_sidecar(s) as sc:
        await loop.run_in_executor(None, lambda: puts(sc, 1, first=100))
        assert sc.writer is not None and sc.writer.journal is None
        await sc.writer.flush()
        holder = hold_chain(pg_url, s.chain_id)
        try:
            with pytest.raises(WireConnectionError, match="timed out"):  # no ack meanwhile
                await loop.run_in_executor(None, lambda: puts(sc, 1, timeout=1.0))
        finally:
            holder.rollback()
            holder.close()
        await sc.writer.flush()
    assert not s.journal_path.exists()


def stream(sc: Sidecar, n: int, *, first: int, depth: int) -> list[bool]:
    """Put keys ``first .. first+n-1``, 1 MiB each, one PUT frame each, ``depth`` in flight
    (each frame takes longer to arrive than a sync: without ``more`` each would get its own)."""
    ctx = RequestContext(request_id="req-j", user="u42")
    with WireClient(
        f"tcp://127.0.0.1:{sc.server.tcp_port}", engine_id="vllm-demo-0", timeout=30
    ) as client:
        items = ((KEY.format(i), bytes([i % 256]) * (1 << 20)) for i in range(first, first + n))
        return [a.ok for a in client.put_stream(items, ctx, depth=depth)]


async def test_a_streamed_puts_frames_share_journal_syncs_and_a_lone_put_is_not_held(
    tmp_path: Path, pg_url: str
) -> None:
    """``ledger.journal_sync_interval_ms``: the frames a client streams (``put_stream`` says
    ``more``, but on its last frame) share syncs; a client with one put in flight at a time,
    and a stream's last frame, are synced at once, not held for the interval (1 s here:
    holding three puts would take two seconds)."""
    s = settings(tmp_path, pg_url, journal_sync_interval_ms=1000)
    loop = asyncio.get_running_loop()
    async with running_sidecar(s) as sc:
        assert sc.writer is not None
        reg = sc.metrics.registry

        def syncs() -> float:
            return reg.get_sample_value("kvgov_ledger_journal_syncs") or 0

        await loop.run_in_executor(None, lambda: puts(sc, 1, first=100))  # warm: keys, policy
        before = syncs()
        started = loop.time()
        for i in range(3):  # one at a time: each acknowledged once its own sync is done
            assert await loop.run_in_executor(None, lambda i=i: puts(sc, 1, first=200 + i))
        assert loop.time() - started < 1.5
        assert syncs() - before == 3
        before = syncs()
        acks = await loop.run_in_executor(None, lambda: stream(sc, 16, first=300, depth=8))
        assert acks == [True] * 16
        assert syncs() - before <= 4  # sixteen frames, a few syncs (each holds up to 1 s)
        # a stream's last frame does not say ``more``: its ack is synced at once, not held
        # for the interval behind the frame before it
        started = loop.time()
        acks = await loop.run_in_executor(None, lambda: stream(sc, 2, first=400, depth=8))
        assert acks == [True, True]
        assert loop.time() - started < 0.9


async def test_a_client_that_always_says_more_holds_only_its_own_acks(
    tmp_path: Path, pg_url: str
) -> None:
    """The attack the ``more`` hint invites: a client that streams PUT frames saying ``more``
    without end keeps the journal holding syncs for its puts. Holding is that client's own: a
    sequential client beside it is synced at once (it used to wait up to the interval, 1 s
    here, per put: three puts took 2-3 s), and its syncs take the streamer's puts along."""
    s = settings(tmp_path, pg_url, journal_sync_interval_ms=1000)
    loop = asyncio.get_running_loop()
    stop = threading.Event()
    streamed = threading.Event()

    def frames() -> Iterator[tuple[str, bytes]]:
        for i in range(1000, 1400):  # each frame says more, until the sequential puts are done
            if stop.is_set():
                return
            yield KEY.format(i), bytes([i % 256]) * 4096
            if i == 1002:
                streamed.set()

    def streamer(sc: Sidecar) -> list[PutAck]:
        ctx = RequestContext(request_id="req-s", user="u42")
        with WireClient(
            f"tcp://127.0.0.1:{sc.server.tcp_port}", engine_id="vllm-demo-0", timeout=30
        ) as client:
            return client.put_stream(frames(), ctx, depth=8)

    async with running_sidecar(s) as sc:
        await loop.run_in_executor(None, lambda: puts(sc, 1, first=100))  # warm: keys, policy
        streaming = loop.run_in_executor(None, streamer, sc)
        try:
            assert await loop.run_in_executor(None, streamed.wait, 10)
            started = loop.time()
            for i in range(3):  # one at a time, while the streamer says more
                assert await loop.run_in_executor(None, lambda i=i: puts(sc, 1, first=200 + i))
            assert loop.time() - started < 1.5
        finally:
            stop.set()
            acks = await streaming
        assert len(acks) >= 3 and all(a.ok for a in acks)

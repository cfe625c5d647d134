"""Attack (audit trail, "nothing stored unrecorded"): a tier's eviction of one copy of a put.

Review r18, findings 1-3.

- F1: when a tier evicted one copy of a put, ``upkeep.evicted`` replaced the put's index entry
  with a new object, and ``Pipeline.unstore`` removes a put only while its entry is still its
  own object (a newer put of the key may have replaced it). So a put whose ``kv:put`` then
  failed was not removed: its other copy stayed stored and served, unrecorded, while the
  engine was told the put failed. Now an eviction updates the entry in place, and unstore
  deletes from every tier whatever the entry lists now.
- F2: on the write-through paths that ``gather`` their tiers (a value under 64 KiB, a refused
  memory reservation, ...), a key left the filesystem tier's ``_putting`` a pass of the loop
  before ``store_put`` indexed it: another put's eviction then dropped it with no ``kv:evict``
  (no entry yet), and its ``kv:put`` listed a tier that no longer held it (a phantom). Now an
  eviction of a key being written is noted on its plan and recorded after its ``kv:put``.
- F3: an evicted file whose removal failed survived a restart and was served again, because
  the start's reconcile kept every file with an entry, even one listing only another tier.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from kvgov.connectors.tiers import filesystem as filesystem_module
from kvgov.connectors.tiers.filesystem import FilesystemTier
from kvgov.db.models import CacheEntry, LedgerEvent
from kvgov.errors import LedgerError
from kvgov.ledger.events import Event
from kvgov.proxy.app import Sidecar
from kvgov.types import EventKind
from kvgov.wire import RequestContext, WireClient
from tests.security import doors
from tests.security.doors import key, run

pytestmark = pytest.mark.postgres

ALICE = RequestContext(request_id="r-unstore", tenant="acme", user="alice")
KIB = 1024
MIB = 1024 * KIB


def _client(sc: Sidecar) -> WireClient:
    return WireClient(
        f"tcp://127.0.0.1:{sc.server.tcp_port}", engine_id="x", token="tok-acme", timeout=10
    )


def _fs(sc: Sidecar) -> FilesystemTier:
    fs = sc.pipeline.tiers.tier("filesystem")
    assert isinstance(fs, FilesystemTier)
    return fs


def _evictions(sc: Sidecar, digest: str, tier: str) -> list[LedgerEvent]:
    return [
        e for e in doors.events(sc, EventKind.KV_EVICT) if e.key_digest == digest and e.tier == tier
    ]


def _row_tiers(sc: Sidecar, digest: str) -> list[str] | None:
    with Session(sc.engine) as s:
        return s.scalar(select(CacheEntry.tiers).where(CacheEntry.key_digest == digest))


def _hold_put_record(
    sc: Sidecar, monkeypatch: pytest.MonkeyPatch, digest: str
) -> asyncio.Future[Any]:
    """The ``kv:put`` of ``digest`` is queued to a future the test resolves (every other event
    is recorded as usual)."""
    recorder = sc.pipeline.recorder
    real = recorder.queue
    held: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    async def queue(event: Event, *, hold: bool = False) -> Any:
        if event.kind == EventKind.KV_PUT and event.key_digest == digest:
            return held
        return await real(event, hold=hold)

    monkeypatch.setattr(recorder, "queue", queue)
    return held


# -- F1 ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("first", ["filesystem", "memory"])
async def test_a_put_whose_record_fails_after_a_tier_evicted_one_copy_leaves_no_copy(
    tmp_path: Path, prod_db: doors.ProdDatabase, monkeypatch: pytest.MonkeyPatch, first: str
) -> None:
    # the tier named ``first`` is the small one: the next two puts evict K's copy there
    tiers = {
        "chain": ["memory", "filesystem"],
        "memory_max_bytes": MIB if first == "memory" else 8 * MIB,
        "filesystem_max_bytes": 2 * MIB if first == "filesystem" else 8 * MIB,
    }
    other = "memory" if first == "filesystem" else "filesystem"
    raw_k = key(0x300, "acme", "alice")
    value_k = os.urandom(700 * KIB)  # >= 64 KiB: the memory tier's reserved path
    async with doors.tiered_sidecar(tmp_path, prod_db, tiers) as sc:
        dk = sc.pipeline.pseudonymizer.key_digest(raw_k)
        held = _hold_put_record(sc, monkeypatch, dk)
        slow, fast = _client(sc), _client(sc)
        try:
            pending = asyncio.ensure_future(run(slow.put, raw_k, value_k, ALICE))
            assert await doors.until(lambda: sc.pipeline.index.get(dk) is not None, 10)
            for i in range(2):  # recorded as usual: K is the least recently used
                raw = key(0x310 + i, "acme", "alice")
                assert (await run(fast.put, raw, os.urandom(700 * KIB), ALICE)).ok
            entry = sc.pipeline.index.get(dk)
            assert entry is not None and entry.tiers == (other,), entry
            assert await sc.pipeline.tiers.where(dk) == [other]
            # K's record fails: the engine is told the put failed
            held.set_exception(LedgerError("the ledger refused the put's record"))
            ack = await pending
            assert not ack.ok
            assert sc.pipeline.index.get(dk) is None and not await sc.pipeline.tiers.contains(dk), (
                f"an unrecorded put stays stored ({other}) after the {first} tier evicted its"
                " other copy: unstore compared a replaced index entry"
            )
            assert doors.value_of(await run(fast.get, raw_k, ALICE)) is None
        finally:
            slow.close()
            fast.close()


async def test_a_failed_record_leaves_a_newer_put_of_its_key_in_place(
    tmp_path: Path, prod_db: doors.ProdDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What unstore's identity test is for: K removed and put again (recorded) while its first
    put's record is pending; that record then fails. The tiers hold the newer put's bytes,
    which stay stored and served."""
    raw_k = key(0x320, "acme", "alice")
    first, newer = os.urandom(700 * KIB), os.urandom(700 * KIB)
    async with doors.tiered_sidecar(tmp_path, prod_db, {"chain": ["memory", "filesystem"]}) as sc:
        dk = sc.pipeline.pseudonymizer.key_digest(raw_k)
        held = _hold_put_record(sc, monkeypatch, dk)
        slow, fast = _client(sc), _client(sc)
        try:
            pending = asyncio.ensure_future(run(slow.put, raw_k, first, ALICE))
            assert await doors.until(lambda: sc.pipeline.index.get(dk) is not None, 10)
            assert await run(fast.remove, raw_k, ALICE)
            assert sc.pipeline.index.get(dk) is None
            monkeypatch.undo()  # the newer put is recorded as usual
            assert (await run(fast.put, raw_k, newer, ALICE)).ok
            entry = sc.pipeline.index.get(dk)
            held.set_exception(LedgerError("the ledger refused the put's record"))
            assert not (await pending).ok
            assert sc.pipeline.index.get(dk) is entry
            assert await sc.pipeline.tiers.where(dk) == ["memory", "filesystem"]
            assert doors.value_of(await run(fast.get, raw_k, ALICE)) == newer
        finally:
            slow.close()
            fast.close()


# -- F2 ----------------------------------------------------------------------------------------


async def test_an_eviction_between_a_puts_write_and_its_index_is_recorded(
    tmp_path: Path, prod_db: doors.ProdDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    tiers = {"chain": ["memory", "filesystem"], "filesystem_max_bytes": MIB}
    raw_k = key(0x400, "acme", "alice")
    value_k = os.urandom(40 * KIB)  # under 64 KiB: no reservation, the tiers are gathered
    other = "ee" * 32
    async with doors.tiered_sidecar(tmp_path, prod_db, tiers) as sc:
        fs = _fs(sc)
        dk = sc.pipeline.pseudonymizer.key_digest(raw_k)
        real_put = fs.put
        fired: list[asyncio.Task[None]] = []

        async def put(k: str, data: Any, *, expires_at: float | None = None) -> None:
            await real_put(k, data, expires_at=expires_at)
            if k == dk and not fired:
                # K left the tier's ``_putting``; this put's first step (its ``_make_room``,
                # which must evict K) runs before the gather wakes ``store_put``
                fired.append(
                    asyncio.get_running_loop().create_task(real_put(other, os.urandom(1010 * KIB)))
                )

        monkeypatch.setattr(fs, "put", put)
        c = _client(sc)
        try:
            assert (await run(c.put, raw_k, value_k, ALICE)).ok
            assert fired, "the filesystem tier was not part of K's write-through"
            await fired[0]
            assert not fs.path_of(dk).exists()
            entry = sc.pipeline.index.get(dk)
            assert entry is not None
            assert "filesystem" not in entry.tiers, (
                "the filesystem copy of K was evicted before its entry was indexed: the"
                " index says it is stored in filesystem, the file is gone, and no kv:evict"
                " was recorded"
            )
            assert await doors.until(lambda: bool(_evictions(sc, dk, "filesystem")), 10), (
                "K's filesystem copy was evicted with no kv:evict recorded"
            )
            assert await doors.until(lambda: _row_tiers(sc, dk) == ["memory"], 10), _row_tiers(
                sc, dk
            )
            # a re-put is kept (live in memory) and a get is a hit
            assert (await run(c.put, raw_k, value_k, ALICE)).ok
            assert doors.value_of(await run(c.get, raw_k, ALICE)) == value_k
        finally:
            c.close()


# -- F3 ----------------------------------------------------------------------------------------


async def test_a_restart_removes_an_evicted_file_whose_removal_failed(
    tmp_path: Path, prod_db: doors.ProdDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    tiers = {"chain": ["memory", "filesystem"], "filesystem_max_bytes": 2 * MIB}
    raw_k = key(0x500, "acme", "alice")
    value_k = os.urandom(700 * KIB)
    async with doors.tiered_sidecar(tmp_path, prod_db, tiers) as sc:
        fs = _fs(sc)
        dk = sc.pipeline.pseudonymizer.key_digest(raw_k)
        real_unlink = os.unlink

        def unlink(path: Any, *args: Any, **kwargs: Any) -> None:
            if dk in os.fspath(path):
                raise PermissionError(13, "Permission denied")
            real_unlink(path, *args, **kwargs)

        monkeypatch.setattr(filesystem_module.os, "unlink", unlink)
        c = _client(sc)
        try:
            assert (await run(c.put, raw_k, value_k, ALICE)).ok
            for i in range(2):
                assert (
                    await run(c.put, key(0x510 + i, "acme", "alice"), os.urandom(700 * KIB), ALICE)
                ).ok
        finally:
            c.close()
        entry = sc.pipeline.index.get(dk)
        assert entry is not None and entry.tiers == ("memory",)
        assert await doors.until(lambda: bool(_evictions(sc, dk, "filesystem")), 10)
        assert fs.path_of(dk).exists()  # the removal failed
        monkeypatch.undo()
    async with doors.tiered_sidecar(tmp_path, prod_db, tiers) as sc:
        fs = _fs(sc)
        entry = sc.pipeline.index.get(dk)
        assert entry is not None and entry.tiers == ("memory",)  # live, in memory (now empty)
        assert not fs.path_of(dk).exists(), (
            "an evicted file whose removal failed was kept by the restart's reconcile (the"
            " entry still lists memory) and is served again"
        )
        orphans = [
            e
            for e in doors.events(sc, EventKind.KV_DELETE)
            if e.key_digest == dk and e.reason == "orphan" and e.tier == "filesystem"
        ]
        assert len(orphans) == 1
        c = _client(sc)
        try:
            assert doors.value_of(await run(c.get, raw_k, ALICE)) is None
        finally:
            c.close()

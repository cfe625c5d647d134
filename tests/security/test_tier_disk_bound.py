"""Attack (availability, audit trail): a tenant's unique prompts fill the filesystem tier's disk.

Review r16, finding 1. The filesystem tier wrote every put it was given and dropped entries only
at their TTL (6 h for the default class). It lived on the pod's ``state`` emptyDir beside the
ledger journal, so a few 100k-token prompts of unique text (or ordinary traffic, at 128 KiB of
KV per token) passed the volume's ``sizeLimit``: the kubelet evicts the pod with a 0-1 s grace
period, taking vLLM mid-request, the journal's acknowledged-but-uncommitted events and the
chain's final checkpoint with it (``audit verify`` then fails ``stale_unsigned`` for good).

Now ``tiers.filesystem_max_bytes`` bounds the tier (production refuses a chain with
``filesystem`` without it): before a write would pass it, the tier evicts its least recently
used entries, each recorded as ``kv:evict`` (tier ``filesystem``) exactly as the memory tier's
are; a value larger than the bound is refused; a restart counts what it finds on disk. The
manifests give the tier its own emptyDir (``test_deploy_doors.py``).
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Any

import pytest

from kvgov.config import TierSettings
from kvgov.connectors.tiers.chain import TierChain
from kvgov.connectors.tiers.filesystem import FilesystemTier
from kvgov.connectors.tiers.memory import MemoryTier
from kvgov.db.models import LedgerEvent
from kvgov.errors import TierError
from kvgov.proxy.app import Sidecar
from kvgov.types import EntryState, EventKind
from kvgov.wire import RequestContext, WireClient
from tests.security import doors
from tests.security.doors import key, run

UNBOUNDED = (
    "the filesystem tier on the 20Gi state emptyDir has no size bound: a tenant's unique"
    " prompts fill it and the kubelet evicts the pod (0-1 s grace), taking the journal with it"
)

ALICE = RequestContext(request_id="r-disk", tenant="acme", user="alice")
KIB = 1024
MIB = 1024 * KIB


def on_disk(root: Path) -> tuple[int, int]:
    """The tier's files under ``root``: their sizes, and the blocks they take (what the
    kubelet's ``du`` of an emptyDir counts)."""
    files = [p for p in root.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files), sum(p.stat().st_blocks * 512 for p in files)


async def bounded(root: Path, max_bytes: int, evicted: list[tuple[str, str, int]]) -> Any:
    """A filesystem tier bounded to ``max_bytes`` reporting its evictions into ``evicted``."""
    params = inspect.signature(FilesystemTier.open).parameters
    if "max_bytes" not in params or "on_evict" not in params:
        pytest.fail(UNBOUNDED)
    return await FilesystemTier.open(
        root,
        fsync=False,
        max_bytes=max_bytes,
        on_evict=lambda *ev: evicted.append(ev),
    )


# -- the tier ---------------------------------------------------------------------------------


async def test_puts_past_the_bound_evict_the_least_recently_used_and_report_each(
    tmp_path: Path,
) -> None:
    root = tmp_path / "fs"
    evicted: list[tuple[str, str, int]] = []
    bound = 4 * MIB
    tier = await bounded(root, bound, evicted)
    values = {f"{i:02x}" * 32: os.urandom(512 * KIB + i) for i in range(16)}
    keys = list(values)
    try:
        for i, (k, v) in enumerate(values.items()):
            await tier.put(k, v)
            if i:  # a read after each put keeps the first key among the most recently used
                assert await tier.get(keys[0]) == values[keys[0]]
        size, blocks = on_disk(root)
        assert size <= bound and blocks <= bound, (size, blocks)
        assert size <= tier.used_bytes <= bound
        gone = [k for _, k, _ in evicted]
        assert evicted and all(name == "filesystem" for name, _, _ in evicted)
        assert [n for _, _, n in evicted] == [len(values[k]) for k in gone]
        # least recently used first: the one read early outlived its neighbours
        assert keys[0] not in gone
        assert gone == [k for k in keys[1:] if k in gone]
        assert gone[0] == keys[1]
        kept = [k for k in keys if k not in gone]
        for k in gone:
            assert not tier.path_of(k).exists(), "an evicted value is still on disk"
            assert not await tier.contains(k)
            assert await tier.get(k) is None
        for k in kept:
            assert await tier.get(k) == values[k], "a kept value changed"
        stats = await tier.stats()
        assert stats.evictions == len(gone)
        assert stats.entries == len(kept)
        assert stats.capacity_bytes == bound
        counted = tier.used_bytes
    finally:
        await tier.close()

    # a restart counts what is on disk: the next puts still keep within the bound
    again = await bounded(root, bound, evicted)
    try:
        assert again.used_bytes == counted
        before = len(evicted)
        for i in range(8):
            await again.put(f"{0x80 + i:02x}" * 32, os.urandom(512 * KIB))
        size, blocks = on_disk(root)
        assert size <= bound and blocks <= bound, (size, blocks)
        assert len(evicted) - before >= 8 - 1
    finally:
        await again.close()


async def test_a_tier_found_over_its_bound_is_brought_within_it_by_the_next_put(
    tmp_path: Path,
) -> None:
    """A smaller bound than what is on disk (the setting lowered across a container restart):
    the next put evicts, and reports, down to the bound."""
    root = tmp_path / "fs"
    evicted: list[tuple[str, str, int]] = []
    tier = await bounded(root, 16 * MIB, evicted)
    for i in range(12):
        await tier.put(f"{i:02x}" * 32, os.urandom(MIB))
    await tier.close()
    assert evicted == []
    small = await bounded(root, 4 * MIB, evicted)
    try:
        assert small.used_bytes > 4 * MIB
        await small.put("ff" * 32, os.urandom(MIB))
        size, _ = on_disk(root)
        assert size <= small.used_bytes <= 4 * MIB
        assert len(evicted) >= 12 - 3
        for _, k, _ in evicted:
            assert not small.path_of(k).exists()
    finally:
        await small.close()


async def test_a_value_larger_than_the_bound_is_refused_and_stored_nowhere(
    tmp_path: Path,
) -> None:
    """The chain treats a tier's refusal as the put's: it is removed from every tier and
    raised (nothing stored that the ledger will not record), and nothing was evicted for it."""
    evicted: list[tuple[str, str, int]] = []
    fs = await bounded(tmp_path / "fs", 2 * MIB, evicted)
    chain = TierChain([MemoryTier(8 * MIB), fs])
    try:
        small = "aa" * 32
        await chain.put(small, os.urandom(MIB), allowed={"memory", "filesystem"})
        big = "bb" * 32
        with pytest.raises(TierError) as err:
            await chain.put(big, os.urandom(3 * MIB), allowed={"memory", "filesystem"})
        assert "filesystem" in str(err.value)
        cause = err.value.__cause__
        assert isinstance(cause, TierError) and "tiers.filesystem_max_bytes" in str(cause.hint)
        assert await chain.where(big) == []
        assert await chain.where(small) == ["memory", "filesystem"]
        assert evicted == []
        with pytest.raises(TierError, match="exceeds"):
            await fs.put(big, os.urandom(3 * MIB))
        assert not fs.path_of(big).exists()
    finally:
        await chain.close()


# -- the sidecar: a tenant's puts through the engine ----------------------------------------


def _fs_evictions(sc: Sidecar) -> list[LedgerEvent]:
    return [e for e in doors.events(sc, EventKind.KV_EVICT) if e.tier == "filesystem"]


async def _put_all(sc: Sidecar, values: dict[str, bytes]) -> None:
    c = WireClient(
        f"tcp://127.0.0.1:{sc.server.tcp_port}", engine_id="x", token="tok-acme", timeout=10
    )
    try:
        for raw, value in values.items():
            assert (await run(c.put, raw, value, ALICE)).ok
    finally:
        c.close()


@pytest.mark.postgres
async def test_a_tenants_unique_prompts_cannot_fill_the_tiers_volume(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    assert "filesystem_max_bytes" in TierSettings.model_fields, UNBOUNDED
    # the least bound the settings allow (review r18, finding 4): twice the smallest pool,
    # and the largest frame
    bound = 16 * MIB
    small = doors.known_dataplane(buffer_pool_bytes=8 * MIB, max_frame_bytes=16 * MIB)
    tiers = {
        "chain": ["memory", "filesystem"],
        "memory_max_bytes": MIB,
        "filesystem_max_bytes": bound,
    }
    values = {key(0x100 + i, "acme", "alice"): os.urandom(512 * KIB) for i in range(40)}
    async with doors.tiered_sidecar(tmp_path, prod_db, tiers, **small) as sc:
        await _put_all(sc, values)
        fs = sc.pipeline.tiers.tier("filesystem")
        assert isinstance(fs, FilesystemTier)
        root = sc.settings.filesystem_tier_path
        size, blocks = on_disk(root)
        assert size <= bound and blocks <= bound, f"{size} bytes on disk past a {bound} bound"
        digest = sc.pipeline.pseudonymizer.key_digest
        digests = {digest(raw): raw for raw in values}
        held = {d for d in digests if await fs.contains(d)}
        assert 0 < len(held) < len(digests)
        # each eviction is recorded, as the memory tier's are: kv:evict, tier filesystem
        assert await doors.until(lambda: len(_fs_evictions(sc)) >= len(digests) - len(held), 10)
        recorded = _fs_evictions(sc)
        gone = {e.key_digest for e in recorded}
        assert len(recorded) == len(gone) == len(digests) - len(held)
        assert gone == set(digests) - held
        assert all(e.tenant == "acme" and e.reason == "capacity" for e in recorded)
        for d in gone:
            assert not fs.path_of(d).exists(), "an evicted value is still on disk"
            # evicted from both tiers (the memory tier holds one value): the entry is gone
            in_memory = await sc.pipeline.tiers.tier("memory").contains(d)
            assert doors.entry_state(sc, d) == (
                EntryState.LIVE if in_memory else EntryState.DELETED
            )
        c = WireClient(
            f"tcp://127.0.0.1:{sc.server.tcp_port}", engine_id="x", token="tok-acme", timeout=10
        )
        try:  # what the tier kept round-trips byte for byte; an evicted one is a miss
            for d in held:
                got = await run(c.get, digests[d], ALICE)
                assert doors.value_of(got) == values[digests[d]]
            for d in gone:
                in_memory = await sc.pipeline.tiers.tier("memory").contains(d)
                got = await run(c.get, digests[d], ALICE)
                assert doors.value_of(got) == (values[digests[d]] if in_memory else None)
        finally:
            c.close()
        counted = fs.used_bytes
        # the tier's bytes and bound are in /metrics
        registry = sc.metrics.registry
        sample = registry.get_sample_value
        assert sample("kvgov_tier_bytes", {"tier": "filesystem"}) == counted
        assert sample("kvgov_tier_capacity_bytes", {"tier": "filesystem"}) == bound
        assert sample("kvgov_tier_capacity_bytes", {"tier": "memory"}) == MIB
    # a restart counts what it finds on disk: more puts keep the bound
    more = {key(0x200 + i, "acme", "alice"): os.urandom(512 * KIB) for i in range(8)}
    async with doors.tiered_sidecar(tmp_path, prod_db, tiers, **small) as sc:
        fs = sc.pipeline.tiers.tier("filesystem")
        assert isinstance(fs, FilesystemTier)
        assert fs.used_bytes == counted
        before = len(_fs_evictions(sc))
        await _put_all(sc, more)
        size, blocks = on_disk(sc.settings.filesystem_tier_path)
        assert size <= bound and blocks <= bound, f"{size} bytes on disk past a {bound} bound"
        assert await doors.until(lambda: len(_fs_evictions(sc)) >= before + len(more) - 1, 10)

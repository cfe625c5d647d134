"""The entry index's upkeep between operations: entries past their TTL (:func:`expired`,
:func:`sweep`: the sidecar's sweeper), a tier's capacity eviction (:func:`evicted`: the
tiers' ``on_evict`` hook, through ``Pipeline.tier_evicted``) and, at start, the values a local
tier holds that no live entry names (:func:`reconcile`). No operation's flow calls it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from kvgov.connectors.tiers.chain import TierChain
from kvgov.db.models import CacheEntry
from kvgov.ledger.events import Event
from kvgov.proxy.dataplane.index import EntryIndex
from kvgov.proxy.dataplane.records import (
    LedgerEntry,
    Recorder,
    evict_event,
    orphan_event,
    orphans_event,
)


async def expired(index: EntryIndex, tiers: TierChain, now: float) -> list[tuple[str, str | None]]:
    """The entries past their TTL that this process knows of (its index, and what its tiers
    just dropped themselves), with their tenants: the retention sweeper deletes, verifies
    and records them through the one deletion path."""
    digests = set(index.expired(now))
    digests.update(await tiers.sweep(now))
    out = []
    for digest in sorted(digests):
        entry = index.get(digest)
        out.append((digest, entry.tenant if entry is not None else None))
    return out


#: tiers whose values only this sidecar writes (a Redis may be shared with other sidecars)
LOCAL_TIERS = frozenset({"filesystem"})


#: orphans deleted (and recorded) per step: one ledger lookup, then one group commit
RECONCILE_CHUNK = 1_000
#: orphans recorded one event each, per tier; the rest are counted in one summary event
RECONCILE_RECORDED_MAX = 10_000

#: what the ledger's entry index says of some key digests (blocking: run in a thread)
Lookup = Callable[[Sequence[str]], Mapping[str, LedgerEntry]]


async def reconcile(
    index: EntryIndex,
    tiers: TierChain,
    recorder: Recorder | None = None,
    *,
    lookup: Lookup | None = None,
    principal: str | None = None,
) -> dict[str, int]:
    """At start, once the index holds every live entry the ledger knows: delete what a local
    tier holds that no live entry names, and return how many per tier. A purge or deletion
    made while this sidecar was down went to the sidecars alive then, so the values it erased
    stayed on this disk, where nothing would serve, expire or delete them (and, under a key
    not shredded, they stay readable to whoever reads the disk).

    With a ``recorder``, each deletion is recorded (``kv:delete``, reason ``orphan``, the
    tier, the value's size, the tenant and entry state the ledger's row gives, from
    ``lookup``) and durable before this returns: in steps of :data:`RECONCILE_CHUNK` (deleted,
    then recorded), one event per orphan up to :data:`RECONCILE_RECORDED_MAX` per tier, then
    one summary event counting the rest. No entry-index change: see :func:`orphan_event`."""
    removed: dict[str, int] = {}
    for name in tiers.names:
        if name not in LOCAL_TIERS:
            continue
        tier = tiers.tier(name)
        orphans = [key async for key in tier.iter_keys() if index.get(key) is None]
        unlisted = unlisted_bytes = 0
        listed = RECONCILE_RECORDED_MAX if recorder is not None else 0
        for start in range(0, len(orphans), RECONCILE_CHUNK):
            chunk = orphans[start : start + RECONCILE_CHUNK]
            known: Mapping[str, LedgerEntry] = {}
            if lookup is not None and start < listed:
                known = await asyncio.to_thread(lookup, chunk[: listed - start])
            events: list[Event] = []
            try:
                for i, key in enumerate(chunk, start):
                    info = await tier.info(key)
                    held = await tier.delete(key)
                    size = info.size if info is not None else None
                    if i < listed:
                        events.append(
                            orphan_event(
                                key, name, size, known.get(key), removed=held, principal=principal
                            )
                        )
                    else:
                        unlisted += 1
                        unlisted_bytes += size or 0
            finally:  # a tier that fails part-way (start-up stops): record what went before
                if recorder is not None and events:
                    await recorder.record_all(events)
        if recorder is not None and unlisted:
            await recorder.record_all([orphans_event(name, unlisted, unlisted_bytes, principal)])
        if orphans:
            removed[name] = len(orphans)
    return removed


def ledger_entries(engine: Engine, digests: Sequence[str]) -> dict[str, LedgerEntry]:
    """The ledger's entry-index rows of ``digests`` (tenant, state), for those it has."""
    with Session(engine) as session:
        rows = session.execute(
            select(CacheEntry.key_digest, CacheEntry.tenant, CacheEntry.state).where(
                CacheEntry.key_digest.in_(list(digests))
            )
        ).all()
    return {digest: LedgerEntry(tenant, state) for digest, tenant, state in rows}


async def sweep(index: EntryIndex, tiers: TierChain, now: float) -> int:
    """Without a ledger (benchmarks): drop what is past its TTL, unrecorded."""
    due = await expired(index, tiers, now)
    for digest, _ in due:
        index.pop(digest)
        await tiers.delete(digest)
    return len(due)


def evicted(index: EntryIndex, tier: str, digest: str) -> Event | None:
    """``tier`` dropped ``digest`` to make room: the entry's index row lists the tiers that
    still hold it (none: it leaves the index); returns the ``kv:evict`` to record (None: the
    index knew no such copy)."""
    entry = index.get(digest)
    if entry is None or tier not in entry.tiers:
        return None
    remaining = tuple(t for t in entry.tiers if t != tier)
    if remaining:
        index.set(digest, replace(entry, tiers=remaining))
    else:
        index.pop(digest)
    return evict_event(digest, entry, tier, remaining)

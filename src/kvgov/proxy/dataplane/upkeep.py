"""The entry index's upkeep between operations: entries past their TTL (:func:`expired`,
:func:`sweep`: the sidecar's sweeper) and a tier's capacity eviction (:func:`evicted`: the
tiers' ``on_evict`` hook, through ``Pipeline.tier_evicted``). No operation's flow calls it.
"""

from __future__ import annotations

from dataclasses import replace

from kvgov.connectors.tiers.chain import TierChain
from kvgov.ledger.events import Event
from kvgov.proxy.dataplane.index import EntryIndex
from kvgov.proxy.dataplane.records import evict_event


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


async def reconcile(index: EntryIndex, tiers: TierChain) -> dict[str, int]:
    """At start, once the index holds every live entry the ledger knows: delete what a local
    tier holds that no live entry names, and return how many per tier. A purge or deletion
    made while this sidecar was down went to the sidecars alive then, so the values it erased
    stayed on this disk, where nothing would serve, expire or delete them (and, under a key
    not shredded, they stay readable to whoever reads the disk)."""
    removed: dict[str, int] = {}
    for name in tiers.names:
        if name not in LOCAL_TIERS:
            continue
        tier = tiers.tier(name)
        orphans = [key async for key in tier.iter_keys() if index.get(key) is None]
        for key in orphans:
            await tier.delete(key)
        if orphans:
            removed[name] = len(orphans)
    return removed


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

"""The entry index's upkeep between operations: entries past their TTL (:func:`expired`,
:func:`sweep`: the sidecar's sweeper), a tier's capacity eviction (:func:`evicted`: the
tiers' ``on_evict`` hook, through ``Pipeline.tier_evicted``) and, at start, the values a tier
holds that no live entry names (:func:`reconcile`: a local tier's, and a shared tier's that
have gone untouched for a while; a shared tier's again every interval while the sidecar runs:
:func:`reconcile_shared_every`). No operation's flow calls it.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from kvgov.connectors.tiers.base import Tier
from kvgov.connectors.tiers.chain import TierChain
from kvgov.db.models import CacheEntry
from kvgov.ledger.events import Event
from kvgov.logging import get_logger
from kvgov.proxy.dataplane.index import EntryIndex
from kvgov.proxy.dataplane.metrics import DataPlaneMetrics
from kvgov.proxy.dataplane.records import (
    LedgerEntry,
    Recorder,
    evict_event,
    orphan_event,
    orphans_event,
)
from kvgov.types import EntryState
from kvgov.wire.digest import is_digest

if TYPE_CHECKING:
    from kvgov.connectors.tiers.redis import IdleDeletion

log = get_logger(__name__)


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

#: a value in a shared tier is taken for an orphan only once nothing wrote or read it for this
#: long (seconds): a put writes its tiers before its ledger row commits (its journal, then the
#: writer's batch: normally well within a second, longer while the database is slow or
#: away), so a younger value that no live row names may be another sidecar's put in
#: progress. An orphan touched more recently than this stays until a later pass (the next
#: start, or the next ``tiers.shared_reconcile_interval_s`` while running) or its TTL; a
#: put whose row takes longer to commit may lose its Redis copy (a miss, as if Redis had
#: evicted it: the entry is recomputable).
SHARED_ORPHAN_MIN_IDLE_S = 600

#: orphans deleted (and recorded) per step: one ledger lookup, then one group commit
RECONCILE_CHUNK = 1_000
#: orphans recorded one event each, per tier; the rest are counted in one summary event
RECONCILE_RECORDED_MAX = 10_000

#: what the ledger's entry index says of some key digests (blocking: run in a thread)
Lookup = Callable[[Sequence[str]], Mapping[str, LedgerEntry]]


@runtime_checkable
class IdleDeleting(Protocol):
    """A tier several sidecars share that can delete a value only if nothing wrote or read it
    for a while, checked and deleted atomically (:meth:`RedisTier.delete_idle
    <kvgov.connectors.tiers.redis.RedisTier.delete_idle>`)."""

    def iter_keys(self) -> AsyncIterator[str]: ...

    async def delete_idle(self, keys: Sequence[str], min_idle_s: int) -> IdleDeletion: ...


async def reconcile(
    index: EntryIndex,
    tiers: TierChain,
    recorder: Recorder | None = None,
    *,
    lookup: Lookup | None = None,
    principal: str | None = None,
) -> dict[str, int]:
    """At start, once the index holds every live entry the ledger knows: delete what a tier
    holds that no live entry names, and return how many per tier. A purge or deletion made
    while this sidecar was down went to the sidecars alive then, so the values it erased
    stayed on this disk, where nothing would serve, expire or delete them (and, under a key
    not shredded, they stay readable to whoever reads the disk); a purge that no sidecar
    sharing a Redis was alive for (or whose deletion failed there) left them in Redis.

    A local tier (:data:`LOCAL_TIERS`): every value no live entry lists in that tier (none
    names it, or its entry lives elsewhere: an evicted file that stayed, :func:`_lists`). A
    shared tier (:class:`IdleDeleting`, needs ``lookup``): see :func:`_reconcile_shared`.

    With a ``recorder``, each deletion is recorded (``kv:delete``, reason ``orphan``, the
    tier, the value's size, the tenant and entry state the ledger's row gives, from
    ``lookup``) and durable before this returns: in steps of :data:`RECONCILE_CHUNK` (deleted,
    then recorded), one event per orphan up to :data:`RECONCILE_RECORDED_MAX` per tier, then
    one summary event counting the rest. No entry-index change: see :func:`orphan_event`."""
    removed: dict[str, int] = {}
    for name in tiers.names:
        tier = tiers.tier(name)
        if name in LOCAL_TIERS:
            count = await _reconcile_local(
                index, tier, name=name, recorder=recorder, lookup=lookup, principal=principal
            )
        elif isinstance(tier, IdleDeleting) and lookup is not None:
            count = await _reconcile_shared(
                index, tier, name=name, recorder=recorder, lookup=lookup, principal=principal
            )
        else:
            continue
        if count:
            removed[name] = count
    return removed


def _lists(index: EntryIndex, key: str, tier: str) -> bool:
    """Whether a live entry says ``tier`` holds ``key``. A file its entry does not list is an
    orphan too: its tier evicted it (``kv:evict`` recorded) but the file stayed (a failed
    unlink, a crash before the removal or before the directory's sync), and it would be
    served again while the entry lives in another tier."""
    entry = index.get(key)
    return entry is not None and tier in entry.tiers


async def _reconcile_local(
    index: EntryIndex,
    tier: Tier,
    *,
    name: str,
    recorder: Recorder | None,
    lookup: Lookup | None,
    principal: str | None,
) -> int:
    orphans = [key async for key in tier.iter_keys() if not _lists(index, key, name)]
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
    return len(orphans)


async def _reconcile_shared(
    index: EntryIndex,
    tier: IdleDeleting,
    *,
    name: str,
    recorder: Recorder | None,
    lookup: Lookup,
    principal: str | None,
) -> int:
    """A tier other sidecars write too (Redis): what the index does not name may be theirs,
    put after this sidecar loaded its index, or being put now (its value stored, its ledger
    row not committed yet). So a value is deleted only if it is named by a key digest (not
    by something else under the prefix), the ledger (asked now, not at load) has no live row
    for it, and nothing wrote or read it for :data:`SHARED_ORPHAN_MIN_IDLE_S`, the last
    checked atomically with the deletion. Only what was really deleted is recorded (several
    sidecars may reconcile at once). The keys are scanned, looked up and deleted a step at a
    time, never all held at once.

    Safe to run at any time (:func:`reconcile_shared_every`): nothing here relies on the
    index being complete. A pass cancelled part-way (the sidecar stopping) first records what
    it deleted: a step's deletions and their events run to the end, and the summary of the
    unlisted ones is recorded on the way out, as it is when the tier fails part-way."""
    removed = young = unknown = unlisted = unlisted_bytes = 0

    async def step(chunk: list[str]) -> None:
        running = asyncio.ensure_future(look_up_delete_record(chunk))
        try:
            await asyncio.shield(running)
        except asyncio.CancelledError:
            # once deleted, a value's record must follow, and the lookup's thread must give
            # its connection back before the sidecar disposes of its engine: finish the step
            try:
                await running
            except Exception as exc:  # noqa: BLE001 - stopping anyway: say so, then stop
                log.warning(
                    "tiers.reconcile.failed", extra={"tier": name, "error": type(exc).__name__}
                )
            raise

    async def look_up_delete_record(chunk: list[str]) -> None:
        nonlocal removed, young, unknown, unlisted, unlisted_bytes
        known = await asyncio.to_thread(lookup, chunk)
        gone = [key for key in chunk if _not_live(known.get(key))]
        if not gone:
            return
        done = await tier.delete_idle(gone, SHARED_ORPHAN_MIN_IDLE_S)
        young += done.young
        unknown += done.unknown
        events: list[Event] = []
        for key, size in done.removed.items():
            if recorder is not None and removed < RECONCILE_RECORDED_MAX:
                events.append(
                    orphan_event(key, name, size, known.get(key), removed=True, principal=principal)
                )
            else:
                unlisted += 1
                unlisted_bytes += size
            removed += 1
        if recorder is not None and events:
            await recorder.record_all(events)

    chunk: list[str] = []
    try:
        async for key in tier.iter_keys():
            if not is_digest(key) or index.get(key) is not None:
                continue
            chunk.append(key)
            if len(chunk) >= RECONCILE_CHUNK:
                await step(chunk)
                chunk = []
        if chunk:
            await step(chunk)
    finally:  # cancelled or failed part-way: the deletions counted so far are recorded too
        if recorder is not None and unlisted:
            await recorder.record_all([orphans_event(name, unlisted, unlisted_bytes, principal)])
    if young or unknown:
        log.info(
            "tiers.reconcile.kept",
            extra={
                "tier": name,
                "touched_recently": young,
                "idle_time_unknown": unknown,
                "min_idle_s": SHARED_ORPHAN_MIN_IDLE_S,
            },
        )
    return removed


def shared_tiers(tiers: TierChain) -> list[str]:
    """The tiers of ``tiers`` that other sidecars may share (:class:`IdleDeleting`, not in
    :data:`LOCAL_TIERS`): those :func:`reconcile_shared_every` reconciles while running."""
    return [
        name
        for name in tiers.names
        if name not in LOCAL_TIERS and isinstance(tiers.tier(name), IdleDeleting)
    ]


#: each wait between two periodic reconciles is the interval times a factor drawn in
#: ``1 +- RECONCILE_JITTER``: sidecars started together do not all scan Redis at once
RECONCILE_JITTER = 0.1


def jittered(interval_s: float) -> float:
    """``interval_s`` spread by +-:data:`RECONCILE_JITTER` (not a secret: any source will do,
    the system's spares the module-level generator's state)."""
    spread = random.SystemRandom().uniform(-RECONCILE_JITTER, RECONCILE_JITTER)
    return interval_s * (1.0 + spread)


async def reconcile_shared_every(
    interval_s: float,
    index: EntryIndex,
    tiers: TierChain,
    recorder: Recorder,
    *,
    lookup: Lookup,
    principal: str | None,
    metrics: DataPlaneMetrics | None = None,
) -> None:
    """Until cancelled, every ``interval_s`` (jittered, :func:`jittered`), reconcile each
    shared tier (:func:`shared_tiers`) with the ledger as at start (:func:`_reconcile_shared`:
    the same checks, each deletion recorded the same way). The orphans a purge or a deletion
    left in a shared Redis while no sidecar sharing it was alive, or whose deletion there
    failed, go within an interval of idling :data:`SHARED_ORPHAN_MIN_IDLE_S`, not at the next
    start. Passes run one after the other, never two at once; a local tier is left alone (its
    reconcile relies on the index loaded at start). A failing pass (Redis away, the ledger's
    lookup failing) is logged ``tiers.reconcile.failed`` with its error class (never a key)
    and tried again next interval: the loop lives as long as the sidecar."""
    names = shared_tiers(tiers)
    if not names:
        return
    while True:
        await asyncio.sleep(jittered(interval_s))
        for name in names:
            tier = tiers.tier(name)
            if not isinstance(tier, IdleDeleting):  # pragma: no cover - shared_tiers checked
                continue
            try:
                count = await _reconcile_shared(
                    index, tier, name=name, recorder=recorder, lookup=lookup, principal=principal
                )
            except Exception as exc:  # noqa: BLE001 - logged and retried; never ends the loop
                log.warning(
                    "tiers.reconcile.failed", extra={"tier": name, "error": type(exc).__name__}
                )
                if metrics is not None:
                    metrics.reconcile_passes.labels(name, "failed").inc()
                continue
            if metrics is not None:
                metrics.reconcile_passes.labels(name, "ok").inc()
                if count:
                    metrics.orphans_removed.labels(name).inc(count)
            if count:
                log.warning("tiers.reconciled", extra={"removed_not_live": {name: count}})


def _not_live(entry: LedgerEntry | None) -> bool:
    """No live row: purged, deleted, expired, or none at all."""
    return entry is None or entry.state != EntryState.LIVE


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
    remaining = tuple([t for t in entry.tiers if t != tier])
    if remaining:
        # updated in place, never replaced: the entry stays the put's own object, which is how
        # an unrecorded put's removal knows it is still its own (``Pipeline.unstore``)
        entry.tiers = remaining
    else:
        index.pop(digest)
    return evict_event(digest, entry, tier, remaining)

"""What is in flight for one operation: a put being received and sealed (:class:`PutPlan`,
laid out by :func:`lay_out`), a put stored and waiting for its record (:class:`StoredPut`), a
hit ready to stream (:class:`GetPlan`, its stored value opened by :func:`open_value`), and the
thread-pool jobs that seal and open their segments. Used by
:mod:`kvgov.proxy.dataplane.pipeline`, which it never calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvgov.connectors.tiers.base import BorrowedValue, Reserved
from kvgov.keys import sealformat
from kvgov.keys.sealformat import Envelope
from kvgov.policy.interfaces import Decision
from kvgov.proxy.dataplane.buffers import Lease
from kvgov.proxy.dataplane.identity import Who
from kvgov.proxy.dataplane.index import EntryMeta
from kvgov.proxy.dataplane.sealers import Opener, Sealer, SegmentWriter

#: plaintext bytes sealed or opened per thread-pool job: fewer, larger jobs cost the event loop
#: fewer thread hand-offs, while a chunk's first bytes are still processed as the rest streams
JOB_BYTES = 4 << 20
#: with more than two CPUs, chunks this small are still sealed and opened on the event loop
#: (~0.1 ms of AES-GCM per MiB): a thread hand-off, and the loop pass that hears back from it,
#: cost more under load
INLINE_CRYPTO_BYTES = 1 << 20
#: "every size" for :func:`inline_crypto_bytes`
INLINE_ALL = 1 << 62
#: a hit at least this large, opened on the event loop, is opened half there and half in the
#: crypto pool at once (:func:`open_all`)
SPLIT_OPEN_BYTES = 8 << 20


def segments_per_job(segment_size: int) -> int:
    return max(1, JOB_BYTES // max(1, segment_size))


def usable_cpus(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """CPUs this process may use: its affinity, capped by a cgroup v2 CPU quota (a container's
    CPU limit) when there is one."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 1
    try:
        quota, period = (cgroup_root / "cpu.max").read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cpus)


def inline_crypto_bytes(configured: int | None, cpus: int | None = None) -> int:
    """The ``dataplane.inline_crypto_bytes`` in effect: as configured, or, unset, every size on
    two CPUs or fewer (measured on a 2-vCPU machine, both sides interleaved: governed wire puts
    +13-23%, ``lm://`` gets +16-24%) and :data:`INLINE_CRYPTO_BYTES` on more."""
    if configured is not None:
        return configured
    return INLINE_ALL if (cpus if cpus is not None else usable_cpus()) <= 2 else INLINE_CRYPTO_BYTES


@dataclass(slots=True)
class PutPlan:
    """Where one put item's bytes go, and how received segments are sealed.

    Received segments are sealed as they complete: on the event loop for a chunk up to
    ``inline_bytes``, else in the crypto pool, a few per job (:data:`JOB_BYTES`), while the
    next ones arrive; into ``reserved`` (the fastest tier's own buffer, at the same
    offsets: the tier then keeps it, no copy) when the tier set one aside, else in place.
    The first seal also makes the writer (:class:`~kvgov.proxy.dataplane.sealers.SegmentWriter`;
    the windows' offsets depend only on the chunk's geometry, so bytes can land before it
    exists): on the event loop it is kept at once; in the pool the first job resolves
    ``writer_job`` (made with that job), later jobs wait for it there, and the event loop hears
    back only in :meth:`sealed`.
    """

    who: Who
    lease: Lease
    length: int
    item_meta: Mapping[str, Any]
    decision: Decision
    #: makes the writer (:meth:`Sealer.writer`); run by the first seal
    make_writer: Callable[[], SegmentWriter]
    body_offset: int
    #: plaintext receive windows in the buffer, one per segment, in order
    windows: list[memoryview]
    per_job: int = 1
    #: a put this small is sealed on the event loop, each segment as it completes
    inline_bytes: int = INLINE_CRYPTO_BYTES
    #: the writer, for the pool's jobs (made with the first job, which resolves it)
    writer_job: Future[SegmentWriter] | None = None
    pending: list[Future[None]] = field(default_factory=list)
    ready: list[int] = field(default_factory=list)
    #: the first failure of a seal made on the event loop (later segments are not sealed)
    inline_error: Exception | None = None
    writer: SegmentWriter | None = None
    done: bool = False
    #: the fastest tier's buffer the value is written into (None: stored from the lease)
    reserved: Reserved | None = None
    #: told the key's digest once the plan is done with (stored or dropped)
    on_done: Callable[[str], None] | None = None
    #: an erasure of its scope began while it was in flight: never made visible
    #: (:mod:`~kvgov.proxy.dataplane.fences`)
    fenced: bool = False
    #: tiers that dropped the key to make room while this put wrote it, before it was
    #: indexed (None: not writing yet); :meth:`~kvgov.proxy.dataplane.pipeline.Pipeline.store_put`
    #: records each as ``kv:evict`` once its ``kv:put`` is queued
    evicted: list[str] | None = None

    def segment_done(self, index: int, pool: Executor) -> None:
        """Segment ``index`` has fully arrived: seal it, here for a chunk up to
        ``inline_bytes``, else with its neighbours in the pool."""
        if self.length <= self.inline_bytes:  # here, at once: cheaper than a hand-off
            if self.inline_error is None:
                try:
                    writer = self.writer
                    if writer is None:
                        writer = self.writer = self.make_writer()
                    writer.seal_segment(index, self.windows[index])
                except Exception as exc:  # noqa: BLE001 - raised by sealed(), like a job's
                    self.inline_error = exc
            return
        self.ready.append(index)
        if len(self.ready) < self.per_job and index < len(self.windows) - 1:
            return
        windows = [(i, self.windows[i]) for i in self.ready]
        self.ready = []
        job = self.writer_job
        make = None
        if job is None:  # the first job makes the writer
            job = self.writer_job = Future()
            make = self.make_writer
        self.pending.append(pool.submit(_seal, job, make, windows))

    async def sealed(self) -> SegmentWriter:
        """Wait for every submitted job; raises the first failure (once none is running)."""
        if self.pending:
            running = [asyncio.wrap_future(f) for f in self.pending if not f.done()]
            if running:
                await asyncio.wait(running)
            for fut in self.pending:
                fut.result()
        if self.inline_error is not None:
            raise self.inline_error
        if self.writer is None:
            if self.writer_job is None:
                raise RuntimeError("sealed() before any segment was received")
            self.writer = self.writer_job.result()
        return self.writer

    async def discard(self) -> None:
        """Let the pool finish with the buffer, then release it (nothing is stored)."""
        running = [asyncio.wrap_future(f) for f in self.pending if not f.done()]
        if running:
            await asyncio.wait(running)
        for fut in self.pending:
            if not fut.cancelled():
                fut.exception()  # retrieved: a failed seal of a discarded put is not news
        self.abort()

    def abort(self) -> None:
        """Release the buffers (no job may use them any more); an unstored reservation goes
        back to its tier."""
        self.done = True
        if self.on_done is not None:
            self.on_done(self.who.digest)
            self.on_done = None
        if self.reserved is not None:
            self.reserved.cancel()
            self.reserved = None
        self.lease.release()


def lay_out(
    who: Who,
    head: bytes,
    length: int,
    lease: Lease,
    reserved: Reserved | None,
    *,
    sealer: Sealer,
    segment_size: int,
    scope_user: str | None,
) -> tuple[Callable[[], SegmentWriter], list[memoryview]]:
    """Where a put's bytes go: its envelope ``head`` written into ``lease`` (and ``reserved``),
    the plaintext receive windows (:meth:`Sealer.windows`), and what makes its writer (which
    writes into ``reserved`` when the tier set a buffer aside, else in place)."""
    view = lease.view
    view[: len(head)] = head
    body = view[len(head) :]
    dst = body
    if reserved is not None:
        reserved.view[: len(head)] = head
        dst = reserved.view[len(head) :]

    def make_writer() -> SegmentWriter:
        return sealer.writer(
            who,
            length,
            body,
            dst,
            segment_size=segment_size,
            scope_user=scope_user,
            context=head,
        )

    return make_writer, sealer.windows(body, length, segment_size)


def _seal(
    job: Future[SegmentWriter],
    make: Callable[[], SegmentWriter] | None,
    windows: list[tuple[int, memoryview]],
) -> None:
    """A pool job: (make the writer, then) seal ``windows``."""
    if make is not None:
        try:
            job.set_result(make())
        except BaseException as exc:
            job.set_exception(exc)
            raise
    writer = job.result()
    for index, window in windows:
        writer.seal_segment(index, window)


def open_segments(opener: Opener, windows: list[tuple[int, memoryview]]) -> None:
    """A pool job: open ``windows`` of a stored value."""
    for index, window in windows:
        opener.open_segment(index, window)


async def open_value(
    value: memoryview,
    sealer: Sealer,
    who: Who,
    lease: Lease,
    *,
    in_place: bool,
    executor: Executor,
    inline_bytes: int,
    stream: bool = False,
    sealed_with: tuple[str, int] | None = None,
) -> tuple[Envelope, list[memoryview], Opener | None]:
    """A stored value's envelope and its plaintext windows in ``lease`` (``in_place``:
    ``value`` is in the lease already, else it is the tier's own buffer, read under its
    guard), every segment authenticated and opened into its window; raises
    :class:`~kvgov.errors.CorruptValueError` for a value that fails its checks (one sealed
    under another key than ``sealed_with``, the key the entry was put under, too).

    A ``stream`` of more than one segment read from a tier's own buffer is opened as it is
    sent instead: only the first segment here (which checks the key, tenant and envelope
    binding every segment shares), and the opener is returned for the sender, which opens each
    next window while the one before goes out (:class:`GetPlan`). The windows then take turns
    in two segment buffers at the start of the lease: each segment is opened into memory the
    socket has just read from, still in the CPU's cache."""
    envelope = sealformat.parse(value)
    opener = sealer.opener(envelope, who, in_place=in_place, sealed_with=sealed_with)
    windows: list[memoryview] = []
    stream = stream and not in_place and opener.segments > 1
    seg = opener.segment_size
    for i in range(opener.segments):
        start, plen = opener.plain_span(i)
        if stream:  # two segment buffers, in turn
            start = (i & 1) * seg
        if not in_place:  # opened from the tier's buffer into the lease
            windows.append(lease.view[start : start + plen])
        else:  # opened in place in the lease
            off, _ = opener.body_span(i)
            windows.append(envelope.body[off : off + plen])
    if stream:
        opener.open_segment(0, windows[0])
        return envelope, windows, opener
    # every segment authenticated before the hit is announced: a bad one is a miss
    await open_all(opener, windows, opener.plain_len, executor, inline_bytes)
    return envelope, windows, None


async def open_all(
    opener: Opener,
    windows: list[memoryview],
    length: int,
    executor: Executor,
    inline_bytes: int,
) -> None:
    """Open every segment into its window: here up to ``inline_bytes``, else in the crypto
    pool (``executor``), a few segments per job, side by side. A value of
    :data:`SPLIT_OPEN_BYTES` or more opened here is opened half here and half in the pool at
    once. Raises the first failure once no job touches the windows any more (a cancelled
    caller waits for them too)."""
    indexed = list(enumerate(windows))
    if length <= inline_bytes:
        if length < SPLIT_OPEN_BYTES or len(indexed) < 2:
            open_segments(opener, indexed)
            return
        # a large value: the pool opens its second half while this thread opens the first
        # (AES-GCM releases the GIL: two cores, half the wait before the hit is announced)
        half = len(indexed) // 2
        jobs = [executor.submit(open_segments, opener, indexed[half:])]
        try:
            open_segments(opener, indexed[:half])
        except BaseException:
            await settle(jobs)
            raise
    else:
        step = segments_per_job(opener.segment_size)
        jobs = [
            executor.submit(open_segments, opener, indexed[i : i + step])
            for i in range(0, len(indexed), step)
        ]
    await settle(jobs)


async def settle(jobs: list[Future[None]]) -> None:
    """Wait for every job (a cancelled caller waits for those started too); raise the first
    failure."""
    waiting = [asyncio.wrap_future(job) for job in jobs]
    try:
        await asyncio.wait(waiting)
    except asyncio.CancelledError:
        for job in jobs:
            job.cancel()  # those not started yet
        while not all(job.done() for job in jobs):
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait([f for f in waiting if not f.done()])
        raise
    finally:
        for f in waiting:
            if f.done() and not f.cancelled():
                f.exception()  # retrieved: raised below from the job itself
    for job in jobs:
        job.result()


@dataclass(frozen=True, slots=True)
class Kept:
    """A put not stored because its key is live (``reason="live"``) or being stored by another
    put (``"being_stored"``): acknowledged, its bytes read and dropped, nothing rewritten."""

    who: Who
    reason: str


@dataclass(slots=True)
class StoredPut:
    """A put written to its tiers and visible; ``recorded`` resolves when its event is durable
    (None when ungoverned)."""

    digest: str
    entry: EntryMeta
    recorded: Awaitable[Any] | None = None


@dataclass(frozen=True, slots=True)
class Found:
    """A get's first step: a readable entry and the size of its stored value."""

    who: Who
    entry: EntryMeta
    decision: Decision | None
    size: int


@dataclass(slots=True)
class GetPlan:
    """A hit ready to stream: its segments opened and authenticated into their windows in the
    lease (:meth:`~kvgov.proxy.dataplane.pipeline.Pipeline.load`), or, for a hit opened as it
    is sent (``opener`` set), the first one: the sender opens each next window with ``opener``
    while the one before goes out, and sends nothing of a segment that fails
    (:func:`open_value`, :meth:`~kvgov.proxy.dataplane.conn.StreamProtocol.send_plan`).
    :meth:`release` when done with it (after the sender let go of it)."""

    who: Who
    lease: Lease
    length: int
    item_meta: Mapping[str, Any]
    windows: list[memoryview]
    #: the decision that admitted the read (recorded with the ``kv:get`` once it was sent)
    decision: Decision | None = None
    #: opens windows 1.. of a streamed hit, in order, as they are sent (None: all opened)
    opener: Opener | None = None
    #: the tier the value was read from (recorded if a streamed segment fails its checks)
    tier: str | None = None
    #: the tier's buffer a streamed hit is opened from, held until the plan is released
    borrowed: BorrowedValue | None = None

    def release(self) -> None:
        if self.borrowed is not None:
            self.borrowed.release()
            self.borrowed = None
        self.lease.release()

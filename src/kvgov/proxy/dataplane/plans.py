"""What is in flight for one operation: a put being received and sealed (:class:`PutPlan`),
a put stored and waiting for its record (:class:`StoredPut`), a hit ready to stream
(:class:`GetPlan`), and the thread-pool jobs that seal and open their segments. Built by
:class:`~kvgov.proxy.dataplane.pipeline.Pipeline`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any

from kvgov.connectors.tiers.base import BorrowedValue, Reserved
from kvgov.keys.sealed import SealReader, SealWriter
from kvgov.policy.interfaces import Decision
from kvgov.proxy.dataplane.buffers import Lease
from kvgov.proxy.dataplane.identity import Who
from kvgov.proxy.dataplane.index import EntryMeta

#: plaintext bytes sealed or opened per thread-pool job: fewer, larger jobs cost the event loop
#: fewer thread hand-offs, while a chunk's first bytes are still processed as the rest streams
JOB_BYTES = 4 << 20
#: a put this small is sealed on the event loop as its bytes complete (~0.1 ms of AES-GCM per
#: MiB): a thread hand-off, and the loop pass that hears back from it, cost more under load
INLINE_SEAL_BYTES = 1 << 20


def segments_per_job(segment_size: int) -> int:
    return max(1, JOB_BYTES // max(1, segment_size))


@dataclass(slots=True)
class PutPlan:
    """Where one put item's bytes go, and how received segments are sealed.

    Received segments are sealed in the crypto pool, a few per job (:data:`JOB_BYTES`), while
    the next ones arrive: into ``reserved`` (the fastest tier's own buffer, at the same
    offsets: the tier then keeps it, no copy) when the tier set one aside, else in place.
    The first job also makes the :class:`SealWriter` (the windows' offsets depend only on the
    chunk's geometry, so bytes can land before it exists); later jobs wait for it there, and
    the event loop hears back only in :meth:`sealed`.
    """

    who: Who
    lease: Lease
    length: int
    item_meta: Mapping[str, Any]
    decision: Decision | None
    #: makes the writer (None: not sealed); run by the first job, which resolves ``writer_job``
    make_writer: Callable[[], SealWriter] | None
    body_offset: int
    #: plaintext receive windows in the buffer, one per segment, in order
    windows: list[memoryview]
    per_job: int = 1
    writer_job: Future[SealWriter] = field(default_factory=Future)
    pending: list[Future[None]] = field(default_factory=list)
    ready: list[int] = field(default_factory=list)
    writer: SealWriter | None = None
    done: bool = False
    #: the fastest tier's buffer the value is written into (None: stored from the lease)
    reserved: Reserved | None = None

    def segment_done(self, index: int, pool: Executor) -> None:
        """Segment ``index`` has fully arrived: seal it (with its neighbours) in the pool."""
        if self.make_writer is None:
            return
        self.ready.append(index)
        if len(self.ready) < self.per_job and index < len(self.windows) - 1:
            return
        make = self.make_writer if not self.pending else None  # the first job makes it
        windows = [(i, self.windows[i]) for i in self.ready]
        self.ready = []
        if self.length <= INLINE_SEAL_BYTES:  # cheaper here than a hand-off to the pool
            done: Future[None] = Future()
            try:
                _seal(self.writer_job, make, windows)
                done.set_result(None)
            except Exception as exc:  # noqa: BLE001 - raised again by sealed(), like a job's
                done.set_exception(exc)
            self.pending.append(done)
            return
        self.pending.append(pool.submit(_seal, self.writer_job, make, windows))

    async def sealed(self) -> SealWriter | None:
        """Wait for every submitted job; raises the first failure (once none is running)."""
        if self.make_writer is None:
            return None
        running = [asyncio.wrap_future(f) for f in self.pending if not f.done()]
        if running:
            await asyncio.wait(running)
        for fut in self.pending:
            fut.result()
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
        if self.reserved is not None:
            self.reserved.cancel()
            self.reserved = None
        self.lease.release()


def _seal(
    job: Future[SealWriter],
    make: Callable[[], SealWriter] | None,
    windows: list[tuple[int, memoryview]],
) -> None:
    """A pool job: (make the writer, then) seal ``windows`` in place."""
    if make is not None:
        try:
            job.set_result(make())
        except BaseException as exc:
            job.set_exception(exc)
            raise
    writer = job.result()
    for index, window in windows:
        writer.seal_segment(index, window)


def open_segments(reader: SealReader, windows: list[tuple[int, memoryview]]) -> None:
    """A pool job: open ``windows`` of a sealed chunk in place."""
    for index, window in windows:
        reader.open_segment(index, window)


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
    """A hit ready to stream: open its windows (:func:`open_segments`), send them.

    The reader opens each segment from where the sealed value lies (the pooled buffer, or a
    memory tier's own buffer lent under a read guard, ``source``) into its window in the
    lease. :meth:`release` when done with it."""

    who: Who
    lease: Lease
    length: int
    item_meta: Mapping[str, Any]
    reader: SealReader | None
    windows: list[memoryview]
    source: BorrowedValue | None = None

    def release(self) -> None:
        if self.source is not None:
            self.source.release()
            self.source = None
        self.lease.release()

"""What is in flight for one operation: a put being received and sealed (:class:`PutPlan`),
a put stored and waiting for its record (:class:`StoredPut`), a hit ready to stream
(:class:`GetPlan`). Built by :class:`~kvgov.proxy.dataplane.pipeline.Pipeline`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from kvgov.keys.sealed import SealReader, SealWriter
from kvgov.policy.interfaces import Decision
from kvgov.proxy.dataplane.buffers import Lease
from kvgov.proxy.dataplane.identity import Who
from kvgov.proxy.dataplane.index import EntryMeta


@dataclass(slots=True)
class PutPlan:
    """Where one put item's bytes go, and how each received segment is sealed."""

    who: Who
    lease: Lease
    length: int
    item_meta: Mapping[str, Any]
    decision: Decision | None
    writer: SealWriter | None
    body_offset: int
    #: plaintext receive windows in the buffer, one per segment, in order
    windows: list[memoryview]
    pending: list[asyncio.Future[None]] = field(default_factory=list)
    done: bool = False

    def segment_done(self, index: int, loop: asyncio.AbstractEventLoop, pool: Executor) -> None:
        """Segment ``index`` has fully arrived: seal it in place in the thread pool."""
        writer = self.writer
        if writer is not None:
            view = self.windows[index]
            self.pending.append(loop.run_in_executor(pool, writer.seal_segment, index, view))

    def abort(self) -> None:
        self.done = True
        self.lease.release()


@dataclass(slots=True)
class StoredPut:
    """A put written to its tiers and visible; ``recorded`` resolves when its event is durable
    (None when ungoverned)."""

    digest: str
    entry: EntryMeta
    recorded: Awaitable[Any] | None = None


@dataclass(slots=True)
class GetPlan:
    """A hit ready to stream: call :meth:`open_segment` for each window, then send it."""

    who: Who
    lease: Lease
    length: int
    item_meta: Mapping[str, Any]
    reader: SealReader | None
    windows: list[memoryview]

"""Null collaborators of the pipeline, for benchmarks only: what "governance off" means.

The pipeline always asks a policy, seals through a sealer and records to an event sink; a
benchmark that measures what governance costs swaps in these instead (with the
``unsafe-allow-all`` policy, :mod:`kvgov.policy.allow_all`):

* :class:`PlaintextSealer` (``dataplane.sealer = "unsafe-plaintext"``): values are stored as
  they came, in a plaintext envelope; no key, no encryption (a
  :class:`~kvgov.proxy.dataplane.sealers.Sealer` whose writer copies and whose opener copies);
* :class:`NullEventSink` (``dataplane.events = "unsafe-null"``): events go nowhere, at once.

Each is named ``unsafe`` where it is chosen, refused in production
(:meth:`kvgov.config.Settings.production_problems`) and by
:func:`kvgov.proxy.app.build_sidecar` outside development.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from kvgov.connectors.tiers.base import copy_into
from kvgov.errors import ProtocolError
from kvgov.keys.sealed import segment_count
from kvgov.ledger.events import Appended, Event

if TYPE_CHECKING:
    from kvgov.keys.keyring import Keyring
    from kvgov.keys.sealformat import Envelope
    from kvgov.proxy.dataplane.identity import Who
    from kvgov.proxy.dataplane.sealers import Opener, SegmentWriter

__all__ = ["NullEventSink", "PlaintextSealer"]

_NOWHERE = Appended("unsafe-null", 0)


class _PlainWriter:
    """ "Seals" a plaintext put: copies each received segment to ``dst`` when that is not
    where it was received (the tier's own buffer), else nothing."""

    __slots__ = ("_copy", "_dst", "_segment_size", "sealed_len")

    key = None

    def __init__(self, length: int, body: memoryview, dst: memoryview, segment_size: int) -> None:
        self.sealed_len = length
        self._dst = dst
        self._copy = dst is not body
        self._segment_size = segment_size

    def seal_segment(self, index: int, src: memoryview) -> None:
        if self._copy:
            start = index * self._segment_size
            copy_into(self._dst[start : start + len(src)], src)


class _PlainOpener:
    """ "Opens" a plaintext body: one segment, copied into the hit's buffer unless it is
    there already."""

    __slots__ = ("_body", "_in_place")

    def __init__(self, body: memoryview, *, in_place: bool) -> None:
        self._body = body
        self._in_place = in_place

    @property
    def plain_len(self) -> int:
        return len(self._body)

    @property
    def segment_size(self) -> int:
        return max(1, len(self._body))

    @property
    def segments(self) -> int:
        return 1

    def plain_span(self, index: int) -> tuple[int, int]:
        del index
        return 0, len(self._body)

    def body_span(self, index: int) -> tuple[int, int]:
        del index
        return 0, len(self._body)

    def open_segment(self, index: int, window: memoryview) -> None:
        del index
        if not self._in_place:
            copy_into(window, self._body)


class PlaintextSealer:
    """Stands where the keyring's sealer does: nothing is sealed."""

    sealed = False

    def __repr__(self) -> str:
        return "PlaintextSealer()"

    @property
    def keyring(self) -> Keyring | None:
        return None

    def body_size(self, length: int, segment_size: int) -> int:
        del segment_size
        return length

    def windows(self, body: memoryview, length: int, segment_size: int) -> list[memoryview]:
        return [
            body[i * segment_size : min(length, (i + 1) * segment_size)]
            for i in range(segment_count(length, segment_size))
        ]

    def writer(
        self,
        who: Who,
        length: int,
        body: memoryview,
        dst: memoryview,
        *,
        segment_size: int,
        scope_user: str | None,
        context: bytes,
    ) -> SegmentWriter:
        del who, scope_user, context
        return _PlainWriter(length, body, dst, segment_size)

    def opener(
        self,
        envelope: Envelope,
        who: Who,
        *,
        in_place: bool,
        sealed_with: tuple[str, int] | None = None,
    ) -> Opener:
        del who, sealed_with  # nothing is sealed: no key to check
        if envelope.sealed:
            raise ProtocolError("a sealed value needs the keyring to open")
        return _PlainOpener(envelope.plain_body(), in_place=in_place)


class NullEventSink:
    """An event sink that drops every event (its futures are resolved already)."""

    def __init__(self) -> None:
        self._done: asyncio.Future[Any] | None = None

    def _resolved(self) -> asyncio.Future[Any]:
        done = self._done
        if done is None or done.get_loop() is not asyncio.get_running_loop():
            done = self._done = asyncio.get_running_loop().create_future()
            done.set_result(_NOWHERE)
        return done

    def submit(self, event: Event) -> asyncio.Future[Appended]:
        del event
        return self._resolved()

    def submit_lazy(self, event: Event) -> asyncio.Future[Appended]:
        del event
        return self._resolved()

    async def append(self, event: Event) -> Appended:
        del event
        return _NOWHERE

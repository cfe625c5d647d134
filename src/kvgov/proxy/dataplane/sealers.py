"""How the pipeline seals what it stores and opens what it serves: a :class:`Sealer`.

The pipeline is given one and asks it, with no branch on which it is:

* :class:`KeyringSealer`, always in production: per-tenant AES-256-GCM under the keyring's keys
  (:mod:`kvgov.keys.sealed`), each value in a sealed envelope (:mod:`kvgov.keys.sealformat`);
* the benchmarks' :class:`~kvgov.proxy.dataplane.unsafe.PlaintextSealer`
  (``dataplane.sealer = "unsafe-plaintext"``, development only), which stores values as they
  came in a plaintext envelope.

A put is laid out by the sealer (:meth:`Sealer.body_size`, :meth:`Sealer.windows`: where each
plaintext segment is received in the buffer) and sealed segment by segment by its
:class:`SegmentWriter`, into the buffer the value is stored from. A get asks the sealer for an
:class:`Opener` of the stored envelope, which authenticates and opens (or copies) each segment
into the hit's buffer; each sealer refuses the other's envelope.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Protocol

from kvgov.keys.sealed import SealedHeader, SealReader, sealed_size

if TYPE_CHECKING:
    from kvgov.keys.handle import KeyHandle
    from kvgov.keys.keyring import Keyring
    from kvgov.keys.sealformat import Envelope
    from kvgov.proxy.dataplane.identity import Who

__all__ = ["KeyringSealer", "Opener", "Sealer", "SegmentWriter"]


class SegmentWriter(Protocol):
    """Seals one put's segments as they arrive (any order, any thread, each once)."""

    #: the data key the value is sealed under (None: not sealed)
    @property
    def key(self) -> KeyHandle | None: ...

    @property
    def sealed_len(self) -> int:
        """Bytes of the stored body once every segment is sealed."""
        ...

    def seal_segment(self, index: int, src: memoryview) -> None: ...


class Opener(Protocol):
    """Opens one stored body segment by segment (any order, any thread, each once)."""

    @property
    def plain_len(self) -> int: ...

    @property
    def segment_size(self) -> int: ...

    @property
    def segments(self) -> int: ...

    def plain_span(self, index: int) -> tuple[int, int]:
        """(offset, length) of segment ``index`` in the plaintext."""
        ...

    def body_span(self, index: int) -> tuple[int, int]:
        """(offset, length) of segment ``index`` in the stored body."""
        ...

    def open_segment(self, index: int, window: memoryview) -> None:
        """Authenticate segment ``index`` and write its plaintext into ``window``; raises
        :class:`~kvgov.errors.CorruptValueError` (or a ``SealError``) for a bad one."""
        ...


class Sealer(Protocol):
    """What values are sealed with (see the module docstring)."""

    #: whether stored values are sealed (the envelope says so; the other kind is refused)
    sealed: bool

    @property
    def keyring(self) -> Keyring | None:
        """The keyring whose keys seal values, for the sidecar's key upkeep (None: none)."""
        ...

    def body_size(self, length: int, segment_size: int) -> int:
        """Bytes of the stored body of a ``length``-byte value."""
        ...

    def windows(self, body: memoryview, length: int, segment_size: int) -> list[memoryview]:
        """Where each plaintext segment of a put is received in ``body``, in order."""
        ...

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
        """The writer of one put received into :meth:`windows` of ``body``, its stored body
        written to ``dst`` (``body`` itself, or the fastest tier's own buffer), bound to
        ``context`` (the envelope head)."""
        ...

    def opener(
        self,
        envelope: Envelope,
        who: Who,
        *,
        in_place: bool,
        sealed_with: tuple[str, int] | None = None,
    ) -> Opener:
        """The opener of a stored ``envelope`` for ``who`` (``in_place``: the windows are in
        the envelope's own buffer; ``sealed_with``: the key id and version the entry was put
        under, which a sealed value must carry)."""
        ...


class _SealedOpener:
    """:class:`Opener` over a :class:`~kvgov.keys.sealed.SealReader`."""

    __slots__ = ("_header", "_reader")

    def __init__(self, reader: SealReader) -> None:
        self._reader = reader
        self._header: SealedHeader = reader.header

    @property
    def plain_len(self) -> int:
        return self._header.plain_len

    @property
    def segment_size(self) -> int:
        return self._header.segment_size

    @property
    def segments(self) -> int:
        return self._header.segments

    def plain_span(self, index: int) -> tuple[int, int]:
        return self._header.plain_span(index)

    def body_span(self, index: int) -> tuple[int, int]:
        return self._header.sealed_span(index)

    def open_segment(self, index: int, window: memoryview) -> None:
        self._reader.open_segment(index, window)


class KeyringSealer:
    """Seals under the keyring's active key for the value's scope (tenant, or scope user)."""

    sealed = True

    def __init__(self, keyring: Keyring) -> None:
        self._keyring = keyring

    def __repr__(self) -> str:
        return "KeyringSealer()"

    @property
    def keyring(self) -> Keyring:
        return self._keyring

    def body_size(self, length: int, segment_size: int) -> int:
        return sealed_size(length, segment_size)

    def windows(self, body: memoryview, length: int, segment_size: int) -> list[memoryview]:
        # each segment lands where its ciphertext will be: sealed in place (or into the tier's
        # buffer at the same offsets); the header and tags are written around it
        return [body[off:end] for off, end in _window_spans(length, segment_size)]

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
        del body  # received at the sealed offsets of dst's layout: sealed from there
        return self._keyring.sealer(
            who.tenant,
            who.digest.encode(),
            length,
            dst,
            user=scope_user,
            segment_size=segment_size,
            context=context,
        )

    def opener(
        self,
        envelope: Envelope,
        who: Who,
        *,
        in_place: bool,
        sealed_with: tuple[str, int] | None = None,
    ) -> Opener:
        del in_place  # opened from wherever the body is, into the windows given
        return _SealedOpener(
            envelope.reader(
                self._keyring,
                tenant=who.tenant,
                cache_key=who.digest.encode(),
                sealed_with=sealed_with,
            )
        )


@functools.lru_cache(256)
def _window_spans(length: int, segment_size: int) -> tuple[tuple[int, int], ...]:
    """``(start, end)`` of each plaintext segment's window in a sealed body of a ``length``-byte
    value (remembered: the sizes a data path sees are few, and every put asks)."""
    geometry = SealedHeader("", 0, segment_size, length, b"", b"")
    spans = []
    for i in range(geometry.segments):
        off, _ = geometry.sealed_span(i)
        _, plen = geometry.plain_span(i)
        spans.append((off, off + plen))
    return tuple(spans)

"""``KeyEventRecorder``, a sidecar keyring's ``on_change``: a real keyring (real KEK file,
in-memory store) sealing from worker threads hands its key events to the loop without waiting;
explicit rotations and shreds are left to the callers that record them."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvgov.errors import LedgerBackpressureError
from kvgov.keys.kek import FileKekProvider, generate_kek_file
from kvgov.keys.keyring import Keyring
from kvgov.keys.store import InMemoryKeyStore
from kvgov.ledger.events import Appended, Event, InMemoryEventSink
from kvgov.services.keys import KeyEventRecorder, rotate_key
from kvgov.types import EventKind

CK = b"llama|chunk-0009"


class FullOnceSink(InMemoryEventSink):
    """Stand-in for a ledger writer whose queue is full at the first submit."""

    def __init__(self) -> None:
        super().__init__()
        self.refused = 0

    def submit(self, event: Event) -> asyncio.Future[Appended]:
        if not self.refused:
            self.refused += 1
            raise LedgerBackpressureError("queue full")
        return super().submit(event)


def _ring(tmp_path: Path, recorder: KeyEventRecorder) -> Keyring:
    kek = FileKekProvider(generate_kek_file(tmp_path / "kek.key"))
    store = InMemoryKeyStore()
    return Keyring(store, kek, segment_size=4096, rotate_after_chunks=2, on_change=recorder)


async def test_events_from_sealing_threads_reach_the_sink(tmp_path: Path) -> None:
    sink = InMemoryEventSink()
    recorder = KeyEventRecorder(sink, asyncio.get_running_loop(), principal="node-1")
    ring = _ring(tmp_path, recorder)

    def seal(tenant: str) -> None:
        for _ in range(3):  # the third chunk rotates (rotate_after_chunks = 2)
            ring.seal(tenant, CK, b"x" * 5000)

    with ThreadPoolExecutor(4) as pool:
        await asyncio.gather(
            *(asyncio.wrap_future(pool.submit(seal, t)) for t in ("t1", "t2", "t3", "t4"))
        )
    await recorder.drain()
    got = sorted((e.tenant, e.kind, e.attrs["version"]) for e in sink.events)
    assert got == sorted(
        (t, kind, v)
        for t in ("t1", "t2", "t3", "t4")
        for kind, v in ((EventKind.KEY_CREATED, 1), (EventKind.KEY_ROTATED, 2))
    )
    assert {e.principal for e in sink.events} == {"node-1"}
    assert all(set(e.attrs) == {"key_id", "version"} for e in sink.events)

    # an explicit rotation through the service and a shred are recorded by their callers
    sink.events.clear()
    assert rotate_key(ring, "t1", None, principal="admin", reason="api").key.version == 3
    ring.shred("t2")
    await recorder.drain()
    assert sink.events == []


async def test_a_full_queue_waits_for_room_instead_of_dropping(tmp_path: Path) -> None:
    sink = FullOnceSink()
    recorder = KeyEventRecorder(sink, asyncio.get_running_loop(), principal="node-1")
    ring = _ring(tmp_path, recorder)
    ring.current("acme", "p-1")
    await recorder.drain()
    assert sink.refused == 1
    assert [(e.kind, e.actor, e.attrs) for e in sink.events] == [
        (EventKind.KEY_CREATED, "p-1", {"key_id": "u:acme:p-1", "version": 1}),
    ]


def test_a_closed_loop_is_logged_not_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    loop = asyncio.new_event_loop()
    loop.close()
    ring = _ring(tmp_path, KeyEventRecorder(InMemoryEventSink(), loop, principal="node-1"))
    with caplog.at_level(logging.ERROR):
        assert ring.current("acme").version == 1  # sealing goes on
    assert [r.message for r in caplog.records] == ["keys.event.unrecorded"]

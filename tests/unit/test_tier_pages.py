"""Fresh tier buffers: zeroed, exactly sized, their pages faulted in by a thread of the tier's
own while the caller is already writing them, and nothing the caller wrote is lost to it."""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Iterator

import pytest

from kvgov.connectors.tiers import memory, pages
from kvgov.connectors.tiers.memory import MemoryTier
from kvgov.connectors.tiers.pages import map_buffer, new_buffer, populate

MIB = 1 << 20


@pytest.fixture
def kernel_unknown() -> Iterator[None]:
    """Forget what the kernel was found to support (a test may pretend it lacks the advice)."""
    saved = pages._Kernel.populate_write
    pages._Kernel.populate_write = None
    yield
    pages._Kernel.populate_write = saved


def test_populate_faults_in_a_mapping_and_keeps_what_was_written() -> None:
    buf = map_buffer(8 * MIB)
    assert isinstance(buf, mmap.mmap)
    data = os.urandom(MIB)
    buf[3 * MIB : 4 * MIB] = data  # some pages already there, written
    assert populate(buf)  # Linux 5.14+, as on every machine this runs on
    assert bytes(buf[3 * MIB : 4 * MIB]) == data
    assert buf[: 3 * MIB] == bytes(3 * MIB) and buf[4 * MIB :] == bytes(4 * MIB)
    buf.close()  # no buffer export was left behind


@pytest.mark.usefixtures("kernel_unknown")
def test_without_the_advice_a_new_buffer_is_still_zeroed_and_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pages, "_madvise", lambda: None)
    buf = new_buffer(2 * MIB + 5)
    assert len(buf) == 2 * MIB + 5 and bytes(buf) == bytes(2 * MIB + 5)
    assert pages._Kernel.populate_write is False
    assert not populate(map_buffer(MIB))  # asked once, not again


def test_a_fresh_reservation_is_handed_out_at_once_while_the_tier_thread_faults_it_in(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gate = threading.Event()
    done = threading.Event()
    ran_in: list[str] = []

    def gated(buf: mmap.mmap) -> bool:
        ran_in.append(threading.current_thread().name)
        gate.wait(10)
        try:
            return populate(buf)
        finally:
            done.set()

    monkeypatch.setattr(memory, "populate", gated)
    tier = MemoryTier(64 * MIB)
    res = tier.reserve(16 * MIB)  # returns while its pages are still being faulted in
    assert res is not None
    first = os.urandom(8 * MIB)
    res.view[: 8 * MIB] = first  # the caller writes before the tier's thread got there
    gate.set()
    assert done.wait(10)
    second = os.urandom(8 * MIB)
    res.view[8 * MIB :] = second
    assert bytes(res.view) == first + second  # faulting in lost none of it
    assert ran_in and ran_in[0].startswith("kvgov-memory-pages")
    assert threading.current_thread().name not in ran_in


async def test_a_recycled_reservation_is_not_faulted_in_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []
    monkeypatch.setattr(memory, "populate", lambda buf: calls.append(len(buf)) or True)
    tier = MemoryTier(2 * MIB)
    for i in range(4):  # two fresh buffers, then the evicted ones recycled
        res = tier.reserve(MIB)
        assert res is not None
        res.view[:] = bytes([i]) * MIB
        await tier.put_reserved(f"k{i}", res)
    assert tier._populator is not None
    tier._populator.shutdown(wait=True)  # every job it was given has run
    assert calls == [MIB, MIB]
    assert await tier.get("k3") == bytes([3]) * MIB
    await tier.close()

"""The writer's thread hand-off (``ledger.writing.handoff``) behaves as ``run_in_executor``:
the result or the exception comes back on the loop, on the executor's own thread; a step whose
future was cancelled before it started does not run; a loop closed meanwhile is no error in
the worker."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvgov.ledger.writing.handoff import hand_off


async def test_the_result_and_the_thread_are_the_executors() -> None:
    def add(a: int, b: int) -> tuple[int, str]:
        return a + b, threading.current_thread().name

    with ThreadPoolExecutor(1, thread_name_prefix="kvgov-test") as pool:
        got = await hand_off(asyncio.get_running_loop(), pool, add, 2, 3)
    assert got[0] == 5 and got[1].startswith("kvgov-test")


async def test_an_exception_is_raised_to_the_awaiting_side() -> None:
    def boom() -> None:
        raise OSError(28, "No space left on device")

    with ThreadPoolExecutor(1) as pool:
        with pytest.raises(OSError, match="No space left"):
            await hand_off(asyncio.get_running_loop(), pool, boom)


async def test_a_step_cancelled_before_it_started_does_not_run() -> None:
    ran: list[int] = []
    gate = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        loop = asyncio.get_running_loop()
        first = hand_off(loop, pool, gate.wait, 5)  # holds the only thread
        second = hand_off(loop, pool, ran.append, 1)
        second.cancel()
        gate.set()
        assert await first is True
    assert ran == [] and second.cancelled()


def test_a_loop_closed_meanwhile_is_no_error_in_the_worker() -> None:
    loop = asyncio.new_event_loop()
    gate = threading.Event()
    pool = ThreadPoolExecutor(1)
    fut = hand_off(loop, pool, gate.wait, 5)
    loop.close()
    gate.set()
    pool.shutdown(wait=True)  # the worker's call_soon_threadsafe found the loop closed
    assert not fut.done()

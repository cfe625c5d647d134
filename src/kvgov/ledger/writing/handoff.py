"""A thread hand-off for the writer's per-sync and per-batch steps, lighter than
``loop.run_in_executor``.

``run_in_executor`` chains a ``concurrent.futures.Future`` to an asyncio one
(``asyncio.futures._chain_future``): the result crosses back through ``_copy_future_state``,
which reads the thread-side future's state under its lock four times, with ``isfuture`` checks
and callbacks on both sides: about 60 Python calls per round trip, across the event loop and the
worker, measured per put with ``bench/calls.py`` (a put costs about 1.2 of them: the journal's
sync, a share of a batch's sequencing and commit). :func:`hand_off` submits one function that
runs the step and schedules the asyncio future's result (or exception) on the loop itself
(``call_soon_threadsafe``): the same executor and thread, the same result or exception, a step
not started yet when the future is cancelled is not run (``run_in_executor`` cancels it then),
in about half the calls.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, TypeVar

T = TypeVar("T")


def hand_off(
    loop: asyncio.AbstractEventLoop, executor: Executor, fn: Callable[..., T], *args: object
) -> asyncio.Future[T]:
    """``fn(*args)`` on ``executor``; the future resolves on ``loop`` with its result or the
    exception it raised (as ``loop.run_in_executor(executor, fn, *args)`` does)."""
    fut: asyncio.Future[T] = loop.create_future()
    executor.submit(_run, loop, fut, fn, args)
    return fut


def _run(
    loop: asyncio.AbstractEventLoop,
    fut: asyncio.Future[T],
    fn: Callable[..., T],
    args: tuple[object, ...],
) -> None:
    """On the worker thread: run the step unless its future was cancelled before it started,
    then hand its outcome back to the loop."""
    if fut.cancelled():  # (read across threads: a flag; the loop only ever sets it)
        return
    try:
        result = fn(*args)
    except BaseException as exc:  # noqa: BLE001 - the awaiting side gets it, as from run_in_executor
        _deliver(loop, _set_exception, fut, exc)
        return
    _deliver(loop, _set_result, fut, result)


def _deliver(
    loop: asyncio.AbstractEventLoop,
    settle: Callable[[asyncio.Future[Any], Any], None],
    fut: asyncio.Future[Any],
    value: object,
) -> None:
    try:  # noqa: SIM105 - contextlib.suppress is three more Python calls per hand-off
        loop.call_soon_threadsafe(settle, fut, value)
    except RuntimeError:  # the loop was closed meanwhile: nobody is left to tell
        pass


def _set_result(fut: asyncio.Future[Any], result: object) -> None:
    if not fut.cancelled():
        fut.set_result(result)


def _set_exception(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.cancelled():
        fut.set_exception(exc)

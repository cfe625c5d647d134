"""A small bounded thread pool for crypto work that releases the GIL.

``AESGCM.encrypt_into`` / ``decrypt_into`` drop the GIL while they run, so sealing segments in
a few threads keeps the event loop serving and scales with cores. The pool is bounded twice:
``threads`` workers, and at most ``max_pending`` queued jobs (callers wait beyond that, which
is the data plane's backpressure instead of an unbounded queue of buffers).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from types import TracebackType
from typing import ParamSpec, TypeVar

from kvgov.keys.sealed import SealReader, SealWriter

P = ParamSpec("P")
T = TypeVar("T")


class CryptoExecutor:
    """Runs crypto callables on ``threads`` workers with at most ``max_pending`` in flight."""

    def __init__(self, threads: int = 2, *, max_pending: int | None = None) -> None:
        if threads < 1:
            raise ValueError("threads must be at least 1")
        self.threads = threads
        self._max_pending = max_pending or threads * 4
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvgov-crypto")
        self._slots = threading.BoundedSemaphore(self._max_pending)
        self._async_slots: asyncio.Semaphore | None = None

    def submit(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        """Queue ``fn``; blocks while ``max_pending`` jobs are already queued or running."""
        self._slots.acquire()
        try:
            future = self._pool.submit(fn, *args, **kwargs)
        except BaseException:
            self._slots.release()
            raise
        future.add_done_callback(lambda _f: self._slots.release())
        return future

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run ``fn`` on the pool from a coroutine, waiting (not blocking) for a free slot."""
        if self._async_slots is None:
            self._async_slots = asyncio.Semaphore(self._max_pending)
        async with self._async_slots:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._pool, lambda: fn(*args, **kwargs))

    def seal_all(self, writer: SealWriter, src: bytes | bytearray | memoryview) -> int:
        """Seal every segment of ``src`` in parallel; returns the sealed length."""
        view = memoryview(src).cast("B")
        header = writer.header
        if len(view) != header.plain_len:
            raise ValueError(f"plaintext is {len(view)} bytes, header says {header.plain_len}")
        futures = []
        for i in range(header.segments):
            start, length = header.plain_span(i)
            futures.append(self.submit(writer.seal_segment, i, view[start : start + length]))
        _raise_first(futures)
        return writer.sealed_len

    def open_all(self, reader: SealReader, dst: bytearray | memoryview) -> int:
        """Open every segment into ``dst`` in parallel; on any failure ``dst`` is zeroed."""
        header = reader.header
        out = memoryview(dst).cast("B")
        if len(out) < header.plain_len:
            raise ValueError(f"destination holds {len(out)} bytes; {header.plain_len} needed")
        futures = []
        for i in range(header.segments):
            start, length = header.plain_span(i)
            futures.append(self.submit(reader.open_segment, i, out[start : start + length]))
        try:
            _raise_first(futures)
        except BaseException:
            out[: header.plain_len] = bytes(header.plain_len)
            raise
        return header.plain_len

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> CryptoExecutor:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _raise_first(futures: list[Future[T]]) -> None:
    wait(futures)
    for future in futures:
        error = future.exception()
        if error is not None:
            raise error

"""One whole-ledger verification at a time, its report kept a short while (review r15, F1).

A verification (:func:`kvgov.ledger.trust.verify_trusted`) streams every event of every chain
and re-hashes each one: its cost grows with the whole ledger, whoever asks. Run once per
request, any auditor token (a tenant-scoped one included) could keep dozens in flight, each
in one of the API's worker threads and on the sidecar's own ledger pool: the control plane
stalled, the sidecar's heartbeat could not get a connection and the pod dropped out of the
purge fleet. So the API verifies through a :class:`LedgerVerifier`, one per process (the
sidecar's, :attr:`kvgov.proxy.app.Sidecar.verifier`):

* single flight: at most one verification runs; callers arriving meanwhile await that one;
* kept: its report is served again for ``api.verify_cache_s`` after it finished (counted from
  the end, so verifications take at most a share ``d / (d + verify_cache_s)`` of one thread
  for a verification of ``d`` seconds). A tenant-scoped caller is served it for
  ``api.verify_scoped_refresh_s`` (longer by default): a scoped token alone starts at most one
  verification per that many seconds. The report's ``verified_at`` is when its verification
  began: every event written before it was checked;
* on its own thread (``kvgov-verify``), never the API's anyio worker threads; the caller
  (:meth:`kvgov.proxy.api.auth.ApiContext.verify_ledger`) runs it on an engine of its own with
  one connection, never the sidecar's ledger pool.

A verification that raises is not kept: the callers that shared it get the error, the next
caller starts another.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from functools import partial

from prometheus_client import CollectorRegistry, Counter

from kvgov.config import ApiSettings
from kvgov.db.engine import utcnow
from kvgov.ledger.verify import VerifyReport


@dataclass(frozen=True, slots=True)
class Verified:
    """A verification's report and when it began."""

    report: VerifyReport
    verified_at: datetime


class LedgerVerifier:
    """Single-flight, cached whole-ledger verification (see the module)."""

    def __init__(
        self,
        *,
        cache_s: float = 30.0,
        scoped_refresh_s: float = 600.0,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cache_s = cache_s
        self.scoped_refresh_s = scoped_refresh_s
        #: where the counters are (the sidecar's metrics registry, else one of its own)
        self.registry = registry if registry is not None else CollectorRegistry()
        self._clock = clock
        # one thread: the single flight below already allows one run; its own pool keeps the
        # run off anyio's limiter, which authentication and every sync route need
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvgov-verify")
        #: the last report and the clock when its verification finished
        self._kept: tuple[Verified, float] | None = None
        self._running: asyncio.Task[Verified] | None = None
        self.runs = Counter(
            "kvgov_api_ledger_verifications",
            "Whole-ledger verifications the API ran, by outcome (ok, failed: the ledger does "
            "not verify, error: the verification raised)",
            ["outcome"],
            registry=self.registry,
        )
        self.requests = Counter(
            "kvgov_api_ledger_verify_requests",
            "Requests for a ledger verification (API, dashboard), by how they were served: "
            "ran (started one), joined (awaited the one running), cached (a kept report)",
            ["served"],
            registry=self.registry,
        )

    @classmethod
    def from_settings(
        cls, api: ApiSettings, registry: CollectorRegistry | None = None
    ) -> LedgerVerifier:
        return cls(
            cache_s=api.verify_cache_s,
            scoped_refresh_s=api.verify_scoped_refresh_s,
            registry=registry,
        )

    def close(self) -> None:
        """Let the worker thread go (a verification in progress finishes first)."""
        self._executor.shutdown(wait=False)

    async def report(self, run: Callable[[], VerifyReport], *, fleet_wide: bool) -> Verified:
        """The kept report while it is fresh enough for this caller, else the one running,
        else a fresh one made by ``run`` (blocking; on the verifier's own thread)."""
        kept = self._kept
        if kept is not None:
            verified, finished = kept
            served_for = self.cache_s if fleet_wide else max(self.cache_s, self.scoped_refresh_s)
            if self._clock() - finished < served_for:
                self.requests.labels("cached").inc()
                return verified
        loop = asyncio.get_running_loop()
        running = self._running
        # a run of a loop that has gone (tests) is not awaited from another
        if running is None or running.done() or running.get_loop() is not loop:
            running = self._running = loop.create_task(self._run(run))
            running.add_done_callback(_retrieve)
            self.requests.labels("ran").inc()
        else:
            self.requests.labels("joined").inc()
        # a caller that goes away (its client disconnected) leaves the run to the others
        return await asyncio.shield(running)

    async def _run(self, run: Callable[[], VerifyReport]) -> Verified:
        began = utcnow()
        call = partial(contextvars.copy_context().run, run)
        try:
            report = await asyncio.get_running_loop().run_in_executor(self._executor, call)
        except BaseException:
            self.runs.labels("error").inc()
            self._running = None
            raise
        self.runs.labels("ok" if report.ok else "failed").inc()
        verified = Verified(report=report, verified_at=began)
        self._kept = (verified, self._clock())
        self._running = None
        return verified


def _retrieve(task: asyncio.Task[Verified]) -> None:
    """Mark the run's error seen: every caller may have gone (each got it, or was cancelled)."""
    if not task.cancelled():
        task.exception()

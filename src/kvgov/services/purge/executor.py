"""The sidecar's purge executor: a background task that takes and runs purge steps.

On start it registers (or refreshes) the sidecar's row in ``sidecars`` and takes back any step
its previous process left ``running`` (a sidecar killed mid-purge resumes at once after a
restart). Then, every ``purge.poll_interval_s`` (or at once when :meth:`wake` is called, e.g.
by ``POST /v1/purges``), it refreshes its heartbeat and runs every step it may claim: its own
``tiers``/``engines`` steps, and global steps no other executor has taken. A pass that fails,
whatever the error, is logged by the error's type and counted, and the next one runs: one bad
row or job must not stop every later purge of the sidecar (review r14, F1).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from kvgov.db import purge_jobs as jobs
from kvgov.db import sidecars
from kvgov.db.engine import utcnow
from kvgov.errors import KvgovError
from kvgov.services.purge.service import PurgeService

log = logging.getLogger(__name__)


class PurgeExecutor:
    def __init__(
        self,
        service: PurgeService,
        *,
        sidecar_id: str,
        chain_id: str | None = None,
        poll_interval_s: float | None = None,
        on_error: Callable[[Exception], None] | None = None,
    ) -> None:
        self.service = service
        self.sidecar_id = sidecar_id
        self.chain_id = chain_id
        self.poll_interval_s = poll_interval_s or service.settings.purge.poll_interval_s
        self._wake = asyncio.Event()
        self._stopping = False
        self._task: asyncio.Task[None] | None = None
        self.steps_run = 0
        #: passes that failed (logged by the error's type; the executor goes on)
        self.errors = 0
        #: told of each (the sidecar counts them in a metric)
        self.on_error = on_error

    async def _pass(self) -> None:
        """One round: the heartbeat, every step it may run now, the fences to lift."""
        await self.service.ctx.db(
            lambda s: sidecars.heartbeat(s, self.sidecar_id, now=utcnow(), chain_id=self.chain_id)
        )
        self.steps_run += await self.service.run_until_idle()
        await self.service.lift_fences()  # of jobs finished elsewhere too

    def _failed(self, exc: Exception) -> None:
        self.errors += 1
        if self.on_error is not None:
            self.on_error(exc)

    async def start(self) -> None:
        def register(s: Session) -> int:
            sidecars.heartbeat(s, self.sidecar_id, now=utcnow(), chain_id=self.chain_id)
            return jobs.release_own_steps(s, self.sidecar_id)

        released = await self.service.ctx.db(register)
        if released:
            log.info("purge.executor.resumed", extra={"steps": released})
        self._task = asyncio.create_task(self._loop(), name="kvgov-purge-executor")

    @property
    def task(self) -> asyncio.Task[None] | None:
        """The background task (the sidecar cancels it on stop)."""
        return self._task

    def wake(self) -> None:
        self._wake.set()

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _loop(self) -> None:
        while not self._stopping:
            try:
                await self._pass()
            except (KvgovError, SQLAlchemyError, OSError) as exc:
                log.warning("purge.executor.error", extra={"error": type(exc).__name__})
                self._failed(exc)
            except Exception as exc:  # noqa: BLE001 - see below
                # anything else (a RecursionError out of a forged row's JSON killed the task,
                # silently, and every later purge of this sidecar with it: review r14, F1)
                # costs this pass only; by its type alone (a message may quote data)
                log.error("purge.executor.unexpected_error", extra={"error": type(exc).__name__})
                self._failed(exc)
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.poll_interval_s)

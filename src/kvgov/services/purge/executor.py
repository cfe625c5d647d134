"""The sidecar's purge executor: a background task that takes and runs purge steps.

On start it registers (or refreshes) the sidecar's row in ``sidecars`` and takes back any step
its previous process left ``running`` (a sidecar killed mid-purge resumes at once after a
restart). Then, every ``purge.poll_interval_s`` (or at once when :meth:`wake` is called, e.g.
by ``POST /v1/purges``), it refreshes its heartbeat and runs every step it may claim: its own
``tiers``/``engines`` steps, and global steps no other executor has taken.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

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
    ) -> None:
        self.service = service
        self.sidecar_id = sidecar_id
        self.chain_id = chain_id
        self.poll_interval_s = poll_interval_s or service.settings.purge.poll_interval_s
        self._wake = asyncio.Event()
        self._stopping = False
        self._task: asyncio.Task[None] | None = None
        self.steps_run = 0

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
                await self.service.ctx.db(
                    lambda s: sidecars.heartbeat(
                        s, self.sidecar_id, now=utcnow(), chain_id=self.chain_id
                    )
                )
                self.steps_run += await self.service.run_until_idle()
                await self.service.lift_fences()  # of jobs finished elsewhere too
            except (KvgovError, SQLAlchemyError, OSError) as exc:
                log.warning("purge.executor.error", extra={"error": type(exc).__name__})
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.poll_interval_s)

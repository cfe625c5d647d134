"""Null collaborators of the pipeline, for benchmarks only: what "governance off" means.

The pipeline always asks a policy, seals through a sealer and records to an event sink; a
benchmark that measures what governance costs swaps in these instead (with the
``unsafe-allow-all`` policy, :mod:`kvgov.policy.allow_all`):

* :class:`PlaintextSealer` (``dataplane.sealer = "unsafe-plaintext"``): values are stored as
  they came, in a plaintext envelope; no key, no encryption;
* :class:`NullEventSink` (``dataplane.events = "unsafe-null"``): events go nowhere, at once.

Each is named ``unsafe`` where it is chosen, refused in production
(:meth:`kvgov.config.Settings.production_problems`) and by
:func:`kvgov.proxy.app.build_sidecar` outside development.
"""

from __future__ import annotations

import asyncio
from typing import Any

from kvgov.ledger.events import Appended, Event

__all__ = ["NullEventSink", "PlaintextSealer"]

_NOWHERE = Appended("unsafe-null", 0)


class PlaintextSealer:
    """Stands where the :class:`~kvgov.keys.keyring.Keyring` does: nothing is sealed."""

    def __repr__(self) -> str:
        return "PlaintextSealer()"


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

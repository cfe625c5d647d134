"""Review r12, F1: an engine's ACK wrote any ``removed`` count it liked into the chained
``purge:evict:late`` event (and the ``engines@S`` step's receipt).

Attack: an engine owed a late EVICT (its channel was down during the purge) acknowledges it
with a ``removed`` list of names it was never sent. ``WireConnection.evict`` counts
``len(ack["removed"])`` without checking the names against the digests of the frame, and
``LateEvictions._event`` records that count in a signed, chained ledger event: the audit trail
says the engine removed 1 000 entries for a purge whose debt named 1. (The same count feeds
the ``engines@S`` step's receipt.) FAILS while the inflated count is recorded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvgov.wire.control import ControlChannel
from tests.security import doors
from tests.security.doors import run
from tests.security.test_purge_late_evict import LocalTier, _down_during_purge, _late, _sidecar

pytestmark = pytest.mark.postgres


def _boast(channel: ControlChannel) -> None:
    """The engine's own wire code (not kvgov's client, which intersects with the frame's
    digests): every EVICT_ACK names 1 000 "removed" entries."""

    def evict(conn: Any, meta: dict[str, Any]) -> dict[str, Any]:
        return {"removed": [f"{i:064x}" for i in range(1_000)]}

    channel._evict = evict  # type: ignore[method-assign]


async def test_a_late_evict_event_records_no_more_removals_than_digests_sent(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    async with _sidecar(tmp_path, prod_db) as sc:
        local = LocalTier()
        acme, _, (job,) = await _down_during_purge(sc, local, {0x91: "alice"})
        channel = acme.control(local.on_evict, reconnect_delay=0.1)
        _boast(channel)
        try:
            assert await run(channel.connected.wait, 10)
            assert await doors.until(lambda: bool(_late(sc, job.id)), 10), "no ledger event"
            (event,) = _late(sc, job.id)
            assert event.attrs["removed"] <= event.attrs["digests"], (
                f"purge:evict:late of job {job.id} records removed={event.attrs['removed']} "
                f"for digests={event.attrs['digests']}: the engine's ACK wrote the count"
            )
        finally:
            channel.close()
            acme.close()

"""Fairness: a large frame is handled in slices that yield to the event loop, so one engine's
4,096-key frame does not hold every other connection (another engine's PING) until it is done;
a PUT of empty values is refused per item without taking buffers or recording anything.

Attack (issue 14, "what got through" 5): one 4,096-key denied EXISTS frame held the event loop
0.5-0.8 s (another client's PING waited as long); a 4,096-item PUT of empty values took 8-9 s.

No timing is asserted: a task counts the loop's turns, and the test checks over how many turns
the frame's keys were handled (one turn: nothing else ran meanwhile).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from kvgov.types import EventKind
from kvgov.wire.codec import FrameType
from tests.security import doors
from tests.security.doors import WireProbe, events, key, run

pytestmark = pytest.mark.postgres

ITEMS = 4096


@contextmanager
def turns_seen(sc: Any) -> Iterator[set[int]]:
    """The loop turns during which the pipeline identified a key."""
    seen: set[int] = set()
    turn = 0

    async def ticker() -> None:
        nonlocal turn
        while True:
            turn += 1
            await asyncio.sleep(0)

    identify = sc.pipeline.identify

    def counting(*args: Any, **kwargs: Any) -> Any:
        seen.add(turn)
        return identify(*args, **kwargs)

    sc.pipeline.identify = counting
    task = asyncio.get_running_loop().create_task(ticker())
    try:
        yield seen
    finally:
        task.cancel()
        sc.pipeline.identify = identify


async def test_a_4096_key_exists_frame_yields_to_other_connections(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    async with doors.sidecar(tmp_path, prod_db) as sc:
        port = sc.server.tcp_port
        assert port is not None
        attacker, other = WireProbe(port), WireProbe(port)
        try:
            await run(attacker.hello, "tok-acme")
            await run(other.hello, "tok-globex")
            probes = [key(i, "globex") for i in range(ITEMS)]  # all denied
            with turns_seen(sc) as seen:
                await run(attacker.send, FrameType.EXISTS, {"keys": probes})
                ftype, meta = await run(attacker.reply)
            assert ftype is FrameType.EXISTS
            assert meta["found"] == [False] * ITEMS
            # handled over many turns of the loop: other connections ran in between
            assert len(seen) >= ITEMS // 64 // 2
            other.send(FrameType.PING, None)
            assert (await run(other.reply))[0] is FrameType.PING
        finally:
            attacker.close()
            other.close()


async def test_a_put_of_4096_empty_values_is_refused_cheaply(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    async with doors.sidecar(tmp_path, prod_db) as sc:
        port = sc.server.tcp_port
        assert port is not None
        attacker = WireProbe(port)
        try:
            await run(attacker.hello, "tok-acme")
            items = [{"key": key(i, "acme"), "len": 0} for i in range(ITEMS)]
            with turns_seen(sc) as seen:
                await run(attacker.send, FrameType.PUT, {"items": items})
                ftype, meta = await run(attacker.reply)
            assert ftype is FrameType.PUT, meta
            assert [r["reason"] for r in meta["results"]] == ["empty"] * ITEMS
            # no buffer was taken for them, nothing stored, nothing recorded
            assert sc.pipeline.pool.in_use_bytes + sc.pipeline.pool.idle_bytes == 0
            assert not events(sc, EventKind.KV_PUT)
            assert len(seen) <= 1  # not even identified
        finally:
            attacker.close()

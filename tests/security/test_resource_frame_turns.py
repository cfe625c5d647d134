"""Fairness between connections: frames whose bytes are already buffered are handled at most
``SLICE`` (64) in a row before the handler gives the event loop a pass, so one connection's
thousand tiny frames in one write do not hold every other connection until all are answered.

Attack (review r18, finding 5): a frame whose header and metadata sit in the connection's
scratch buffer is read with no future and no pass of the event loop; since commit 40fa515 one
64 KiB ``recv`` routinely carries many frames, so an engine pipelining 16-byte PINGs (or
``lm://`` HEALTH requests) had up to about 4,096 frames handled, each with its reply's ``send``,
in one pass, while every other connection of the sidecar waited.

No timing is asserted: a task counts the loop's turns, and the test checks over how many turns
the flood's frames were handled (one or two turns: nothing else ran meanwhile).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from kvgov.proxy.dataplane.lm import LmConnection
from kvgov.proxy.dataplane.wireconn import WireConnection
from kvgov.wire.codec import FrameType, encode_frame
from tests.integration.live import recv_exact
from tests.security import doors
from tests.security.doors import LM_REPLY, LmClient, WireProbe, run

pytestmark = pytest.mark.postgres

FRAMES = 1000
LM_HEALTH = 5
#: how many turns the flood must at least span: one per 64 frames, halved for slack (a
#: handler that never yields spans the few reads its bytes arrived in: 64 KiB each)
SPAN = FRAMES // 64 // 2


@contextmanager
def turns_seen(cls: type, name: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The loop turn of each call of ``cls.name`` (a reply being sent) meanwhile."""
    seen: list[int] = []
    turn = 0

    async def ticker() -> None:
        nonlocal turn
        while True:
            turn += 1
            await asyncio.sleep(0)

    original = getattr(cls, name)

    def counting(self: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(turn)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, counting)
    task = asyncio.get_running_loop().create_task(ticker())
    try:
        yield seen
    finally:
        task.cancel()
        monkeypatch.setattr(cls, name, original)


async def test_a_thousand_buffered_pings_yield_to_other_connections(
    tmp_path: Path, prod_db: doors.ProdDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with doors.sidecar(tmp_path, prod_db) as sc:
        port = sc.server.tcp_port
        assert port is not None
        attacker, other = WireProbe(port), WireProbe(port)
        try:
            await run(attacker.hello, "tok-acme")
            await run(other.hello, "tok-globex")
            flood = encode_frame(FrameType.PING, 1, None, 0) * FRAMES  # one write
            with turns_seen(WireConnection, "send", monkeypatch) as seen:
                await run(attacker.sock.sendall, flood)
                replies = await run(lambda: [attacker.reply()[0] for _ in range(FRAMES)])
            assert replies == [FrameType.PING] * FRAMES
            assert len(seen) == FRAMES
            turns = len(set(seen))
            assert turns >= SPAN, (
                f"{FRAMES} buffered PINGs were answered over {turns} turns of the event loop:"
                " no other connection ran while they were handled"
            )
            other.send(FrameType.PING, None)
            assert (await run(other.reply))[0] is FrameType.PING
        finally:
            attacker.close()
            other.close()


async def test_a_flood_of_lm_health_requests_yields_to_other_connections(
    tmp_path: Path, prod_db: doors.ProdDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    lm_on = {"lm_port": 0, "lm_engine_id": "lm-acme", "lm_tenants": ["acme"]}
    async with doors.sidecar(tmp_path, prod_db, **lm_on) as sc:
        assert sc.lm_server is not None and sc.lm_server.port is not None
        lm = LmClient(sc.lm_server.port)
        try:
            flood = lm._head(LM_HEALTH, "") * FRAMES  # one write
            with turns_seen(LmConnection, "reply", monkeypatch) as seen:
                await run(lm.sock.sendall, flood)
                got = await run(recv_exact, lm.sock, LM_REPLY.size * FRAMES)
            codes = [code for code, *_ in LM_REPLY.iter_unpack(got)]
            assert codes == [200] * FRAMES
            assert len(seen) == FRAMES
            turns = len(set(seen))
            assert turns >= SPAN, (
                f"{FRAMES} buffered lm:// HEALTH requests were answered over {turns} turns"
                " of the event loop: no other connection ran while they were handled"
            )
        finally:
            lm.close()

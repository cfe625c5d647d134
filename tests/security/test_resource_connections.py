"""Connection caps: a global cap over every data-plane listener, one per peer and one per
engine, enforced; a connection over a cap is closed at once, counted, and logged once per
interval, not once per connection.

Attack (issue 14, "what got through" 5): 1,500 idle connections all stayed open
(``dataplane.max_connections`` was never read); at a 1,024-descriptor limit that stalled
engines and ``/readyz``.
"""

from __future__ import annotations

import logging
import select
import socket
from pathlib import Path

import pytest

from tests.security import doors
from tests.security.doors import WireProbe, engine, known_dataplane, run

pytestmark = pytest.mark.postgres


def _closed(socks: list[socket.socket], wait_s: float) -> list[socket.socket]:
    """The sockets the server closed within ``wait_s`` (readable at EOF or reset)."""
    import time

    closed: list[socket.socket] = []
    deadline = time.monotonic() + wait_s
    pending = list(socks)
    while pending and (left := deadline - time.monotonic()) > 0:
        readable, _, _ = select.select(pending, [], [], left)
        for s in readable:
            try:
                data = s.recv(4096)
            except OSError:
                data = b""
            if not data:
                closed.append(s)
                pending.remove(s)
    return closed


async def test_connections_beyond_the_global_cap_are_closed_at_once(
    tmp_path: Path, prod_db: doors.ProdDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    caps = known_dataplane(max_connections=20, hello_timeout_s=60.0)
    async with doors.sidecar(tmp_path, prod_db, **caps) as sc:
        port = sc.server.tcp_port
        assert port is not None
        caplog.set_level(logging.INFO, logger="kvgov.dataplane")
        socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(60)]
        try:
            closed = await run(_closed, socks, 3.0)
            assert len(closed) == 40  # 20 stay open, the rest are closed at once
            assert len(sc.server.connections) == 20
            refused = sc.metrics.registry.get_sample_value(
                "kvgov_dataplane_connections_refused_total", {"listener": "kvgov", "cap": "global"}
            )
            assert refused == 40
            lines = [r for r in caplog.records if r.getMessage() == "dataplane.connection.refused"]
            assert len(lines) == 1  # summarised: one line per interval, not one per connection
            # the held ones go away: an engine connects again
            for s in socks:
                s.close()
            acme = engine(sc, "tok-acme")
            try:
                assert await run(acme.ping) >= 0
            finally:
                acme.close()
        finally:
            for s in socks:
                s.close()


async def test_one_engine_cannot_take_every_connection(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    caps = known_dataplane(max_connections_per_engine=3)
    async with doors.sidecar(tmp_path, prod_db, **caps) as sc:
        port = sc.server.tcp_port
        assert port is not None
        mine = [WireProbe(port) for _ in range(3)]
        extra = WireProbe(port)
        try:
            for conn in mine:
                await run(conn.hello, "tok-globex")
            with pytest.raises(AssertionError, match="too many connections"):
                await run(extra.hello, "tok-globex")
            assert await run(extra.closed_within, 3.0)
            # another engine is not affected
            acme = engine(sc, "tok-acme")
            try:
                assert await run(acme.ping) >= 0
            finally:
                acme.close()
            mine.pop().close()  # a slot of globex's comes free
            again = WireProbe(port)
            try:
                for _ in range(50):  # the close reaches the sidecar soon
                    try:
                        await run(again.hello, "tok-globex")
                        break
                    except AssertionError:
                        again.close()
                        again = WireProbe(port)
                else:
                    pytest.fail("the freed slot was never given back")
            finally:
                again.close()
        finally:
            for conn in mine:
                conn.close()
            extra.close()


async def test_one_peer_cannot_take_every_connection(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    caps = known_dataplane(max_connections_per_peer=5, hello_timeout_s=60.0)
    async with doors.sidecar(tmp_path, prod_db, **caps) as sc:
        port = sc.server.tcp_port
        assert port is not None
        socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(12)]
        try:
            closed = await run(_closed, socks, 3.0)
            assert len(closed) == 7
            refused = sc.metrics.registry.get_sample_value(
                "kvgov_dataplane_connections_refused_total", {"listener": "kvgov", "cap": "peer"}
            )
            assert refused == 7
        finally:
            for s in socks:
                s.close()

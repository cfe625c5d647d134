"""Accept errors back off without a log storm: when the process runs out of descriptors,
accepting stops for a moment and is retried; each failure is counted
(``kvgov_dataplane_accept_errors_total``) and logged once per interval, without a traceback.

Attack (issue 14, "what got through" 5): at a 1,024-descriptor limit, 1,100 idle connections
stalled engines and the log filled with tens of thousands of accept tracebacks.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import resource
import socket
from pathlib import Path

import pytest

from tests.security import doors
from tests.security.doors import engine, run

pytestmark = pytest.mark.postgres

CLIENTS = 60


async def test_descriptor_exhaustion_is_counted_and_summarised(
    tmp_path: Path, prod_db: doors.ProdDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    async with doors.sidecar(tmp_path, prod_db) as sc:
        port = sc.server.tcp_port
        assert port is not None
        caplog.set_level(logging.INFO)
        socks = [socket.socket() for _ in range(CLIENTS)]  # their descriptors exist already
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        try:
            # a few descriptors left: the listener's accept() soon fails with EMFILE
            open_now = sum(1 for _ in Path("/proc/self/fd").iterdir())  # noqa: ASYNC240
            resource.setrlimit(resource.RLIMIT_NOFILE, (open_now + 4, hard))
            for s in socks:
                s.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    s.connect(("127.0.0.1", port))
            await asyncio.sleep(3.5)  # the loop retries accepting about once a second
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        try:
            failures = sc.metrics.registry.get_sample_value("kvgov_dataplane_accept_errors_total")
            assert failures is not None and failures >= 2
            accept_lines = [r for r in caplog.records if "accept" in r.getMessage()]
            assert len(accept_lines) == 1, [r.getMessage() for r in accept_lines]
            assert not any(r.exc_info for r in accept_lines)  # no traceback
            assert getattr(accept_lines[0], "error", None) == errno.errorcode[errno.EMFILE]
            # accepting resumed: an engine connects and is served
            acme = engine(sc, "tok-acme")
            try:
                assert await run(acme.ping) >= 0
            finally:
                acme.close()
        finally:
            for s in socks:
                s.close()

"""Review r9, F3: ``Sidecar.start()`` stops what it started when it fails part-way
(commit 7c24ff8), but ``stop()`` was not idempotent (it runs once now): a caller that, as before
that commit it had to, releases a sidecar whose start failed (``try: await sc.start() finally:
await sc.stop()``, the lifecycle ``kvgov.proxy.app`` documents) got ``RuntimeError: cannot
schedule new futures after shutdown`` from the second stop, and the start's own error (here:
the engine's container planted a folder at the socket path, the error that names the culprit)
survived only as that RuntimeError's ``__context__``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvgov.errors import ConfigError
from kvgov.proxy.app import build_sidecar
from tests.security import doors
from tests.security.doors import ProdDatabase
from tests.security.test_unix_socket_bind import short_dir  # noqa: F401 - the fixture


@pytest.mark.postgres
async def test_a_caller_that_stops_a_sidecar_whose_start_failed_sees_the_start_error(
    tmp_path: Path,
    prod_db: ProdDatabase,
    short_dir: Path,  # noqa: F811 - the fixture
) -> None:
    sock = short_dir / "d.sock"
    (sock / "planted").mkdir(parents=True)  # what vLLM's container may do
    sc = await build_sidecar(doors.settings(tmp_path, prod_db, unix_path=str(sock)))
    with pytest.raises(ConfigError, match="something that is not a socket holds the path"):
        try:
            await sc.start()
        finally:
            await sc.stop(grace_s=0)  # the caller's cleanup: a no-op once start() cleaned up

"""Review r9, F2: the guard against opa-python-client drift checked that ``_init_session``
exists, not that the client's session is the one it builds; and a ``unix://`` OPA was handed
to the library as ``http://localhost:80``, so an unchecked session the library built another
way spoke TCP to the pod's loopback port 80. Now the client refuses a session that is not on
the checked Unix connector (``opa_untrusted``, nothing sent), and the URL it is handed names
``opa.invalid``, which never resolves.

``opa_client`` refuses a library without ``_init_session`` ("fail closed rather than left to
build an unchecked one"). A release that keeps ``_init_session`` (deprecated, say) but opens
its session elsewhere (``__aenter__`` building its own ``TCPConnector``, as 3.0's
``_init_session`` does today) passes that check; kvgov then sends its bearer token and every
decision to ``localhost:80``. Port 80 is not privileged inside many pods: Docker (20.10+)
and containerd 2 set ``net.ipv4.ip_unprivileged_port_start=0`` in a container's network
namespace, so vLLM's uid binds it without a capability whenever it likes (OPA being up or
not does not matter: nothing else listens there).

Simulated here: the library's ``__aenter__`` as such a release would have it; a listener on
127.0.0.1:80 stands in for vLLM's code (the test needs to bind port 80: root here). The
token is a test value, never printed.
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvgov.policy.bundle import load_bundle
from kvgov.policy.opa import OpaRestPolicyEngine
from tests.security.squatter import FORBIDDEN, squatter

TOKEN = "c0de" * 16  # a test value shaped like `openssl rand -hex 32`; never printed


@pytest.fixture
def port_80() -> Iterator[list[str]]:
    try:
        with squatter(80, tokenless=200) as (_, seen):
            yield seen
    except OSError as exc:
        pytest.skip(f"cannot bind 127.0.0.1:80 here ({exc.strerror})")


@pytest.fixture
def a_release_that_opens_its_session_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """opa-python-client as a later release could be: ``_init_session`` still there (so the
    guard passes) but ``__aenter__`` builds the session itself, as 3.0's code does."""
    from opa_client import AsyncOpaClient

    async def __aenter__(self: Any) -> Any:  # noqa: N807 - the library's method
        self._connector = aiohttp.TCPConnector(ssl=False)
        self._session = aiohttp.ClientSession(
            headers=self.headers,
            connector=self._connector,
            timeout=aiohttp.ClientTimeout(total=self.timeout),
        )
        return self

    monkeypatch.setattr(AsyncOpaClient, "__aenter__", __aenter__)


async def test_a_unix_opa_never_falls_back_to_a_loopback_tcp_port(
    port_80: list[str], a_release_that_opens_its_session_elsewhere: None
) -> None:
    with tempfile.TemporaryDirectory(prefix="opa-") as where:
        sock_path = Path(where) / "opa.sock"
        # OPA's socket is there and OPA's (this process's uid): only the library changed
        with socket.socket(socket.AF_UNIX) as opa:
            opa.bind(str(sock_path))
            opa.listen()
            assert os.lstat(sock_path).st_uid == os.getuid()
            engine = OpaRestPolicyEngine(
                load_bundle(), url=f"unix://{sock_path}", timeout_s=3.0, token=TOKEN
            )
            try:
                decision = await engine.decide(FORBIDDEN)
            finally:
                await engine.aclose()
    got_token = sum(1 for h in port_80 if h == f"Bearer {TOKEN}")
    assert got_token == 0 and not decision.allowed, (
        f"policy.opa_url=unix://...: a listener on 127.0.0.1:80 got the bearer token"
        f" {got_token} time(s) and its 'allowed' was obeyed (allowed={decision.allowed})"
    )

"""Helpers the live-sidecar tests share: a governed sidecar on a real Postgres with the real
Rego policy, running for the length of a ``with``, an exact read from a socket, and the two
places large chunks can be sealed, opened and sent (:data:`CRYPTO_PATHS`)."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from kvgov.config import Settings
from kvgov.policy.cache import CachingPolicyEngine
from kvgov.policy.embedded import EmbeddedPolicyEngine
from kvgov.proxy.app import Sidecar, build_sidecar
from kvgov.proxy.dataplane.plans import INLINE_ALL, INLINE_CRYPTO_BYTES

#: the ``lm://`` listener on a free port, standing for the shipped example policy's ``lm-demo``
#: engine (``"*"`` does not admit the handshake-less listener: demo names it), for demo only
LM_ON = {"lm_port": 0, "lm_engine_id": "lm-demo", "lm_tenants": ["demo"]}

#: values of ``dataplane.inline_crypto_bytes`` for a fixture's ``params``: large chunks in the
#: crypto pool and a sender thread (what a sidecar with more than two CPUs does), or on the
#: event loop (two CPUs or fewer)
CRYPTO_PATHS = [
    pytest.param(INLINE_CRYPTO_BYTES, id="threads"),
    pytest.param(INLINE_ALL, id="loop"),
]


@asynccontextmanager
async def running_sidecar(settings: Settings) -> AsyncIterator[Sidecar]:
    """A started sidecar (embedded Rego policy with its decision cache), stopped afterwards."""
    sc = await build_sidecar(
        settings, policy=CachingPolicyEngine(EmbeddedPolicyEngine.from_paths())
    )
    await sc.start()
    try:
        yield sc
    finally:
        await sc.stop()


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes from ``sock``; ConnectionError if the peer closes first."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return bytes(buf)

"""Helpers the live-sidecar tests share: a governed sidecar on a real Postgres with the real
Rego policy, running for the length of a ``with``, and an exact read from a socket."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from kvgov.config import Settings
from kvgov.policy.cache import CachingPolicyEngine
from kvgov.policy.embedded import EmbeddedPolicyEngine
from kvgov.proxy.app import Sidecar, build_sidecar


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

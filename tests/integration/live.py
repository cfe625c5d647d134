"""Helpers the live-sidecar tests share: the settings of a sidecar listening on loopback
(:func:`loopback_settings`), a governed sidecar on a real database with the real Rego policy
(:func:`start_sidecar`, or running for the length of a ``with``: :func:`running_sidecar`), an
exact read from a socket, and the two places large chunks can be sealed, opened and sent
(:data:`CRYPTO_PATHS`)."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

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


MIB = 1 << 20


def loopback_settings(
    data_dir: Path,
    db_url: str,
    *,
    pool_mib: int = 64,
    lm: bool = False,
    dataplane: Mapping[str, Any] | None = None,
    **sections: Any,
) -> Settings:
    """A development sidecar's settings for a live test: its ledger on ``db_url``, the kvgov
    wire on a free loopback TCP port, a ``pool_mib`` MiB buffer pool, the ``lm://`` listener on
    (``lm``: :data:`LM_ON`) or off. ``dataplane`` adds or overrides data-plane fields;
    ``sections`` are the other sections (``tiers``, ``ledger``, ``keys``)."""
    return Settings(
        data_dir=data_dir,
        database={"url": db_url},
        dataplane={
            "host": "127.0.0.1",
            "port": 0,
            **(LM_ON if lm else {"lm_port": -1}),
            "buffer_pool_bytes": pool_mib * MIB,
            **(dataplane or {}),
        },
        **sections,
    )


async def start_sidecar(settings: Settings) -> Sidecar:
    """A started sidecar with the embedded Rego policy and its decision cache (the caller
    stops it)."""
    sc = await build_sidecar(
        settings, policy=CachingPolicyEngine(EmbeddedPolicyEngine.from_paths())
    )
    await sc.start()
    return sc


@asynccontextmanager
async def running_sidecar(settings: Settings) -> AsyncIterator[Sidecar]:
    """A started sidecar (:func:`start_sidecar`), stopped afterwards."""
    sc = await start_sidecar(settings)
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

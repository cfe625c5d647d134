"""A retrieve split into several GET frames fetched in parallel (``kvgov.get_frame_bytes``).

Real LMCache engines on CPU through ``KvgovConnector`` to the real sidecar: with a frame limit
below one chunk, every chunk of a batched get is its own frame on its own pooled connection, and
the engine still gets every chunk back byte for byte, in order.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("lmcache")

from tests import lmcache_harness as h

pytestmark = [pytest.mark.lmcache, pytest.mark.postgres]

G = h.Geometry()


@pytest.fixture
def sidecar(pg_url: str) -> Iterator[h.SidecarThread]:
    # short: the sidecar's Unix socket lives here (sun_path is ~107 bytes)
    path = Path(tempfile.mkdtemp(prefix="kvg-"))
    try:
        with h.sidecar(path, tenants=["acme"], database_url=pg_url) as sc:
            yield sc
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_one_frame_per_chunk_retrieves_every_chunk_byte_for_byte(
    sidecar: h.SidecarThread,
) -> None:
    toks = h.tokens(5 * G.chunk, seed=21)
    ids = h.identity("acme", request_id="req-a", user="alice")
    cfg = h.kvgov_config(sidecar.endpoint, extra={"kvgov.get_frame_bytes": 1})
    with h.engines(cfg, cfg) as (a, b):
        a.fill(len(toks), seed=3)
        a.store(toks, ids)
        a.wait_remote_puts()

        assert b.retrieve(toks, ids) == 5 * G.chunk
        assert b.kv_bytes(len(toks)) == a.kv_bytes(len(toks))

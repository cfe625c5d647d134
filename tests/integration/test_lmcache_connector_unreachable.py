"""KvgovConnector inside a real LMCache engine with no sidecar listening: fail closed.

Store and retrieve complete without raising, nothing hits, and the backoff keeps later calls
from waiting on the dead endpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("lmcache")

from tests import lmcache_harness as h

pytestmark = pytest.mark.lmcache


def test_unreachable_sidecar_is_a_miss_and_never_raises(tmp_path: Path) -> None:
    g = h.Geometry()
    toks = h.tokens(2 * g.chunk, seed=5)
    ids = h.identity("acme", request_id="r-1", user="alice")
    endpoint = f"unix://{tmp_path / 'nobody.sock'}"
    with h.engines(
        h.kvgov_config(endpoint), h.kvgov_config(f"tcp://127.0.0.1:{h.free_port()}")
    ) as (
        a,
        b,
    ):
        for e in (a, b):
            conn = e.remote_connector()
            assert type(conn).__name__ == "KvgovConnector"
            e.fill(len(toks), seed=1)
            e.store(toks, ids)
            e.wait_remote_puts()
            e.zero()
            assert e.lookup(toks, ids) == 0
            assert e.retrieve(toks, ids) == 0
            assert e.kv_bytes(len(toks)) == bytes(len(e.kv_bytes(len(toks))))
            failures = conn.backoff.failures
            assert failures >= 1
            assert conn.backoff.open
            assert e.lookup(toks, ids) == 0
            assert conn.backoff.failures == failures  # breaker open: no new connect attempt

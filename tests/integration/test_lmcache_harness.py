"""The CPU engine harness against LMCache's own ``lmcache_server``: proves the harness is real.

Engine A stores through LMCache's built-in ``lm://`` connector; engine B, a separate engine with
an empty local tier, retrieves the same tokens byte for byte from the server.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("lmcache")

from tests import lmcache_harness as h

pytestmark = pytest.mark.lmcache


def test_lm_server_round_trip_between_two_engines() -> None:
    g = h.Geometry()
    toks = h.tokens(3 * g.chunk + 17, seed=1)  # 3 full chunks; the partial tail is not stored
    with h.lmcache_server() as url, h.engines(h.lm_config(url), h.lm_config(url)) as (a, b):
        a.fill(len(toks), seed=7)
        a.store(toks)
        a.wait_remote_puts()

        # lm:// PUTs have no reply: A's last chunks may still be on their way into the server
        # (its thread for A's connection) when B asks on its own connection
        deadline = time.monotonic() + 10
        while b.lookup(toks) < 3 * g.chunk and time.monotonic() < deadline:
            time.sleep(0.01)
        assert b.lookup(toks) == 3 * g.chunk
        assert b.retrieve(toks) == 3 * g.chunk
        n = 3 * g.chunk
        assert b.kv_bytes(n) == a.kv_bytes(n)
        assert b.kv_bytes(n) != bytes(len(b.kv_bytes(n)))


def test_local_cpu_tier_round_trip_and_clear() -> None:
    g = h.Geometry()
    toks = h.tokens(2 * g.chunk, seed=2)
    with h.engines(h.local_config()) as (e,):
        written = e.fill(len(toks), seed=3)
        e.store(toks, h.identity("acme"))
        e.zero()
        assert e.lookup(toks, h.identity("acme")) == 2 * g.chunk
        assert e.lookup(toks, h.identity("globex")) == 0
        assert e.retrieve(toks, h.identity("acme")) == 2 * g.chunk
        assert bool((e.gpu.kv[:, :, : len(toks), :] == written).all())
        assert e.clear(toks, h.identity("acme")) == 2
        assert e.lookup(toks, h.identity("acme")) == 0

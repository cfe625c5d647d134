"""Real LMCache engines on CPU through ``KvgovConnector`` to a real kvgov sidecar.

The sidecar is the real application (``kvgov.proxy.app.build_sidecar``: embedded Rego policy,
per-tenant encryption, tiers, the ledger on a fresh Postgres database) on its own event loop;
the engines are real ``LMCacheEngine`` instances whose only remote tier is kvgov. Every
assertion is about behaviour an operator can observe: lookups, bytes, ledger rows.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("lmcache")

from sqlalchemy import select

from kvgov.db.models import LedgerEvent
from kvgov.ledger.queries_api import provenance
from kvgov.types import EventKind
from tests import lmcache_harness as h

pytestmark = [pytest.mark.lmcache, pytest.mark.postgres]

G = h.Geometry()
TENANTS = ["acme", "globex"]


@pytest.fixture
def data_dir() -> Iterator[Path]:
    # short: the sidecar's Unix socket lives here (sun_path is ~107 bytes)
    path = Path(tempfile.mkdtemp(prefix="kvg-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def sidecar(data_dir: Path, pg_url: str) -> Iterator[h.SidecarThread]:
    with h.sidecar(data_dir, tenants=TENANTS, database_url=pg_url) as sc:
        yield sc


def _store(engine: h.Engine, toks: list[int], ids: dict[str, str], seed: int = 1) -> None:
    engine.fill(len(toks), seed=seed)
    engine.store(toks, ids)
    engine.wait_remote_puts()


def test_tenant_store_on_a_retrieves_byte_for_byte_on_b(sidecar: h.SidecarThread) -> None:
    toks = h.tokens(3 * G.chunk, seed=11)
    cfg = h.kvgov_config(sidecar.endpoint)
    with h.engines(cfg, cfg) as (a, b):
        assert type(b.remote_connector()).__name__ == "KvgovConnector"
        _store(a, toks, h.identity("acme", request_id="req-a", user="alice"))

        reader = h.identity("acme", request_id="req-b", user="bob")
        assert b.lookup(toks, reader) == 3 * G.chunk
        assert b.retrieve(toks, reader) == 3 * G.chunk
        assert b.kv_bytes(len(toks)) == a.kv_bytes(len(toks))

        # same tokens, another tenant or no tenant: different keys, and kvgov has none of them
        assert b.lookup(toks, h.identity("globex", request_id="req-c", user="carol")) == 0
        assert b.lookup(toks, h.identity(request_id="req-d")) == 0
        assert b.lookup(toks) == 0


def test_untagged_store_is_denied_and_stores_nothing(sidecar: h.SidecarThread) -> None:
    toks = h.tokens(G.chunk, seed=12)
    cfg = h.kvgov_config(sidecar.endpoint)
    with h.engines(cfg, cfg) as (a, b):
        _store(a, toks, h.identity(request_id="req-untagged"))
        assert b.lookup(toks) == 0
        # a key claiming a tenant the gateway did not authenticate is refused as well
        _store(a, toks, h.identity("acme", request_id="req-spoof", auth_tenant="globex"))
        assert b.lookup(toks, h.identity("acme")) == 0
    with sidecar.session() as s:
        kinds = s.scalars(
            select(LedgerEvent.request_id).where(LedgerEvent.kind == EventKind.KV_DENIED.value)
        ).all()
    assert {"req-untagged", "req-spoof"} <= set(kinds)


def test_restricted_request_stores_nothing_and_the_denial_is_recorded(
    sidecar: h.SidecarThread,
) -> None:
    toks = h.tokens(2 * G.chunk, seed=13)
    ids = h.identity("acme", request_id="req-r", user="alice", sensitivity="restricted")
    cfg = h.kvgov_config(sidecar.endpoint)
    with h.engines(cfg, cfg) as (a, b):
        _store(a, toks, ids)
        assert b.lookup(toks, ids) == 0
        assert b.retrieve(toks, ids) == 0
    with sidecar.session() as s:
        denied = s.scalars(
            select(LedgerEvent).where(
                LedgerEvent.kind == EventKind.KV_DENIED.value, LedgerEvent.request_id == "req-r"
            )
        ).all()
        stored = s.scalars(
            select(LedgerEvent).where(
                LedgerEvent.kind == EventKind.KV_PUT.value, LedgerEvent.request_id == "req-r"
            )
        ).all()
    # one put per chunk; b's lookup is denied too (the policy decides before anything looks
    # at what is stored)
    assert [e.attrs["operation"] for e in denied].count("put") == 2
    assert {e.attrs["operation"] for e in denied} == {"put", "exists"}
    assert all(e.reason == "not_cacheable:restricted" for e in denied)
    assert stored == []
    assert all(e.tenant == "acme" for e in denied)


def test_confidential_needs_a_user_tag_and_stays_with_that_user(
    sidecar: h.SidecarThread,
) -> None:
    toks = h.tokens(2 * G.chunk, seed=14)
    cfg = h.kvgov_config(sidecar.endpoint)
    with h.engines(cfg, cfg) as (a, b):
        # no user scope on a confidential request: denied, nothing stored
        untagged = h.identity("acme", request_id="req-c0", user="alice", sensitivity="confidential")
        _store(a, toks, untagged)
        assert b.lookup(toks, untagged) == 0

        alice = h.identity(
            "acme",
            user_scope="alice",
            request_id="req-c1",
            user="alice",
            sensitivity="confidential",
        )
        _store(a, toks, alice)
        assert b.lookup(toks, alice) == 2 * G.chunk  # alice herself hits

        # bob, same tenant: his own scope is another key; alice's scope is refused to him
        bob_own = h.identity("acme", user_scope="bob", request_id="req-c2", user="bob")
        assert b.lookup(toks, bob_own) == 0
        bob_as_alice = h.identity(
            "acme", user_scope="alice", request_id="req-c3", user="bob", sensitivity="confidential"
        )
        assert b.lookup(toks, bob_as_alice) == 0
        assert b.retrieve(toks, bob_as_alice) == 0
        assert b.kv_bytes(len(toks)) == bytes(len(b.kv_bytes(len(toks))))
    with sidecar.session() as s:
        denied = set(
            s.scalars(
                select(LedgerEvent.request_id).where(LedgerEvent.kind == EventKind.KV_DENIED.value)
            ).all()
        )
    assert "req-c0" in denied


def test_provenance_lists_exactly_the_chunks_loaded_in_order_with_creators(
    sidecar: h.SidecarThread,
) -> None:
    first = h.tokens(2 * G.chunk, seed=15)
    longer = first + h.tokens(2 * G.chunk, seed=16)
    cfg = h.kvgov_config(sidecar.endpoint)
    with h.engines(cfg, cfg) as (a, b):
        _store(a, first, h.identity("acme", request_id="req-p1", user="alice"))
        # carol extends the prompt: her lookup hits the first two chunks, so (like vLLM) the
        # engine stores only the two new ones
        carol = h.identity("acme", request_id="req-p2", user="carol")
        assert a.lookup(longer, carol) == 2 * G.chunk
        a.fill(len(longer), seed=2)
        a.store(longer, carol, skip_prefix=2 * G.chunk)
        a.wait_remote_puts()

        reader = h.identity("acme", request_id="req-p3", user="bob")
        assert b.retrieve(longer, reader) == 4 * G.chunk
        keys = b.key_strings(longer, reader)
    assert len(keys) == 4
    with sidecar.session() as s:
        rows = provenance(s, "req-p3", "acme")
        assert [r.key_digest for r in rows] == [sidecar.key_digest(k) for k in keys]
        creators = [(r.entry.created_request_id, r.entry.owner) for r in rows if r.entry]
        revisions = {r.entry.policy_revision for r in rows if r.entry}
    alice, carol = sidecar.pseudonym("acme", "alice"), sidecar.pseudonym("acme", "carol")
    assert creators == [("req-p1", alice)] * 2 + [("req-p2", carol)] * 2
    assert len(revisions) == 1
    assert all(revisions)  # every chunk names the policy revision that admitted it

    # the same answers through the CLI, forward and reverse
    from typer.testing import CliRunner

    from kvgov.cli.main import build_app

    runner = CliRunner()
    out = runner.invoke(build_app(), ["provenance", "req-p3", "--json"], env=sidecar.env)
    assert out.exit_code == 0, out.output
    chunks = json.loads(out.output)["chunks"]
    assert [(c["created"]["request_id"], c["created"]["user"]) for c in chunks] == creators
    out = runner.invoke(
        build_app(),
        ["provenance", "--user", "carol", "--tenant", "acme", "--json"],
        env=sidecar.env,
    )
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["requests"] == [{"request_id": "req-p3", "chunks": 2}]
    assert "alice" not in str(creators)


def test_sidecar_down_is_a_miss_and_hits_resume_after_restart(data_dir: Path, pg_url: str) -> None:
    toks = h.tokens(2 * G.chunk, seed=17)
    ids = h.identity("acme", request_id="req-s", user="alice")
    env = h.sidecar_env(data_dir, tenants=TENANTS, database_url=pg_url)
    sc = h.SidecarThread(env).start()
    fast_retry = {"kvgov.backoff_initial_s": 0.05, "kvgov.backoff_max_s": 0.2}
    cfg = h.kvgov_config(sc.endpoint, extra=fast_retry)
    try:
        with h.engines(cfg, cfg) as (a, b):
            _store(a, toks, ids)
            assert b.lookup(toks, ids) == 2 * G.chunk

            sc.stop()
            # the sidecar is gone: everything completes, nothing hits, nothing raises
            other = h.tokens(2 * G.chunk, seed=18)
            _store(a, other, ids)
            b.zero()
            assert b.lookup(toks, ids) == 0
            assert b.retrieve(toks, ids) == 0
            assert b.lookup(other, ids) == 0

            sc = h.SidecarThread(env).start()  # same data dir, socket and ledger
            hits = 0
            for _ in range(200):  # the breaker lets a call through within backoff_max_s
                hits = b.lookup(toks, ids)
                if hits:
                    break
                b.wait_remote_puts(timeout_s=1)
            assert hits == 2 * G.chunk
            assert b.retrieve(toks, ids) == 2 * G.chunk
            assert b.kv_bytes(len(toks)) == a.kv_bytes(len(toks))[: len(b.kv_bytes(len(toks)))]
    finally:
        sc.stop()


def test_evict_removes_the_keys_from_the_engine_local_cpu_tier(sidecar: h.SidecarThread) -> None:
    toks = h.tokens(3 * G.chunk, seed=19)
    other = h.tokens(G.chunk, seed=20)
    ids = h.identity("acme", request_id="req-e", user="alice")
    with h.engines(h.kvgov_config(sidecar.endpoint, local_cpu=True)) as (e,):
        conn = e.remote_connector()
        assert conn.control is not None
        assert conn.control.connected.wait(10)
        _store(e, toks, ids)
        _store(e, other, ids, seed=3)
        assert e.local_cpu_hits(toks, ids) == 3 * G.chunk
        digests = [sidecar.key_digest(k) for k in e.key_strings(toks, ids)]

        results = sidecar.evict(digests[1:], "acme")  # the 2nd and 3rd chunk, named by digest
        assert [(r.engine, r.acked, r.removed, r.error) for r in results] == [
            ("engine-test", True, 2, None)
        ]
        assert e.local_cpu_hits(toks, ids) == G.chunk  # the prefix up to the evicted chunk
        assert e.local_cpu_hits(other, ids) == G.chunk  # other keys untouched

        # evicting entries the engine does not hold acknowledges nothing
        again = sidecar.evict(digests[1:], "acme")
        assert [(r.acked, r.removed) for r in again] == [(True, 0)]

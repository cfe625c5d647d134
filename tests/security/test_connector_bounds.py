"""Attacks on the engine's LMCache connector (s9 review: item 4 and the "unconfirmed" hit
geometry), with a real LMCache engine (``tests/lmcache_harness.py``) whose kvgov connector
talks to a fake sidecar in-process (``fake_sidecar.py``): what a wedged or malicious sidecar,
an impostor at its address, or another engine allowed to put for the tenant could answer.

- A sidecar that drips its GET reply: ``kvgov.timeout_s`` bounds the operation, so LMCache's
  retrieve gets a miss in about that long (it was held for as long as the peer dripped).
- A hit whose stored metadata (shape, dtype, fmt) describes another KV geometry: the connector
  allocated LMCache's destination from it (it checked only numel * itemsize == length), and
  LMCache's GPU connector sizes its copy from that buffer. Now only the engine's own geometry
  (its layers, hidden size, dtype and format, 1 to ``chunk_size`` tokens) is allocated; any
  other hit is a miss, counted in ``refused_hits`` and logged without its bytes.

Fails while the attacks work.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("lmcache")

import torch

from kvgov.wire.codec import FrameHeader, FrameType
from kvgov.wire.messages import GetResult
from tests import lmcache_harness as h
from tests.security.fake_sidecar import FakeSidecar, bounded, fake_sidecar, reply

pytestmark = pytest.mark.lmcache

TIMEOUT_S = 0.5
G = h.Geometry()  # 2 layers, 2 heads of 32, chunks of 256 tokens, bfloat16
IDS = h.identity("acme", request_id="r-1", user="alice")
OWN_FMT = 1  # MemoryFormat.KV_2LTD


def _shape(layers: int = G.layers, tokens: int = G.chunk, hidden: int = G.hidden) -> list[int]:
    return [2, layers, tokens, hidden]


def _config(endpoint: str) -> Any:
    return h.kvgov_config(endpoint, extra={"kvgov.timeout_s": TIMEOUT_S, "kvgov.control": False})


@pytest.fixture
def engine_at() -> Iterator[Callable[[FakeSidecar], h.Engine]]:
    built: list[h.Engine] = []

    def build(fake: FakeSidecar) -> h.Engine:
        e = h.build_engine(_config(fake.endpoint), G)
        built.append(e)
        return e

    yield build
    for e in built:
        e.close()


def _serving(hit_meta: dict[str, Any], payload: bytes) -> Callable[..., None]:
    """A sidecar that has every key, each a hit of ``payload`` stored with ``hit_meta``."""

    def handler(conn: socket.socket, header: FrameHeader, meta: dict[str, Any], _: bytes) -> None:
        keys = meta.get("keys", [])
        if header.type is FrameType.EXISTS:
            conn.sendall(reply(FrameType.EXISTS, header.stream_id, {"found": [True] * len(keys)}))
        elif header.type is FrameType.GET:
            items = [{"code": 0, "len": len(payload), "meta": hit_meta}] * len(keys)
            head = reply(
                FrameType.GET, header.stream_id, {"items": items}, len(payload) * len(keys)
            )
            conn.sendall(head + payload * len(keys))
        elif header.type is FrameType.PING:
            conn.sendall(reply(FrameType.PING, header.stream_id, None))

    return handler


def test_a_dripping_sidecar_is_a_miss_within_the_timeout(
    engine_at: Callable[[FakeSidecar], h.Engine],
) -> None:
    def handler(conn: socket.socket, header: FrameHeader, meta: dict[str, Any], _: bytes) -> None:
        keys = meta.get("keys", [])
        if header.type is FrameType.EXISTS:
            conn.sendall(reply(FrameType.EXISTS, header.stream_id, {"found": [True] * len(keys)}))
        elif header.type is FrameType.GET:
            n = G.chunk_bytes
            items = [{"code": 0, "len": n, "meta": {}}] * len(keys)
            conn.sendall(reply(FrameType.GET, header.stream_id, {"items": items}, n * len(keys)))
            fake.drip(conn, bytes(n * len(keys)), every_s=TIMEOUT_S * 0.6)

    toks = h.tokens(G.chunk, seed=3)
    with fake_sidecar(handler) as fake:
        e = engine_at(fake)
        got, took = bounded(lambda: e.retrieve(toks, IDS), 10 * TIMEOUT_S)
        assert got == 0, got
        assert took < TIMEOUT_S + 2.0, f"retrieve took {took:.1f}s with timeout_s={TIMEOUT_S}"
        assert e.kv_bytes(G.chunk) == bytes(G.chunk_bytes)
        conn = e.remote_connector()
        assert conn.backoff.failures >= 1  # a timed-out sidecar is skipped for a while
        assert any(t is FrameType.GET for t, _ in fake.requests)


def _foreign(
    shape: list[int] | None = None, dtype: str | None = "bfloat16", fmt: int | None = OWN_FMT
) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    if shape is not None:
        meta["shape"] = shape
    if dtype is not None:
        meta["dtype"] = dtype
    if fmt is not None:
        meta["fmt"] = fmt
    return meta


#: hits whose bytes add up (numel * itemsize == length) but whose geometry is not the engine's
FOREIGN = {
    "more-layers": (_foreign(_shape(layers=64, tokens=8)), G.chunk_bytes),
    "layers-for-tokens": (_foreign(_shape(layers=4, tokens=G.chunk // 2)), G.chunk_bytes),
    "other-hidden": (_foreign(_shape(tokens=G.chunk // 2, hidden=2 * G.hidden)), G.chunk_bytes),
    "float16": (_foreign(_shape(), dtype="float16"), G.chunk_bytes),
    "float32": (_foreign(_shape(tokens=G.chunk // 2), dtype="float32"), G.chunk_bytes),
    "mla-format": (_foreign(_shape(), fmt=7), G.chunk_bytes),
    "undefined-format": (_foreign(_shape(), fmt=0), G.chunk_bytes),
    "rank-3": (_foreign([2 * G.layers, G.chunk, G.hidden]), G.chunk_bytes),
    "kv-size-1": (_foreign([1, G.layers, 2 * G.chunk, G.hidden]), G.chunk_bytes),
    "no-shape-short": (_foreign(None), G.chunk_bytes // 2),
    "zero-tokens": (_foreign(_shape(tokens=0)), 0),
    "float-dims": (_foreign([2.0, G.layers, G.chunk, G.hidden]), G.chunk_bytes),
}


@pytest.mark.parametrize("case", sorted(FOREIGN))
def test_a_hit_of_another_geometry_is_a_refused_miss(
    case: str, engine_at: Callable[[FakeSidecar], h.Engine], caplog: pytest.LogCaptureFixture
) -> None:
    hit_meta, length = FOREIGN[case]
    payload = (b"SECRETKV" * (length // 8 + 1))[:length]
    toks = h.tokens(G.chunk, seed=4)
    with fake_sidecar(_serving(hit_meta, payload)) as fake:
        e = engine_at(fake)
        conn = e.remote_connector()
        with caplog.at_level(logging.WARNING, logger="kvgov.connectors.lmcache"):
            got, _ = bounded(lambda: e.retrieve(toks, IDS), 10 * TIMEOUT_S)
        assert got == 0, got
        assert e.kv_bytes(G.chunk) == bytes(G.chunk_bytes)
        assert any(t is FrameType.GET for t, _ in fake.requests)
        assert conn.refused_hits >= 1
        refused = [r for r in caplog.records if r.getMessage() == "lmcache.connector.foreign_hit"]
        assert refused, "the refusal was not logged"
        assert all("SECRETKV" not in repr(r.__dict__) for r in refused)  # no KV bytes


def test_a_reply_of_more_than_a_chunk_per_key_is_refused_unread(
    engine_at: Callable[[FakeSidecar], h.Engine], caplog: pytest.LogCaptureFixture
) -> None:
    """More tokens than a chunk: the reply carries more than the GET allows (a chunk per key),
    a protocol error before any byte is read or allocated; the connection is closed."""
    hit_meta = _foreign(_shape(tokens=2 * G.chunk))
    toks = h.tokens(G.chunk, seed=7)
    with fake_sidecar(_serving(hit_meta, bytes(2 * G.chunk_bytes))) as fake:
        e = engine_at(fake)
        with caplog.at_level(logging.WARNING, logger="kvgov.connectors.lmcache"):
            got, _ = bounded(lambda: e.retrieve(toks, IDS), 10 * TIMEOUT_S)
        assert got == 0
        assert e.kv_bytes(G.chunk) == bytes(G.chunk_bytes)
        failed = [r for r in caplog.records if r.getMessage() == "lmcache.connector.failed"]
        assert [getattr(r, "error", None) for r in failed] == ["WireError"]
        accepted = fake.accepted
        assert e.lookup(toks, IDS) == G.chunk  # the next operation needs a new connection
        assert fake.accepted == accepted + 1


def test_a_hit_of_the_engines_own_geometry_is_loaded(
    engine_at: Callable[[FakeSidecar], h.Engine],
) -> None:
    """The control: what the engine itself puts is loaded, byte for byte."""
    kv = torch.randn(2, G.layers, G.chunk, G.hidden, generator=torch.Generator().manual_seed(5))
    kv = kv.to(G.dtype)
    payload = kv.contiguous().view(torch.uint8).numpy().tobytes()
    toks = h.tokens(G.chunk, seed=6)
    with fake_sidecar(_serving(_foreign(_shape()), payload)) as fake:
        e = engine_at(fake)
        got, _ = bounded(lambda: e.retrieve(toks, IDS), 10 * TIMEOUT_S)
        assert got == G.chunk
        assert e.kv_bytes(G.chunk) == payload
        assert getattr(e.remote_connector(), "refused_hits", 0) == 0


@pytest.mark.parametrize("tokens", [1, G.chunk - 56, G.chunk])
def test_a_chunk_of_up_to_chunk_size_tokens_is_allocated_as_stored(
    tokens: int, engine_at: Callable[[FakeSidecar], h.Engine]
) -> None:
    """The last chunk of a sequence may be short: allocated with its own token count."""
    with fake_sidecar() as fake:
        conn = engine_at(fake).remote_connector()
        length = 2 * G.layers * tokens * G.hidden * G.dtype.itemsize
        obj = conn._allocate(GetResult("k", length, _foreign(_shape(tokens=tokens))))
        assert obj is not None
        try:
            assert obj.meta.shape == torch.Size(_shape(tokens=tokens))
            assert obj.meta.dtype == G.dtype
            assert obj.get_size() == length
        finally:
            obj.ref_count_down()
        # a hit stored without metadata: only a whole chunk of the engine's own
        if tokens == G.chunk:
            obj = conn._allocate(GetResult("k", length, {}))
            assert obj is not None
            assert obj.meta.shape == torch.Size(_shape())
            obj.ref_count_down()
        assert conn.refused_hits == 0
        # one token more than a chunk: refused
        over = 2 * G.layers * (G.chunk + 1) * G.hidden * G.dtype.itemsize
        assert conn._allocate(GetResult("k", over, _foreign(_shape(tokens=G.chunk + 1)))) is None
        assert conn.refused_hits == 1


def test_an_engine_with_several_layer_groups_takes_only_whole_chunks_in_its_own_layout() -> None:
    from lmcache.v1.memory_management import MemoryFormat

    from kvgov.connectors.lmcache.connector import _hit_geometry

    shapes = [torch.Size([2, 2, G.chunk, 64]), torch.Size([2, 3, G.chunk, 32])]
    dtypes = [G.dtype, G.dtype]
    full = sum(s.numel() for s in shapes) * G.dtype.itemsize
    own = {"shapes": shapes, "dtypes": dtypes, "fmt": MemoryFormat.KV_2LTD, "full_bytes": full}
    assert _hit_geometry({}, full, **own) == (shapes, dtypes)
    # whatever shape it claims, a whole chunk is laid out as the engine's own groups
    assert _hit_geometry({"fmt": OWN_FMT, "shape": [2, 64, 8, 8]}, full, **own) == (shapes, dtypes)
    assert _hit_geometry({}, full - 2 * 2 * 64 * G.dtype.itemsize, **own) == "length"
    assert _hit_geometry({}, 2 * full, **own) == "length"
    assert _hit_geometry({"fmt": 7}, full, **own) == "fmt"
    assert _hit_geometry({"fmt": True}, full, **own) == "fmt"

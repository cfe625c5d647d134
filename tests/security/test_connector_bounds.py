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
    "kv-mla-fmt": (_foreign([1, G.layers, G.chunk, 2 * G.hidden], fmt=6), G.chunk_bytes),
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


# -- the token dimension of each memory format ------------------------------------------------
#
# LMCache 0.5.6 lays out the tokens of a chunk at a different index per format (what its GPU
# connectors' ``get_shape`` allocate): an engine's short last chunk is short on that dimension,
# and a hit differing in any other dimension is refused, whatever the format.

L, C, H = G.layers, G.chunk, G.hidden

#: (format, the engine's own full-chunk shape, the index of its tokens); each has the bytes
#: of the harness engine's chunk, so a real engine's connector can allocate it too
LAYOUTS: dict[str, tuple[str, list[int], int]] = {
    "KV_2LTD": ("KV_2LTD", [2, L, C, H], 2),
    "KV_MLA_FMT": ("KV_MLA_FMT", [1, L, C, 2 * H], 2),
    "KV_MLA_FMT-layerwise": ("KV_MLA_FMT", [C, 2 * L * H], 0),
    "KV_T2D": ("KV_T2D", [C, 2, L * H], 0),
    "KV_2TD": ("KV_2TD", [2, C, L * H], 1),
}

#: formats or ranks whose token dimension LMCache does not define: the exact full chunk only
EXACT_ONLY: dict[str, tuple[str, list[int]]] = {
    "UNDEFINED": ("UNDEFINED", [2, L, C, H]),
    "BINARY": ("BINARY", [C, 2 * L * H]),
    "BINARY_BUFFER": ("BINARY_BUFFER", [C, 2 * L * H]),
    "EC_TD": ("EC_TD", [C, 2 * L * H]),
    "HS_TD": ("HS_TD", [C, 2 * L * H]),
    "KV_MLA_FMT-rank-3": ("KV_MLA_FMT", [L, C, 2 * H]),
    "KV_2LTD-rank-3": ("KV_2LTD", [2 * L, C, H]),
    "KV_T2D-rank-4": ("KV_T2D", [1, C, 2, L * H]),
}


def _own(fmt_name: str, shape: list[int]) -> dict[str, Any]:
    from lmcache.v1.memory_management import MemoryFormat

    size = torch.Size(shape)
    return {
        "shapes": [size],
        "dtypes": [G.dtype],
        "fmt": MemoryFormat[fmt_name],
        "full_bytes": size.numel() * G.dtype.itemsize,
    }


def _stored(fmt_name: str, shape: list[int]) -> tuple[dict[str, Any], int]:
    """The entry metadata and length of a hit stored with ``shape`` (its bytes add up)."""
    from lmcache.v1.memory_management import MemoryFormat

    meta = {"fmt": MemoryFormat[fmt_name].value, "dtype": "bfloat16", "shape": shape}
    return meta, torch.Size(shape).numel() * G.dtype.itemsize


def _with(shape: list[int], dim: int, size: int) -> list[int]:
    out = list(shape)
    out[dim] = size
    return out


def _others(case: str) -> list[tuple[str, int, int]]:
    """Each non-token dimension of a layout, one smaller and one larger."""
    _, own, token_dim = LAYOUTS[case]
    return [
        (case, d, size)
        for d, n in enumerate(own)
        if d != token_dim
        for size in (n - 1, n + 1)
        if size > 0
    ]


def test_the_token_dimensions_are_lmcaches() -> None:
    """The table agrees with the shapes LMCache's own code gives each format's chunk."""
    from lmcache.v1.gpu_connector.gpu_connectors import (
        VLLMBufferLayerwiseGPUConnector,
        VLLMPagedMemLayerwiseGPUConnector,
    )
    from lmcache.v1.memory_management import MemoryFormat

    from kvgov.connectors.lmcache.connector import _token_dim

    for case, (fmt_name, own, token_dim) in LAYOUTS.items():
        assert _token_dim(MemoryFormat[fmt_name], len(own)) == token_dim, case
    for fmt_name, own in EXACT_ONLY.values():
        assert _token_dim(MemoryFormat[fmt_name], len(own)) is None, fmt_name

    # an object with only what ``get_shape`` reads: 7 tokens land where the table says
    def probe(cls: type, **attrs: Any) -> torch.Size:
        obj = object.__new__(cls)
        obj.__dict__.update(attrs)
        shape: torch.Size = obj.get_shape(7)
        return shape

    t2d = probe(VLLMPagedMemLayerwiseGPUConnector, use_mla=False, hidden_dim_size=H)
    mla = probe(VLLMPagedMemLayerwiseGPUConnector, use_mla=True, hidden_dim_size=H)
    two_td = probe(VLLMBufferLayerwiseGPUConnector, hidden_dim_size=H)
    assert t2d[_token_dim(MemoryFormat.KV_T2D, len(t2d)) or 0] == 7 and t2d[0] == 7
    assert mla[_token_dim(MemoryFormat.KV_MLA_FMT, len(mla)) or 0] == 7 and mla[0] == 7
    assert two_td[_token_dim(MemoryFormat.KV_2TD, len(two_td)) or 0] == 7 and two_td[1] == 7


@pytest.mark.parametrize("tokens", [1, C - 56, C])
@pytest.mark.parametrize("case", sorted(LAYOUTS))
def test_a_short_last_chunk_is_accepted_on_the_formats_token_dimension(
    case: str, tokens: int
) -> None:
    from kvgov.connectors.lmcache.connector import _hit_geometry

    fmt_name, own, token_dim = LAYOUTS[case]
    shape = _with(own, token_dim, tokens)
    meta, length = _stored(fmt_name, shape)
    assert _hit_geometry(meta, length, **_own(fmt_name, own)) == (torch.Size(shape), G.dtype)
    # stored without metadata: only a whole chunk of the engine's own
    full = _own(fmt_name, own)
    assert _hit_geometry({}, full["full_bytes"], **full) == (torch.Size(own), G.dtype)
    if tokens < C:
        assert _hit_geometry({}, length, **full) == "length"


@pytest.mark.parametrize("case", sorted(LAYOUTS))
def test_no_tokens_or_more_than_a_chunk_on_the_token_dimension_is_refused(case: str) -> None:
    from kvgov.connectors.lmcache.connector import _hit_geometry

    fmt_name, own, token_dim = LAYOUTS[case]
    for tokens in (0, C + 1, 2 * C):
        meta, length = _stored(fmt_name, _with(own, token_dim, tokens))
        assert _hit_geometry(meta, length, **_own(fmt_name, own)) == "tokens", tokens


@pytest.mark.parametrize(
    ("case", "dim", "size"), [o for case in sorted(LAYOUTS) for o in _others(case)]
)
def test_a_change_in_any_other_dimension_is_refused(case: str, dim: int, size: int) -> None:
    """E.g. a KV_T2D ``[tokens, 2, hidden]`` hit with less hidden: not "fewer tokens"."""
    from kvgov.connectors.lmcache.connector import _hit_geometry

    fmt_name, own, token_dim = LAYOUTS[case]
    for tokens in (own[token_dim], own[token_dim] // 2):
        meta, length = _stored(fmt_name, _with(_with(own, token_dim, tokens), dim, size))
        assert _hit_geometry(meta, length, **_own(fmt_name, own)) == "shape", (tokens, meta)


@pytest.mark.parametrize("case", sorted(EXACT_ONLY))
def test_a_format_of_no_known_token_dimension_takes_only_the_exact_full_chunk(case: str) -> None:
    from kvgov.connectors.lmcache.connector import _hit_geometry

    fmt_name, own = EXACT_ONLY[case]
    full = _own(fmt_name, own)
    meta, length = _stored(fmt_name, own)
    assert _hit_geometry(meta, length, **full) == (torch.Size(own), G.dtype)
    assert _hit_geometry({}, full["full_bytes"], **full) == (torch.Size(own), G.dtype)
    for d, n in enumerate(own):
        for size in (n // 2, n - 1, n + 1):
            if size <= 0 or size == n:
                continue
            meta, length = _stored(fmt_name, _with(own, d, size))
            assert _hit_geometry(meta, length, **full) == "shape", (d, size)


@pytest.mark.parametrize("case", sorted(LAYOUTS))
def test_an_engine_of_each_format_allocates_its_short_chunk_and_refuses_the_rest(
    case: str, engine_at: Callable[[FakeSidecar], h.Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through a real engine's connector given that format's geometry: a short last chunk is
    allocated as stored; a hit differing in another dimension is a miss, counted in
    ``refused_hits``, with nothing allocated."""
    from lmcache.v1.memory_management import MemoryFormat

    fmt_name, own, token_dim = LAYOUTS[case]
    fmt = MemoryFormat[fmt_name]
    with fake_sidecar() as fake:
        conn = engine_at(fake).remote_connector()
        geometry = _own(fmt_name, own)
        assert geometry["full_bytes"] == int(conn.full_chunk_size_bytes)
        monkeypatch.setattr(conn, "meta_fmt", fmt)
        monkeypatch.setattr(conn, "meta_shapes", geometry["shapes"])
        allocations: list[tuple[Any, ...]] = []
        real_allocate = conn.local_cpu_backend.allocate

        def allocate(*args: Any, **kwargs: Any) -> Any:
            allocations.append(args)
            return real_allocate(*args, **kwargs)

        monkeypatch.setattr(conn.local_cpu_backend, "allocate", allocate)

        short = _with(own, token_dim, C - 56)
        meta, length = _stored(fmt_name, short)
        obj = conn._allocate(GetResult("k", length, meta))
        assert obj is not None
        try:
            assert obj.meta.shape == torch.Size(short)
            assert obj.meta.fmt == fmt
            assert obj.get_size() == length
        finally:
            obj.ref_count_down()
        assert len(allocations) == 1 and conn.refused_hits == 0

        for n, (_, dim, size) in enumerate(_others(case), start=1):
            meta, length = _stored(fmt_name, _with(short, dim, size))
            assert conn._allocate(GetResult("k", length, meta)) is None
            assert conn.refused_hits == n
        assert len(allocations) == 1  # nothing allocated for any refused hit

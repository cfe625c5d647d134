"""Text the edge validators did not expect: lone surrogates and non-ASCII digits.

Attacks: JSON metadata may carry ``"\\ud800"``, which ``json.loads`` turns into a lone
surrogate that no UTF-8 encoder (nor the ledger) accepts: in the HELLO token or version
(before authentication), in a key or a context string. A key's number fields may hold digits
of other scripts: ``"²".isdigit()`` is True but ``int("²")`` fails, ``int("\\u0661")`` reads 1.
Each crashed the connection handler (no ERROR frame, a full traceback logged at ERROR for every
connection, ``dataplane.connection.failed``) or parsed a key LMCache never writes.

The door holds when each is refused the protocol's usual way (an ERROR frame, or a per-key
``malformed_key`` denial that is recorded), the connection stays usable where other bad
requests leave it usable, and nothing is logged at ERROR.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvgov.proxy.dataplane.server import WireServer
from kvgov.types import EventKind, Outcome
from kvgov.wire.codec import HEADER, ErrorCode, FrameType, WireError, encode_meta, valid_key
from kvgov.wire.messages import RequestContext, parse_cache_key
from tests.security import doors
from tests.security.doors import MODEL, LmClient, RawWire, key, run

pytestmark = pytest.mark.postgres

HEAD = f"{MODEL}@1@0@1f2c@bfloat16"
#: a layer field of a superscript two: ``isdigit()`` but not ``int()``-able
SUPERSCRIPT_KEY = f"{HEAD}@\u00b2@tenant%acme"
SURROGATE = "\\ud800"  # as it travels in JSON text


def _frame(ftype: FrameType, sid: int, meta_json: str, payload: bytes = b"") -> bytes:
    """A frame whose metadata is the JSON text given (a lone surrogate stays escaped)."""
    body = meta_json.encode()
    return HEADER.pack(b"KVGV", 1, ftype, 0, sid, len(body), len(payload)) + body + payload


async def _denials(sc: Any) -> list[Any]:
    assert sc.writer is not None
    await sc.writer.flush()
    return doors.events(sc, EventKind.KV_DENIED)


@pytest.mark.parametrize(
    ("hello", "expected"),
    [
        pytest.param(f'{{"version":1,"engine":"x","token":"{SURROGATE}"}}', "unauthenticated"),
        pytest.param(f'{{"version":1,"engine":"x","token":"tok-{SURROGATE}"}}', "unauthenticated"),
        pytest.param(
            f'{{"version":"{SURROGATE}","engine":"x","token":"tok-acme"}}', "version_mismatch"
        ),
    ],
    ids=["token", "token-suffix", "version"],
)
async def test_a_surrogate_before_hello_is_an_error_frame_not_a_crash(
    tmp_path: Path,
    prod_db: doors.ProdDatabase,
    caplog: pytest.LogCaptureFixture,
    hello: str,
    expected: str,
) -> None:
    """Before authentication: the usual ERROR frame, the connection closed, no traceback;
    the sidecar still serves an honest engine."""
    caplog.set_level(logging.INFO)
    async with doors.sidecar(tmp_path, prod_db) as sc:
        port = sc.server.tcp_port
        assert port is not None
        raw = RawWire(port)
        try:
            raw.send_raw(_frame(FrameType.HELLO, 1, hello))
            answer = await run(raw.read)
            assert answer.error == expected, answer
            assert await run(raw.closed_by_peer)
        finally:
            raw.close()
        honest = doors.engine(sc, "tok-acme")
        try:
            ctx = RequestContext(request_id="after", tenant="acme")
            assert (await run(honest.put, key(9, "acme"), b"v" * 64, ctx)).ok
        finally:
            honest.close()
    assert not doors.error_logs(caplog.records), [
        r.getMessage() for r in doors.error_logs(caplog.records)
    ]


@pytest.mark.parametrize(
    ("ftype", "meta_json", "payload"),
    [
        pytest.param(
            FrameType.EXISTS, f'{{"keys":["{HEAD}@tenant%{SURROGATE}"]}}', b"", id="exists"
        ),
        pytest.param(FrameType.GET, f'{{"keys":["{HEAD}@tenant%acme{SURROGATE}"]}}', b"", id="get"),
        pytest.param(FrameType.REMOVE, f'{{"keys":["{SURROGATE}"]}}', b"", id="remove"),
        pytest.param(
            FrameType.PUT,
            f'{{"items":[{{"key":"{HEAD}@tenant%{SURROGATE}","len":8}}]}}',
            b"12345678",
            id="put-key",
        ),
        pytest.param(
            FrameType.PUT,
            f'{{"items":[{{"key":"{HEAD}@tenant%acme","len":8}}],'
            f'"ctx":{{"tenant":"acme","request_id":"r{SURROGATE}"}}}}',
            b"12345678",
            id="put-ctx",
        ),
        pytest.param(
            FrameType.EXISTS,
            f'{{"keys":["{HEAD}@tenant%acme"],"ctx":{{"user":"{SURROGATE}"}}}}',
            b"",
            id="exists-ctx",
        ),
    ],
)
async def test_a_surrogate_after_hello_is_a_bad_request_and_the_connection_lives(
    tmp_path: Path,
    prod_db: doors.ProdDatabase,
    caplog: pytest.LogCaptureFixture,
    ftype: FrameType,
    meta_json: str,
    payload: bytes,
) -> None:
    """A key or context string holding a lone surrogate: ``bad_request`` (as an oversize or
    NUL key is), nothing stored or recorded under it, and the next PING is answered."""
    caplog.set_level(logging.INFO)
    async with doors.sidecar(tmp_path, prod_db) as sc:
        port = sc.server.tcp_port
        assert port is not None
        raw = RawWire(port)
        try:
            assert (await run(raw.hello, "tok-acme")).error is None
            raw.send_raw(_frame(ftype, 2, meta_json, payload))
            answer = await run(raw.read)
            assert answer.error == "bad_request", answer
            raw.send(FrameType.PING, 3, {})
            pong = await run(raw.read)
            assert pong.error is None
            assert (pong.type, pong.stream_id) == (FrameType.PING, 3)
        finally:
            raw.close()
        assert not doors.events(sc, EventKind.KV_PUT)
    assert not doors.error_logs(caplog.records), [
        r.getMessage() for r in doors.error_logs(caplog.records)
    ]


async def test_a_superscript_layer_key_is_a_recorded_malformed_key_on_the_wire(
    tmp_path: Path, prod_db: doors.ProdDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    """EXISTS and GET of a key whose layer is ``²``: a per-key denial (not found, no bytes),
    recorded as ``malformed_key`` like any other unparsable key; the connection lives."""
    caplog.set_level(logging.INFO)
    async with doors.sidecar(tmp_path, prod_db) as sc:
        port = sc.server.tcp_port
        assert port is not None
        raw = RawWire(port)
        try:
            assert (await run(raw.hello, "tok-acme")).error is None
            raw.send_raw(_frame(FrameType.EXISTS, 2, json.dumps({"keys": [SUPERSCRIPT_KEY]})))
            exists = await run(raw.read)
            assert exists.error is None, exists
            assert exists.meta == {"found": [False]}
            raw.send_raw(_frame(FrameType.GET, 3, json.dumps({"keys": [SUPERSCRIPT_KEY]})))
            got = await run(raw.read)
            assert got.error is None, got
            assert got.payload == b""
            raw.send(FrameType.PING, 4, {})
            assert (await run(raw.read)).error is None
        finally:
            raw.close()
        denied = await _denials(sc)
    assert len(denied) == 2, [(e.reason, e.principal) for e in denied]
    assert {(e.reason, e.principal, e.outcome) for e in denied} == {
        ("malformed_key", "engine:vllm-acme", Outcome.DENY)
    }
    assert not doors.error_logs(caplog.records), [
        r.getMessage() for r in doors.error_logs(caplog.records)
    ]


async def test_a_superscript_layer_key_is_a_recorded_malformed_key_on_lm(
    tmp_path: Path, prod_db: doors.ProdDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    """The same key on ``lm://``: answered as a miss, recorded, and the connection still
    serves the declared engine's honest put and get."""
    caplog.set_level(logging.INFO)
    async with doors.sidecar(
        tmp_path,
        prod_db,
        lm_host="127.0.0.1",
        lm_port=0,
        lm_engine_id="lm-acme",
        lm_tenants=["acme"],
    ) as sc:
        assert sc.lm_server is not None
        lm = LmClient(sc.lm_server.port)
        try:
            assert await run(lm.exists, SUPERSCRIPT_KEY) is False
            assert await run(lm.get, SUPERSCRIPT_KEY) is None
            own = key(5, "acme")
            await run(lm.put, own, b"z" * 4096)
            assert await run(lm.get, own) == b"z" * 4096
        finally:
            lm.close()
        denied = await _denials(sc)
    assert len(denied) == 2, [(e.reason, e.principal) for e in denied]
    assert {(e.reason, e.principal, e.outcome) for e in denied} == {
        ("malformed_key", "lm:lm-acme", Outcome.DENY)
    }
    assert not doors.error_logs(caplog.records), [
        r.getMessage() for r in doors.error_logs(caplog.records)
    ]


# -- the parsers themselves ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        f"{HEAD}@\u00b2@tenant%acme",  # superscript two: isdigit(), int() refuses
        f"{HEAD}@\u0663@tenant%acme",  # Arabic-Indic three: int() reads 3
        f"{HEAD}@\uff13@tenant%acme",  # fullwidth three
        f"{MODEL}@\u0661@0@ff@half@tenant%acme",  # world size
        f"{MODEL}@1@\u00b9@ff@half@tenant%acme",  # worker id
        f"{MODEL}@+1@0@ff@half@tenant%acme",
        f"{MODEL}@-1@0@ff@half@tenant%acme",
        f"{MODEL}@ 1@0@ff@half@tenant%acme",
        f"{MODEL}@1_0@0@ff@half@tenant%acme",
        f"{MODEL}@{'9' * 5000}@0@ff@half@tenant%acme",  # past int()'s digit limit
    ],
    ids=[
        "layer-superscript",
        "layer-arabic-indic",
        "layer-fullwidth",
        "world-arabic-indic",
        "worker-superscript",
        "world-plus",
        "world-minus",
        "world-space",
        "world-underscore",
        "world-5000-digits",
    ],
)
def test_key_number_fields_are_ascii_digits_only(raw: str) -> None:
    with pytest.raises(WireError) as err:
        parse_cache_key(raw)
    assert err.value.error is ErrorCode.BAD_REQUEST


def test_ascii_number_fields_still_parse() -> None:
    parsed = parse_cache_key(f"{MODEL}@12@3@ff@half@07@tenant%acme")
    assert (parsed.world_size, parsed.worker_id, parsed.layer) == (12, 3, 7)
    assert parsed.tenant == "acme"


def test_surrogates_are_not_keys_or_strings() -> None:
    lone = json.loads(f'"{SURROGATE}"')
    assert not valid_key(f"{HEAD}@tenant%{lone}")
    assert valid_key(f"{HEAD}@tenant%acme")
    with pytest.raises(WireError) as err:
        RequestContext.from_meta({"request_id": lone})
    assert err.value.error is ErrorCode.BAD_REQUEST
    # a reply that echoes one still encodes (JSON escapes it) and reads back the same
    assert json.loads(encode_meta({"message": lone})) == {"message": lone}


@pytest.mark.parametrize("engine", ["eng\ud800", "eng\x00"], ids=["surrogate", "nul"])
def test_an_engine_id_that_is_not_text_authenticates_nothing(engine: str) -> None:
    """Where the engine id becomes the identity (no tokens: a local peer or anonymous), one
    the ledger cannot record is refused."""
    server: Any = SimpleNamespace(
        config=SimpleNamespace(engine_tokens={}, allow_anonymous=True),
        _token_ids={},
        tokens_configured=False,
    )
    conn: Any = SimpleNamespace(unix=False, peer_uid=None)
    with pytest.raises(WireError) as err:
        WireServer.authenticate(server, {"engine": engine}, conn)
    assert err.value.error is ErrorCode.UNAUTHENTICATED
    assert WireServer.authenticate(server, {"engine": "eng"}, conn).engine == "eng"

"""The wire codec: headers, metadata and cache-key strings round-trip and reject garbage."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvgov.wire.codec import (
    HEADER_SIZE,
    ErrorCode,
    Flag,
    FrameType,
    WireError,
    decode_header,
    decode_meta,
    encode_frame,
    encode_header,
    error_from_meta,
    error_meta,
)
from kvgov.wire.messages import RequestContext, parse_cache_key, parse_put_items


def test_header_round_trip() -> None:
    raw = encode_header(FrameType.PUT, 77, 12, 32 << 20, Flag.REPLY)
    assert len(raw) == HEADER_SIZE == 24
    header = decode_header(raw)
    assert header.type is FrameType.PUT
    assert header.stream_id == 77
    assert header.meta_len == 12
    assert header.payload_len == 32 << 20
    assert header.is_reply


def test_frame_carries_meta() -> None:
    frame = encode_frame(FrameType.GET, 3, {"keys": ["a"], "ctx": {"user": "ü"}})
    header = decode_header(frame)
    assert decode_meta(frame[HEADER_SIZE:]) == {"keys": ["a"], "ctx": {"user": "ü"}}
    assert header.meta_len == len(frame) - HEADER_SIZE


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (b"XXXX" + encode_header(FrameType.PING, 1, 0)[4:], ErrorCode.BAD_FRAME),
        (encode_header(FrameType.PING, 1, 0)[:4] + b"\x09" + bytes(19), ErrorCode.VERSION_MISMATCH),
        (encode_header(FrameType.PING, 1, 2 << 20), ErrorCode.TOO_LARGE),
        (encode_header(FrameType.PING, 1, 0)[:10], ErrorCode.BAD_FRAME),
    ],
)
def test_bad_headers_are_rejected(raw: bytes, code: ErrorCode) -> None:
    with pytest.raises(WireError) as info:
        decode_header(raw)
    assert info.value.error is code
    assert info.value.fatal


def test_payload_limit() -> None:
    with pytest.raises(WireError) as info:
        decode_header(encode_header(FrameType.PUT, 1, 0, 100), max_payload=99)
    assert info.value.error is ErrorCode.TOO_LARGE


def test_unknown_type_and_flags() -> None:
    raw = bytearray(encode_header(FrameType.PING, 1, 0))
    raw[5] = 99
    with pytest.raises(WireError):
        decode_header(raw)
    raw = bytearray(encode_header(FrameType.PING, 1, 0))
    raw[6] = 0x80
    with pytest.raises(WireError):
        decode_header(raw)


@pytest.mark.parametrize("body", [b"[1]", b"{", b"\xff\xfe", b"null"])
def test_meta_must_be_json_object(body: bytes) -> None:
    with pytest.raises(WireError) as info:
        decode_meta(body)
    assert info.value.error is ErrorCode.BAD_FRAME


def test_error_meta_round_trip() -> None:
    err = error_from_meta(error_meta(ErrorCode.BUSY, "draining"))
    assert err.error is ErrorCode.BUSY
    assert not err.fatal
    assert error_from_meta({"code": 1234}).error is ErrorCode.INTERNAL


def test_parse_cache_key_tags() -> None:
    key = parse_cache_key(
        "meta-llama/Llama-3.1-8B@1@0@1f2c0f2eb05c3455@bfloat16@tenant%acme@user%u42"
    )
    assert key.model == "meta-llama/Llama-3.1-8B"
    assert key.tenant == "acme"
    assert key.user == "u42"
    assert key.layer is None
    layered = parse_cache_key("m@2@1@ff@half@3@tenant%t")
    assert layered.layer == 3
    assert layered.tenant == "t"
    assert layered.user is None


@pytest.mark.parametrize(
    "raw",
    [
        "m@1@0@ff",
        "m@x@0@ff@half",
        "m@1@0@ff@half@tenant",
        "m@1@0@ff@half@tenant%a@tenant%b",
        "@1@0@ff@h",
    ],
)
def test_parse_cache_key_rejects(raw: str) -> None:
    with pytest.raises(WireError):
        parse_cache_key(raw)


def test_put_items_must_add_up() -> None:
    meta = {"items": [{"key": "k1", "len": 3}, {"key": "k2", "len": 4, "ctx": {"user": "u"}}]}
    items = parse_put_items(meta, 7, 10)
    assert [i.length for i in items] == [3, 4]
    assert items[1].ctx == RequestContext(user="u")
    with pytest.raises(WireError) as info:
        parse_put_items(meta, 8, 10)
    assert info.value.error is ErrorCode.BAD_REQUEST
    with pytest.raises(WireError):
        parse_put_items({"items": [{"key": "k", "len": True}]}, 1, 10)


@given(st.binary(min_size=0, max_size=64))
def test_decode_header_never_crashes(data: bytes) -> None:
    with contextlib.suppress(WireError):
        decode_header(data, max_payload=1 << 20)


@given(st.binary(max_size=256))
def test_decode_meta_never_crashes(data: bytes) -> None:
    with contextlib.suppress(WireError):
        decode_meta(data)

"""The kvgov wire protocol's frame codec (stdlib only; see ``docs/protocol.md``).

A frame is a fixed 24-byte little-endian header, a metadata section (a UTF-8 JSON object of
``meta_len`` bytes) and a raw payload of ``payload_len`` bytes::

    magic "KVGV" | version u8 | type u8 | flags u16 | stream id u32 | meta_len u32 | payload_len u64

The metadata always comes before the payload, so a receiver knows every item's key, length
and request context before the first KV byte arrives and can decide (policy, destination
buffer, key) while the bytes are still on the wire.

This module must stay importable inside an inference engine: no third-party imports.
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from enum import IntEnum, IntFlag
from typing import Any, TypeGuard

from kvgov.errors import ProtocolError

MAGIC = b"KVGV"
PROTOCOL_VERSION = 1
#: ``<4sBBHIIQ``: magic, version, type, flags, stream id, meta length, payload length
HEADER = struct.Struct("<4sBBHIIQ")
HEADER_SIZE = HEADER.size  # 24
#: hard limit on the metadata section (JSON); keys and contexts are small
MAX_META_BYTES = 1 << 20
#: stream ids are u32; 0 is reserved for frames that answer no request (fatal errors)
MAX_STREAM_ID = 0xFFFF_FFFF
#: LMCache's key string limit is 150 bytes; kvgov allows longer keys but bounds them
MAX_KEY_BYTES = 1024
#: digits of an integer in metadata where the interpreter does not bound them itself
#: (:func:`decode_meta`): a u64 has 20 (no field carries more). Python ints are unbounded, and
#: converting a long literal costs time superlinear in its length
MAX_INT_DIGITS = 20


class FrameType(IntEnum):
    """What a frame asks for. A reply has the request's type and the REPLY flag (or is ERROR)."""

    HELLO = 1
    PING = 2
    EXISTS = 3
    GET = 4
    PUT = 5
    REMOVE = 6
    EVICT = 7  # server -> engine, on a control connection
    EVICT_ACK = 8  # engine -> server, same stream id as the EVICT
    GET_END = 9  # server -> engine, after a GET reply that said "tail" (feature "late_miss")
    ERROR = 15


#: the protocol features this code speaks, offered in HELLO and agreed in its reply:
#: ``late_miss``: a GET hit may be withdrawn after it was announced (``docs/protocol.md``)
LATE_MISS = "late_miss"
FEATURES = frozenset({LATE_MISS})


class Flag(IntFlag):
    NONE = 0
    REPLY = 1


class ErrorCode(IntEnum):
    """Explicit error codes, in ERROR frames and per item of batched replies (0 = ok)."""

    OK = 0
    BAD_FRAME = 1  # fatal: malformed header or metadata; the connection is closed
    TOO_LARGE = 2  # fatal: frame over the server's limits; the connection is closed
    UNAUTHENTICATED = 3  # fatal: HELLO missing or refused
    DENIED = 4  # per item: policy or identity refused the operation
    NOT_FOUND = 5  # per item: a miss (a denied get is also reported as a miss)
    INTERNAL = 6  # the server failed; the request may be retried
    VERSION_MISMATCH = 7  # fatal: protocol version not supported
    BUSY = 8  # the server is shedding load or shutting down; retry later
    BAD_REQUEST = 9  # a well-formed frame with invalid content (not fatal)


#: errors after which the server closes the connection
FATAL_ERRORS = frozenset(
    {
        ErrorCode.BAD_FRAME,
        ErrorCode.TOO_LARGE,
        ErrorCode.UNAUTHENTICATED,
        ErrorCode.VERSION_MISMATCH,
    }
)


class WireError(ProtocolError):
    """A protocol-level failure with its wire :class:`ErrorCode`."""

    code = "wire_error"

    def __init__(self, error: ErrorCode, message: str, *, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.error = error

    @property
    def fatal(self) -> bool:
        return self.error in FATAL_ERRORS


class WireConnectionError(WireError):
    """The connection failed, timed out or was closed: its state is unknown, it is discarded."""

    code = "wire_connection"


@dataclass(frozen=True, slots=True)
class FrameHeader:
    type: FrameType
    flags: Flag
    stream_id: int
    meta_len: int
    payload_len: int
    version: int = PROTOCOL_VERSION

    @property
    def is_reply(self) -> bool:
        return bool(self.flags & Flag.REPLY)


def encode_header(
    ftype: FrameType,
    stream_id: int,
    meta_len: int,
    payload_len: int = 0,
    flags: Flag = Flag.NONE,
) -> bytes:
    return HEADER.pack(
        MAGIC, PROTOCOL_VERSION, int(ftype), int(flags), stream_id, meta_len, payload_len
    )


def decode_header(
    data: bytes | bytearray | memoryview,
    *,
    max_payload: int | None = None,
    max_meta: int = MAX_META_BYTES,
) -> FrameHeader:
    """Parse and validate the 24-byte header. Raises :class:`WireError` (always fatal)."""
    if len(data) < HEADER_SIZE:
        raise WireError(ErrorCode.BAD_FRAME, "short frame header")
    magic, version, ftype, flags, stream_id, meta_len, payload_len = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise WireError(ErrorCode.BAD_FRAME, "bad magic")
    if version != PROTOCOL_VERSION:
        raise WireError(
            ErrorCode.VERSION_MISMATCH,
            f"protocol version {version} not supported (server speaks {PROTOCOL_VERSION})",
        )
    kind = _FRAME_TYPES.get(ftype)
    if kind is None:
        raise WireError(ErrorCode.BAD_FRAME, f"unknown frame type {ftype}")
    flag = _FLAGS.get(flags)
    if flag is None:
        raise WireError(ErrorCode.BAD_FRAME, "unknown flags")
    if meta_len > max_meta:
        raise WireError(ErrorCode.TOO_LARGE, "metadata section too large")
    if max_payload is not None and payload_len > max_payload:
        raise WireError(ErrorCode.TOO_LARGE, "payload too large")
    return FrameHeader(kind, flag, stream_id, meta_len, payload_len, version)


#: the frame types and flag sets a header may carry, by their numbers (looked up, not built:
#: an enum's constructor is two Python calls per frame, an ``IntFlag``'s more)
_FRAME_TYPES: dict[int, FrameType] = {int(t): t for t in FrameType}
_FLAGS: dict[int, Flag] = {int(f): f for f in (Flag.NONE, Flag.REPLY)}


def encode_meta(meta: Mapping[str, Any] | None) -> bytes:
    if not meta:
        return b""
    try:
        return json.dumps(meta, separators=(",", ":"), ensure_ascii=False).encode()
    except UnicodeEncodeError:
        # a string UTF-8 cannot carry (a lone surrogate a peer sent as ``"\ud800"``, echoed
        # in an error message): JSON's own escapes carry it, so the reply still goes out
        return json.dumps(meta, separators=(",", ":"), ensure_ascii=True).encode()


class _LongIntegerError(ValueError):
    """An integer literal of more than :data:`MAX_INT_DIGITS` digits."""


def _bounded_int(literal: str) -> int:
    if len(literal) > MAX_INT_DIGITS and len(literal.lstrip("-")) > MAX_INT_DIGITS:
        raise _LongIntegerError
    return int(literal)


#: the one parser of a peer's JSON (``json.loads`` would build a decoder per call)
_DECODER = json.JSONDecoder(parse_int=_bounded_int)


#: an interpreter that refuses integer literals longer than this (CPython's default: 4300
#: digits, ``sys.int_max_str_digits``) bounds the cost of converting one itself
_CAPPED_DIGITS = 4300


def decode_meta(data: bytes | bytearray | memoryview) -> dict[str, Any]:
    """Parse a metadata section: empty or a JSON object. Raises :class:`WireError`
    (``BAD_FRAME``) on anything else, whatever the peer sent: this is where its bytes become
    values. An integer too long to convert is one: beyond the interpreter's own cap
    (``sys.int_max_str_digits``, 4300 digits by default: its ``ValueError``); in a process that
    lifted or raised that cap, beyond :data:`MAX_INT_DIGITS` (a slower parser then converts
    each integer itself, so the default keeps ``json``'s C path: ~1.5 us less per PUT frame,
    ~40 us per 32-item one)."""
    if len(data) == 0:
        return {}
    raw = bytes(data)
    try:
        if 0 < sys.get_int_max_str_digits() <= _CAPPED_DIGITS:
            value = json.loads(raw)
        else:  # what ``json.loads`` does with bytes, with the bounded decoder
            value = _DECODER.decode(raw.decode(json.detect_encoding(raw), "surrogatepass"))
    except _LongIntegerError:
        raise WireError(
            ErrorCode.BAD_FRAME, f"metadata holds an integer of more than {MAX_INT_DIGITS} digits"
        ) from None
    except (ValueError, RecursionError) as exc:
        # ValueError: JSONDecodeError, UnicodeDecodeError, and any other the parser raises
        raise WireError(ErrorCode.BAD_FRAME, "metadata is not valid JSON") from exc
    if not isinstance(value, dict):
        raise WireError(ErrorCode.BAD_FRAME, "metadata must be a JSON object")
    return value


def encode_frame(
    ftype: FrameType,
    stream_id: int,
    meta: Mapping[str, Any] | None = None,
    payload_len: int = 0,
    flags: Flag = Flag.NONE,
) -> bytes:
    """Header plus metadata; the caller sends ``payload_len`` payload bytes after it."""
    body = encode_meta(meta)
    if len(body) > MAX_META_BYTES:
        raise WireError(ErrorCode.TOO_LARGE, "metadata section too large")
    return encode_header(ftype, stream_id, len(body), payload_len, flags) + body


def error_meta(error: ErrorCode, message: str) -> dict[str, Any]:
    return {"code": int(error), "name": error.name.lower(), "message": message}


def error_from_meta(meta: Mapping[str, Any]) -> WireError:
    """Turn an ERROR frame's metadata into the matching exception."""
    raw = meta.get("code", int(ErrorCode.INTERNAL))
    try:
        error = ErrorCode(raw)
    except ValueError:
        error = ErrorCode.INTERNAL
    return WireError(error, str(meta.get("message", error.name.lower())))


# -- metadata field helpers (shared by client and server) -------------------------------------
# Strings never carry NUL: the ledger refuses it, so such a request is malformed at the edge.
# Nor a lone surrogate: JSON's ``"\ud800"`` escape decodes to one, but it is no text UTF-8 (or
# the ledger) can hold, so a peer's string is measured with :func:`utf8`, never encoded bare.


def utf8(value: str) -> bytes | None:
    """``value`` encoded as UTF-8, or None if it is not text (it holds a lone surrogate)."""
    try:
        return value.encode()
    except UnicodeEncodeError:
        return None


def _fits(value: str, max_len: int) -> bool:
    """Text (see :func:`utf8`) of at most ``max_len`` UTF-8 bytes, without NUL."""
    if "\x00" in value:
        return False
    data = utf8(value)
    return data is not None and len(data) <= max_len


def valid_key(key: object) -> TypeGuard[str]:
    """A non-empty string of at most :data:`MAX_KEY_BYTES`, without NUL or lone surrogates (no
    ledger could record it faithfully)."""
    return isinstance(key, str) and bool(key) and _fits(key, MAX_KEY_BYTES)


def require_str(meta: Mapping[str, Any], name: str, *, max_len: int = MAX_KEY_BYTES) -> str:
    value = meta.get(name)
    if not isinstance(value, str) or not value or not _fits(value, max_len):
        raise WireError(ErrorCode.BAD_REQUEST, f"field {name!r} must be a non-empty string")
    return value


def optional_str(meta: Mapping[str, Any], name: str, *, max_len: int = 256) -> str | None:
    value = meta.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or not _fits(value, max_len):
        raise WireError(ErrorCode.BAD_REQUEST, f"field {name!r} must be a string")
    return value or None


def key_list(meta: Mapping[str, Any], name: str = "keys", *, max_items: int = 4096) -> list[str]:
    value = meta.get(name)
    if not isinstance(value, list) or not value or len(value) > max_items:
        raise WireError(ErrorCode.BAD_REQUEST, f"field {name!r} must be a non-empty list")
    out: list[str] = []
    for key in value:
        if not valid_key(key):
            raise WireError(ErrorCode.BAD_REQUEST, "keys must be non-empty strings")
        out.append(key)
    return out


#: the send buffer both ends ask for on a Unix-socket connection (the kernel caps it at
#: ``net.core.wmem_max``)
UNIX_SEND_BUFFER = 4 << 20


def widen_unix_send_buffer(sock: socket.socket) -> None:
    """Ask for a :data:`UNIX_SEND_BUFFER` send buffer on a Unix socket (others: nothing).

    A Unix socket's send buffer is what may be in flight to the peer; at its default (~208 KiB)
    a 32 MiB chunk takes ~150 writes and wake-ups each way. TCP autotunes its own. Best effort:
    a refusal leaves the default."""
    if sock.family == socket.AF_UNIX:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, UNIX_SEND_BUFFER)

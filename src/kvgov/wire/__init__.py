"""The kvgov wire protocol: frame codec, message records and clients (stdlib only).

Importable inside an inference engine without pulling in the sidecar: nothing here imports
anything beyond the standard library and :mod:`kvgov.errors`. See ``docs/protocol.md``.
"""

from kvgov.wire.client import WireClient
from kvgov.wire.codec import ErrorCode, FrameType, WireConnectionError, WireError
from kvgov.wire.control import ControlChannel
from kvgov.wire.digest import KeyDigester
from kvgov.wire.messages import (
    CacheKey,
    EvictRequest,
    GetResult,
    PutAck,
    RequestContext,
    ServerInfo,
    parse_cache_key,
)

__all__ = [
    "CacheKey",
    "ControlChannel",
    "ErrorCode",
    "EvictRequest",
    "FrameType",
    "GetResult",
    "KeyDigester",
    "PutAck",
    "RequestContext",
    "ServerInfo",
    "WireClient",
    "WireConnectionError",
    "WireError",
    "parse_cache_key",
]

"""The connector's own settings, read from LMCache's ``extra_config`` (stdlib only).

LMCache hands every plugin the whole engine config; kvgov's keys live under ``kvgov.*`` in its
``extra_config`` so they sit beside the plugin registration in one yaml file::

    extra_config:
      remote_storage_plugin.kvgov.module_path: kvgov.connectors.lmcache
      remote_storage_plugin.kvgov.class_name: KvgovConnector
      kvgov.endpoint: unix:///run/kvgov/data.sock   # or tcp://127.0.0.1:7070
      kvgov.token: <engine token>             # or kvgov.token_file: /etc/kvgov/engine/token
      kvgov.engine_id: vllm-0
      kvgov.sidecar_uids: [65532]             # no token, a Unix socket: who the sidecar runs as
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvgov.errors import ConfigError

PREFIX = "kvgov."


@dataclass(frozen=True)
class ConnectorSettings:
    endpoint: str
    engine_id: str = "lmcache"
    token: str | None = None
    #: bound on each request to the sidecar, from sending it to its reply fully read (one
    #: deadline, not per socket read: a slow or dripping sidecar becomes a miss)
    timeout_s: float = 5.0
    connect_timeout_s: float = 0.5
    pool_size: int = 4
    #: after a connection failure, skip the sidecar for this long, doubling up to the maximum
    backoff_initial_s: float = 0.2
    backoff_max_s: float = 5.0
    #: open the control connection that receives EVICT (purge) messages
    control: bool = True
    control_reconnect_s: float = 1.0
    #: upper bound on the bytes of one PUT/GET frame the connector builds
    max_frame_bytes: int = 128 * 1024 * 1024
    #: a batched put is split into frames of about this size, sent in parallel
    put_frame_bytes: int = 32 * 1024 * 1024
    #: without a token, the uids the process at a Unix-socket endpoint may run as (checked by
    #: the kernel's SO_PEERCRED before anything is sent); None: the engine's own uid or root
    sidecar_uids: frozenset[int] | None = None

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        """Build from LMCache's ``extra_config``; raises :class:`ConfigError` if unusable."""
        extra = extra or {}
        endpoint = extra.get(PREFIX + "endpoint")
        if not isinstance(endpoint, str) or not endpoint:
            raise ConfigError(
                "kvgov connector needs kvgov.endpoint in LMCache's extra_config",
                hint="e.g. kvgov.endpoint: unix:///run/kvgov/data.sock or tcp://127.0.0.1:7070",
            )
        token = extra.get(PREFIX + "token")
        token_file = extra.get(PREFIX + "token_file")
        if token and token_file:
            raise ConfigError("set kvgov.token or kvgov.token_file, not both")
        if token_file:
            token = _read_token_file(str(token_file))
        return cls(
            endpoint=endpoint,
            engine_id=str(extra.get(PREFIX + "engine_id") or "lmcache"),
            token=str(token) if token else None,
            timeout_s=_number(extra, "timeout_s", cls.timeout_s),
            connect_timeout_s=_number(extra, "connect_timeout_s", cls.connect_timeout_s),
            pool_size=int(_number(extra, "pool_size", cls.pool_size)),
            backoff_initial_s=_number(extra, "backoff_initial_s", cls.backoff_initial_s),
            backoff_max_s=_number(extra, "backoff_max_s", cls.backoff_max_s),
            control=_flag(extra, "control", default=cls.control),
            control_reconnect_s=_number(extra, "control_reconnect_s", cls.control_reconnect_s),
            max_frame_bytes=int(_number(extra, "max_frame_bytes", cls.max_frame_bytes)),
            put_frame_bytes=int(_number(extra, "put_frame_bytes", cls.put_frame_bytes)),
            sidecar_uids=_uids(extra.get(PREFIX + "sidecar_uids")),
        )


def _read_token_file(path: str) -> str:
    """The engine token held in ``path`` (a mounted Secret), surrounding whitespace ignored.
    Errors name the file, never its content."""
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ConfigError(f"cannot read kvgov.token_file {path}: {reason}") from None
    if not token:
        raise ConfigError(f"kvgov.token_file {path} is empty", hint="it must hold the engine token")
    return token


def _uids(raw: Any) -> frozenset[int] | None:
    """``kvgov.sidecar_uids``: a list of uids (or one, or a comma-separated string of them)."""
    if raw is None:
        return None
    items = raw.split(",") if isinstance(raw, str) else raw if isinstance(raw, list) else [raw]
    uids: set[int] = set()
    for item in items:
        try:
            uid = int(str(item).strip())
        except ValueError:
            raise ConfigError("kvgov.sidecar_uids must be a list of uids (integers)") from None
        if uid < 0:
            raise ConfigError("kvgov.sidecar_uids must be a list of uids (integers)")
        uids.add(uid)
    if not uids:
        raise ConfigError("kvgov.sidecar_uids is empty", hint="name the sidecar's uid, or unset it")
    return frozenset(uids)


def _number(extra: Mapping[str, Any], name: str, default: float) -> float:
    raw = extra.get(PREFIX + name, default)
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"kvgov.{name} must be a number") from None
    if value <= 0:
        raise ConfigError(f"kvgov.{name} must be positive")
    return value


def _flag(extra: Mapping[str, Any], name: str, *, default: bool) -> bool:
    raw = extra.get(PREFIX + name, default)
    if isinstance(raw, bool):
        return raw
    return str(raw).strip().lower() in {"1", "true", "yes", "on"}

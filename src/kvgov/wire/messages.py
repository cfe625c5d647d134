"""Typed records carried in frame metadata, and LMCache cache-key strings (stdlib only).

Shared by the client (:mod:`kvgov.wire.client`) and the sidecar's server, so both sides build
and read the same JSON shapes documented in ``docs/protocol.md``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvgov.wire.codec import ErrorCode, WireError, optional_str, valid_key
from kvgov.wire.digest import KeyDigester, is_digest

K = TypeVar("K")

#: the small per-entry metadata an engine may attach to a put (fmt/dtype/shape...); bounded
MAX_ITEM_META_BYTES = 1024
#: the longest request id and tenant the ledger records (its columns, ``kvgov.db.models``):
#: a longer one is a bad request at the edge, not an event the database refuses later
MAX_REQUEST_ID = 128
MAX_TENANT = 128


@dataclass(frozen=True, slots=True)
class RequestContext:
    """Who a KV operation is for: the request, the acting user and the sensitivity label.

    ``user`` is the raw user id as the engine knows it; the sidecar pseudonymises it on
    arrival and never stores or logs it.
    """

    request_id: str | None = None
    user: str | None = None
    sensitivity: str | None = None
    #: the tenant the gateway authenticated for this request (checked against the key's tag)
    tenant: str | None = None

    def to_meta(self) -> dict[str, str]:
        out: dict[str, str] = {}
        if self.request_id:
            out["request_id"] = self.request_id
        if self.user:
            out["user"] = self.user
        if self.sensitivity:
            out["sensitivity"] = self.sensitivity
        if self.tenant:
            out["tenant"] = self.tenant
        return out

    @classmethod
    def from_meta(cls, meta: object) -> RequestContext:
        if meta is None:
            return EMPTY_CONTEXT
        if not (isinstance(meta, dict) or isinstance(meta, Mapping)):  # noqa: SIM101 (as above)
            raise WireError(ErrorCode.BAD_REQUEST, "ctx must be an object")
        return cls(
            request_id=optional_str(meta, "request_id", max_len=MAX_REQUEST_ID),
            user=optional_str(meta, "user"),
            sensitivity=optional_str(meta, "sensitivity", max_len=64),
            tenant=optional_str(meta, "tenant", max_len=MAX_TENANT),
        )


EMPTY_CONTEXT = RequestContext()


@dataclass(frozen=True, slots=True)
class PutItem:
    """One item of a PUT: its key, byte length and optional entry metadata."""

    key: str
    length: int
    meta: Mapping[str, Any] = field(default_factory=dict)
    ctx: RequestContext | None = None  # overrides the frame's context for this item

    def to_meta(self) -> dict[str, Any]:
        out: dict[str, Any] = {"key": self.key, "len": self.length}
        if self.meta:
            out["meta"] = dict(self.meta)
        if self.ctx is not None:
            out["ctx"] = self.ctx.to_meta()
        return out


@dataclass(frozen=True, slots=True)
class PutAck:
    """The server's answer for one put item: stored (``ok``) or why not."""

    key: str
    error: ErrorCode
    reason: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is ErrorCode.OK


@dataclass(frozen=True, slots=True)
class GetResult:
    """A hit: how many bytes were written and the metadata stored with the entry."""

    key: str
    length: int
    meta: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class ServerInfo:
    """What HELLO's reply says about the sidecar."""

    server: str
    version: str
    protocol: int
    sidecar_id: str
    max_frame_bytes: int
    max_batch: int
    engine: str
    #: the sidecar's key digester (``key_digest_key``), given only on an authenticated
    #: control connection: it matches EVICT digests against the engine's local keys
    digester: KeyDigester | None = field(default=None, repr=False, compare=False)
    #: the protocol features the sidecar agreed to (of those the client offered)
    features: frozenset[str] = frozenset()

    @classmethod
    def from_reply(cls, reply: Mapping[str, Any]) -> ServerInfo:
        """Parse a HELLO reply. Raises :class:`WireError` (BAD_FRAME) when malformed."""
        try:
            key = reply.get("key_digest_key")
            features = reply.get("features", [])
            if not isinstance(features, list) or not all(isinstance(f, str) for f in features):
                raise TypeError("features")
            return cls(
                server=str(reply["server"]),
                version=str(reply["version"]),
                protocol=int(reply["protocol"]),
                sidecar_id=str(reply["sidecar"]),
                max_frame_bytes=int(reply["max_frame_bytes"]),
                max_batch=int(reply["max_batch"]),
                engine=str(reply["engine"]),
                digester=KeyDigester.from_hex(key) if isinstance(key, str) else None,
                features=frozenset(features),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise WireError(ErrorCode.BAD_FRAME, "malformed HELLO reply") from exc


#: digests per EVICT frame (a frame's metadata stays well under its 1 MiB limit)
MAX_EVICT_DIGESTS = 4096


def evict_meta(
    digests: Sequence[str], *, reason: str = "purge", job: str | None = None
) -> dict[str, Any]:
    """The metadata of an EVICT frame: the entries' key digests, never raw keys."""
    out: dict[str, Any] = {"digests": list(digests), "reason": reason}
    if job is not None:
        out["job"] = job
    return out


@dataclass(frozen=True, slots=True)
class EvictRequest:
    """An EVICT as the engine's callback sees it: the digests of the entries to remove and the
    sidecar's digester to recognise them among the engine's own keys."""

    digests: frozenset[str]
    digester: KeyDigester = field(repr=False)
    reason: str = "purge"
    job: str | None = None

    def matching(self, keys: Iterable[K]) -> list[tuple[K, str]]:
        """The ``(key, digest)`` pairs of ``keys`` (strings or LMCache keys) this EVICT names."""
        return self.digester.matching(self.digests, keys)


def parse_evict(meta: Mapping[str, Any]) -> list[str]:
    """The well-formed digests an EVICT names (anything else in the list is ignored)."""
    raw = meta.get("digests")
    if not isinstance(raw, list):
        return []
    return [d for d in raw if is_digest(d)]


def parse_put_items(meta: Mapping[str, Any], payload_len: int, max_items: int) -> list[PutItem]:
    """Validate a PUT's ``items``: lengths must add up to the payload. Raises BAD_REQUEST."""
    raw = meta.get("items")
    if not isinstance(raw, list) or not raw or len(raw) > max_items:
        raise WireError(ErrorCode.BAD_REQUEST, "items must be a non-empty list")
    items: list[PutItem] = []
    total = 0
    for entry in raw:
        # a decoded frame's objects are dicts: the C check first (``Mapping`` is an ABC, whose
        # isinstance is a Python call per item)
        if not (isinstance(entry, dict) or isinstance(entry, Mapping)):  # noqa: SIM101
            raise WireError(ErrorCode.BAD_REQUEST, "each item must be an object")
        key = entry.get("key")
        length = entry.get("len")
        if not valid_key(key):
            raise WireError(ErrorCode.BAD_REQUEST, "item key must be a non-empty string")
        if not isinstance(length, int) or isinstance(length, bool) or length < 0:
            raise WireError(ErrorCode.BAD_REQUEST, "item len must be a non-negative integer")
        item_meta = entry.get("meta") or {}
        if (
            not (isinstance(item_meta, dict) or isinstance(item_meta, Mapping))  # noqa: SIM101
            or len(repr(item_meta)) > MAX_ITEM_META_BYTES
        ):
            raise WireError(ErrorCode.BAD_REQUEST, "item meta must be a small object")
        ctx = RequestContext.from_meta(entry["ctx"]) if "ctx" in entry else None
        items.append(PutItem(key, length, dict(item_meta), ctx))
        total += length
    if total != payload_len:
        raise WireError(ErrorCode.BAD_REQUEST, "item lengths do not add up to the payload")
    return items


# -- LMCache cache-key strings ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CacheKey:
    """An LMCache ``CacheEngineKey`` string, parsed:
    ``model@world_size@worker_id@chunk_hash_hex@dtype[@layer][@tag%value...]``."""

    raw: str
    model: str
    world_size: int
    worker_id: int
    chunk_hash: str
    dtype: str
    layer: int | None
    tags: tuple[tuple[str, str], ...]

    def tag(self, name: str) -> str | None:
        for key, value in self.tags:
            if key == name:
                return value
        return None

    @property
    def tenant(self) -> str | None:
        return self.tag("tenant")

    @property
    def user(self) -> str | None:
        return self.tag("user")


def _decimal(text: str) -> int | None:
    """A key's number field: ASCII digits only (``int()`` also reads signs, spaces, ``_`` and
    other scripts' digits, and ``"²".isdigit()`` holds though ``int("²")`` fails), else None."""
    if not (text.isascii() and text.isdigit()):
        return None
    try:
        return int(text)
    except ValueError:  # more digits than ``int()`` reads (``sys.get_int_max_str_digits``)
        return None


@functools.lru_cache(1 << 16)
def parse_cache_key(raw: str) -> CacheKey:
    """Parse a key string; raises :class:`WireError` (BAD_REQUEST) if it is not one.

    A tag name may appear only once: two ``tenant`` tags would let a key claim two identities.
    Parsed keys are remembered (a bounded cache: the data path sees the same keys again).
    """
    parts = raw.split("@")
    if len(parts) < 5:
        raise WireError(ErrorCode.BAD_REQUEST, "not an LMCache cache key")
    model, world, worker, chunk_hash, dtype, *rest = parts
    if not model or not chunk_hash or not dtype:
        raise WireError(ErrorCode.BAD_REQUEST, "cache key has empty fields")
    world_size = _decimal(world)
    worker_id = _decimal(worker)
    if world_size is None or worker_id is None:
        raise WireError(ErrorCode.BAD_REQUEST, "cache key world size/worker not integers")
    layer: int | None = None
    if rest and (layer := _decimal(rest[0])) is not None:
        rest = rest[1:]
    tags: list[tuple[str, str]] = []
    seen: set[str] = set()
    for part in rest:
        name, sep, value = part.partition("%")
        if not sep or not name or "%" in value or name in seen:
            raise WireError(ErrorCode.BAD_REQUEST, "malformed cache key tag")
        seen.add(name)
        tags.append((name, value))
    return CacheKey(raw, model, world_size, worker_id, chunk_hash, dtype, layer, tuple(tags))

"""Keyed digests of cache key strings: one implementation for the sidecar and the engines.

The ledger, the sidecar's tiers and the EVICT message name a cache entry by the keyed digest of
its key string (``HMAC-SHA256(key_digest_key, domain || key)``, 64 hex characters), never by the
key itself: keys can carry raw user tags. The sidecar derives the key-digest key from its
pseudonym key (``kvgov.ledger.pseudonym``) and hands it to authenticated engines on their
control connection's HELLO reply, so an engine connector can match an EVICT's digests against
the keys in its own local tiers after any sidecar restart. An engine already sees every raw key
it caches, so the digest key tells it nothing new; it is not the pseudonym key, so it cannot
compute user pseudonyms. Standard library only (see ``docs/protocol.md``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterable
from typing import TypeVar

#: length of a key-digest key (HMAC-SHA256 output)
DIGEST_KEY_BYTES = 32
#: hex characters of a key digest
DIGEST_CHARS = 64
_DOMAIN = b"kvgov/cache-key/v1\x00"
_HEX = frozenset("0123456789abcdef")

K = TypeVar("K")


def is_digest(value: object) -> bool:
    """True for a well-formed key digest (64 lowercase hex characters)."""
    return isinstance(value, str) and len(value) == DIGEST_CHARS and set(value) <= _HEX


class KeyDigester:
    """Computes keyed digests of cache key strings. Thread-safe (holds only the key)."""

    __slots__ = ("_inner", "_key", "_outer")

    def __init__(self, key: bytes) -> None:
        if len(key) < 16:
            raise ValueError("key-digest key must be at least 16 bytes")
        self._key = bytes(key)
        # HMAC (RFC 2104) with its two keyed SHA-256 states computed once: a digest then costs
        # two state copies and two short hashes, ~3 us, where ``hmac.digest`` looks SHA-256 up
        # in OpenSSL 3 on every call (~14 us here)
        block = (self._key if len(self._key) <= 64 else hashlib.sha256(self._key).digest()).ljust(
            64, b"\0"
        )
        self._inner = hashlib.sha256(bytes(b ^ 0x36 for b in block) + _DOMAIN)
        self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in block))

    def __repr__(self) -> str:
        return "KeyDigester(<key hidden>)"

    @classmethod
    def from_hex(cls, text: str) -> KeyDigester:
        """The digester for a key sent as hex (HELLO reply). Raises ValueError if malformed."""
        key = bytes.fromhex(text)
        if len(key) != DIGEST_KEY_BYTES:
            raise ValueError("key-digest key has the wrong size")
        return cls(key)

    def to_hex(self) -> str:
        """The key as hex, for the HELLO reply to an authenticated engine only; never log it."""
        return self._key.hex()

    def digest(self, cache_key: str) -> str:
        """Keyed digest of a cache key string (64 hex characters)."""
        inner = self._inner.copy()
        inner.update(cache_key.encode("utf-8"))
        outer = self._outer.copy()
        outer.update(inner.digest())
        return outer.hexdigest()

    def matching(self, digests: Collection[str], keys: Iterable[K]) -> list[tuple[K, str]]:
        """The ``(key, digest)`` pairs of ``keys`` whose digest is in ``digests``.

        ``keys`` may be strings or objects whose ``str()`` (or ``to_string()``) is the key
        string, e.g. LMCache ``CacheEngineKey``s.
        """
        wanted = digests if isinstance(digests, set | frozenset) else set(digests)
        out: list[tuple[K, str]] = []
        if not wanted:
            return out
        for key in keys:
            raw = key if isinstance(key, str) else _key_text(key)
            d = self.digest(raw)
            if d in wanted:
                out.append((key, d))
        return out


def _key_text(key: object) -> str:
    to_string = getattr(key, "to_string", None)
    return str(to_string()) if callable(to_string) else str(key)

"""Pseudonyms for users and cache keys: keyed HMAC-SHA256, never plain hashes.

The ledger never holds a raw user id. ``Pseudonymizer.user(tenant, user_id)`` is a keyed,
tenant-bound HMAC, so the same user id in two tenants gives two unrelated pseudonyms and nobody
without the key can confirm a guess. Cache key strings can carry a raw user tag, so their
digests are keyed too (``key_digest``), with a separate **key-digest key** derived from the
pseudonym key (``HMAC(pseudonym_key, "kvgov/key-digest/v1")``): the sidecar gives that one to
authenticated engines so they can match EVICT digests against their local tiers
(:mod:`kvgov.wire.digest`), and it cannot compute user pseudonyms.

The key lives in a 0600 file at ``settings.pseudonym_key_path``, created by ``kvgov init``.
Destroying it unlinks every pseudonym from the person behind it.

Every process of a fleet must hold the same key, or one pod records users under pseudonyms no
purge can name. ``Pseudonymizer.key_id`` is the key's public name, what the ledger database pins
(:mod:`kvgov.ledger.keypin`): ``HMAC(pseudonym_key, "kvgov/pseudonym-key-id/v1")``, a keyed
one-way value that neither reveals the key nor lets anyone test a candidate user id.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import secrets
from collections.abc import Callable
from pathlib import Path

from kvgov.errors import StartupError
from kvgov.ledger.secretfile import create_private_file
from kvgov.privatefs import read_private_file
from kvgov.wire.digest import KeyDigester

KEY_BYTES = 32
#: hex characters of a user pseudonym (128 bits)
USER_PSEUDONYM_CHARS = 32
_USER_DOMAIN = b"kvgov/user/v1\x00"
_DIGEST_KEY_LABEL = b"kvgov/key-digest/v1"
_KEY_ID_LABEL = b"kvgov/pseudonym-key-id/v1"
#: hex characters of the key's id (128 bits)
KEY_ID_CHARS = 32
_FILE_HEADER = "kvgov-pseudonym-key-v1"
#: pseudonyms and key digests remembered per process (the data path asks for the same few
#: thousand keys and users again and again; an HMAC costs more than the lookup)
CACHE_ENTRIES = 1 << 16


class Pseudonymizer:
    """Keyed pseudonyms for user ids and cache keys. Thread-safe (holds the key and bounded
    caches of results: ``functools.lru_cache``)."""

    __slots__ = ("_digester", "_key", "_key_digest", "_user")

    def __init__(self, key: bytes) -> None:
        if len(key) < 16:
            raise ValueError("pseudonym key must be at least 16 bytes")
        self._key = bytes(key)
        self._digester = KeyDigester(derive_key_digest_key(self._key))
        self._user: Callable[[str, str], str] = functools.lru_cache(CACHE_ENTRIES)(self._compute)
        self._key_digest: Callable[[str], str] = functools.lru_cache(CACHE_ENTRIES)(
            self._digester.digest
        )

    def __repr__(self) -> str:
        return "Pseudonymizer(<key hidden>)"

    def user(self, tenant: str, user_id: str) -> str:
        """The pseudonym of ``user_id`` in ``tenant`` (32 hex characters)."""
        return self._user(tenant, user_id)

    def _compute(self, tenant: str, user_id: str) -> str:
        message = (
            _USER_DOMAIN
            + _length_prefixed(tenant.encode("utf-8"))
            + _length_prefixed(user_id.encode("utf-8"))
        )
        digest = hmac.new(self._key, message, hashlib.sha256).hexdigest()
        return digest[:USER_PSEUDONYM_CHARS]

    def key_digest(self, cache_key: str) -> str:
        """Keyed digest of a cache key string (64 hex characters), with the key-digest key."""
        return self._key_digest(cache_key)

    @property
    def key_digester(self) -> KeyDigester:
        """What computes :meth:`key_digest`: handed to authenticated engines (HELLO reply)."""
        return self._digester

    @property
    def key_id(self) -> str:
        """The key's fingerprint (32 hex characters): a label the key alone can compute, so the
        ledger can pin which key the fleet uses without holding anything that names a user."""
        return hmac.new(self._key, _KEY_ID_LABEL, hashlib.sha256).hexdigest()[:KEY_ID_CHARS]

    @classmethod
    def from_file(cls, path: Path) -> Pseudonymizer:
        return cls(load_pseudonym_key(path))


def derive_key_digest_key(pseudonym_key: bytes) -> bytes:
    """The key-digest key: a one-way function of the pseudonym key, for cache-key digests only."""
    return hmac.new(pseudonym_key, _DIGEST_KEY_LABEL, hashlib.sha256).digest()


def _length_prefixed(data: bytes) -> bytes:
    return len(data).to_bytes(4, "big") + data


def generate_pseudonym_key_file(path: Path) -> bool:
    """Create a fresh key file (0600) at ``path`` unless one exists. Returns True if created.

    An existing key is never overwritten: every pseudonym already recorded depends on it.
    """
    body = f"{_FILE_HEADER}\n{secrets.token_hex(KEY_BYTES)}\n".encode()
    return create_private_file(path, body)


def load_pseudonym_key(path: Path) -> bytes:
    """Read the key file; refuses a missing, malformed or group/world-readable file."""
    data = read_private_file(path, "pseudonym key file")
    try:
        lines = data.decode("ascii").split()
    except UnicodeDecodeError:
        raise StartupError(f"pseudonym key file {path} is not a kvgov pseudonym key") from None
    if len(lines) != 2 or lines[0] != _FILE_HEADER:
        raise StartupError(f"pseudonym key file {path} is not a kvgov pseudonym key")
    try:
        key = bytes.fromhex(lines[1])
    except ValueError:
        raise StartupError(f"pseudonym key file {path} is corrupt") from None
    if len(key) != KEY_BYTES:
        raise StartupError(f"pseudonym key file {path} holds a key of the wrong size")
    return key

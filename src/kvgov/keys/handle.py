"""A handle on one unwrapped data key version: what the sealing API takes.

The handle carries the key id and version (the caller records them with the entry), the tenant
and user scope the key belongs to, and the AES-256-GCM context. Key material never leaves it:
no accessor returns the DEK and ``repr`` shows only the id. When the key is shredded the
:class:`~kvgov.keys.keyring.Keyring` marks every live handle destroyed, so an operation still
holding one fails with :class:`~kvgov.errors.KeyDestroyedError` instead of using the key.
"""

from __future__ import annotations

from collections.abc import Callable

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvgov.errors import KeyDestroyedError

DEK_BYTES = 32


class KeyHandle:
    """One version of a data key, unwrapped, in memory only."""

    __slots__ = ("_aead", "_on_use", "key_id", "tenant", "user", "version")

    def __init__(
        self,
        key_id: str,
        version: int,
        tenant: str,
        user: str | None,
        dek: bytes,
        *,
        on_use: Callable[[KeyHandle], None] | None = None,
    ) -> None:
        if len(dek) != DEK_BYTES:
            raise ValueError("a data key is 32 bytes (AES-256)")
        self.key_id = key_id
        self.version = version
        self.tenant = tenant
        self.user = user
        self._aead: AESGCM | None = AESGCM(dek)
        self._on_use = on_use

    @property
    def aead(self) -> AESGCM:
        aead = self._aead
        if aead is None:
            raise KeyDestroyedError(
                f"data key {self.key_id} v{self.version} was destroyed (crypto-shredded)",
                hint="data sealed under it is unrecoverable by design",
            )
        return aead

    @property
    def destroyed(self) -> bool:
        return self._aead is None

    def note_use(self) -> None:
        """Count one sealed chunk against this version (the keyring batches it to the store)."""
        if self._on_use is not None:
            self._on_use(self)

    def destroy(self) -> None:
        """Drop the AES context; every later use raises :class:`KeyDestroyedError`."""
        self._aead = None
        self._on_use = None

    def __repr__(self) -> str:
        state = "destroyed" if self.destroyed else "live"
        return f"KeyHandle({self.key_id!r}, v{self.version}, {state})"

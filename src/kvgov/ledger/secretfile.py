"""Creating and reading the ledger's private key files (signing key, pseudonym key).

A key file is created once, 0600, with ``O_EXCL`` (never overwritten: what was signed or
pseudonymised with it depends on it) and fsynced; reading refuses a group- or world-readable
file.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kvgov.errors import StartupError


def create_private_file(path: Path, data: bytes) -> bool:
    """Write ``data`` to a new 0600 file; False (and nothing written) when it exists."""
    path = Path(path)
    if path.exists():
        return False
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    return True


def read_private_file(path: Path, what: str) -> bytes:
    """The bytes of a key file that only its owner can read (``what`` names it in errors)."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        data = path.read_bytes()
    except FileNotFoundError:
        raise StartupError(
            f"{what} not found: {path}", hint="run `kvgov init` to create it"
        ) from None
    except OSError as exc:
        raise StartupError(f"cannot read {what} {path}: {exc}") from exc
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise StartupError(f"{what} {path} is readable by others", hint=f"chmod 600 {path}")
    return data

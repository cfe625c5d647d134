"""Creating the ledger's private key files (signing key, pseudonym key).

A key file is created once, 0600, with ``O_EXCL`` (never overwritten: what was signed or
pseudonymised with it depends on it) and fsynced. Reading is
:func:`kvgov.privatefs.read_private_file` (the KEK's file too): it refuses a group- or
world-readable file, or one of another user.
"""

from __future__ import annotations

import os
from pathlib import Path


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

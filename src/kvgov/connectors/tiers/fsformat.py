"""The filesystem tier's on-disk format: file names, the fan-out, and the entry header.

Each entry is one file: a 24-byte header, the key (UTF-8), then the value exactly as given::

    magic "KVGT" | version u8 | flags u8 (bit 0: has expiry) | key length u16 |
    expires_at f64 | value length u64 | key | value

The key is repeated in the header so the index can be rebuilt from the files alone and a file
found under the wrong name is recognised.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
from pathlib import Path

from kvgov.connectors.tiers.base import EntryInfo

MAGIC = b"KVGT"
VERSION = 1
HEADER = struct.Struct("<4sBBHdQ")
_HAS_EXPIRY = 0x01
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_-]{1,200}")


class CorruptEntryError(Exception):
    """A file that does not hold what its name promises (truncated, foreign, wrong key)."""


def file_name(key: str) -> str:
    """The file name a key is stored under (the key itself when it is a plain token)."""
    if _PLAIN_NAME.fullmatch(key):
        return key
    return "~" + hashlib.blake2b(key.encode(), digest_size=20).hexdigest()


def fanout(key: str) -> str:
    """The two-hex-digit subdirectory a key's file lives in."""
    return hashlib.blake2b(key.encode(), digest_size=1).hexdigest()


def encode_header(key: str, size: int, expires_at: float | None) -> bytes:
    key_bytes = key.encode()
    flags = _HAS_EXPIRY if expires_at is not None else 0
    expiry = expires_at if expires_at is not None else 0.0
    return HEADER.pack(MAGIC, VERSION, flags, len(key_bytes), expiry, size) + key_bytes


def footprint(key: str, size: int, block: int) -> int:
    """The disk space of the file of a ``size``-byte value under ``key``: its header, key and
    value, rounded up to whole blocks of ``block`` bytes (as ``du``, and a kubelet measuring
    an emptyDir, count it)."""
    length = HEADER.size + len(key.encode()) + size
    return -(-length // block) * block


def write_all(fd: int, data: memoryview) -> None:
    done = 0
    while done < data.nbytes:
        done += os.write(fd, data[done:])


def fsync_dir(path: str | Path, *, dir_fd: int | None = None) -> None:
    """fsync a directory (``path`` relative to ``dir_fd`` if given; never through a symlink)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_exact(fd: int, n: int) -> bytes:
    data = os.read(fd, n)
    if len(data) != n:
        raise CorruptEntryError("short header")
    return data


def read_header(fd: int) -> tuple[str, int, float | None]:
    """Key, value length and expiry from the header at the start of ``fd``."""
    magic, version, flags, key_len, expiry, size = HEADER.unpack(_read_exact(fd, HEADER.size))
    if magic != MAGIC or version != VERSION:
        raise CorruptEntryError("not a kvgov tier file")
    try:
        key = _read_exact(fd, key_len).decode()
    except UnicodeDecodeError as exc:
        raise CorruptEntryError("bad key") from exc
    if os.fstat(fd).st_size != HEADER.size + key_len + size:
        raise CorruptEntryError("length mismatch")
    return key, size, (expiry if flags & _HAS_EXPIRY else None)


def parse_file(path: str | Path, *, dir_fd: int | None = None) -> tuple[str, EntryInfo]:
    """Key and index entry from a file's header (``path`` relative to ``dir_fd`` if given;
    never through a symlink)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        key, size, expires_at = read_header(fd)
    finally:
        os.close(fd)
    return key, EntryInfo(size, expires_at)

"""The filesystem tier: one file per key under a root directory, written atomically.

Layout: ``<root>/<xx>/<name>`` where ``xx`` is a one-byte BLAKE2b fan-out of the key and
``name`` is the key itself when it is a plain token (the data plane's keys are hex digests) or
``~`` + a BLAKE2b digest of it otherwise. Each file is a small header, the key, then the value
exactly as given (the pipeline gives ciphertext; this tier never sees plaintext); the format is
in :mod:`~kvgov.connectors.tiers.fsformat`.

A put writes ``.<name>.<random>.tmp`` beside the target, fsyncs it (``fsync=True``), renames it
over the target and fsyncs the directory, so a crash leaves the old value or the new one, never
a torn one. Opening the tier rebuilds the in-memory index by scanning the root, removing stray
temporary files and files that do not parse; a read that finds a file corrupt (its header does
not parse, its length disagrees with the file or with what was put) removes it and raises
:class:`~kvgov.errors.CorruptValueError`. File I/O runs in a small thread pool; ``get_into``
reads straight into the caller's buffer (``readinto``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import os
import re
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TypeVar

from kvgov.connectors.tiers.base import (
    BytesLike,
    DestinationTooSmallError,
    EntryInfo,
    TierStats,
    as_bytes_view,
    check_key,
)
from kvgov.connectors.tiers.fsformat import (
    CorruptEntryError,
    encode_header,
    fanout,
    file_name,
    fsync_dir,
    parse_file,
    read_header,
    write_all,
)
from kvgov.errors import CorruptValueError, TierError

log = logging.getLogger(__name__)

_T = TypeVar("_T")

_FANOUT_DIR = re.compile(r"[0-9a-f]{2}")


class FilesystemTier:
    """A :class:`~kvgov.connectors.tiers.base.Tier` of files. Build it with :meth:`open`."""

    def __init__(
        self,
        root: Path,
        *,
        name: str = "filesystem",
        fsync: bool = True,
        io_threads: int = 4,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._root = root
        self._name = name
        self._fsync = fsync
        self._clock = clock
        self._pool = concurrent.futures.ThreadPoolExecutor(io_threads, f"kvgov-tier-{name}")
        self._lock = threading.Lock()  # guards the index, the byte count and renames
        self._index: dict[str, EntryInfo] = {}
        self._bytes = 0
        self._hits = self._misses = self._expirations = 0
        self._closed = False

    @classmethod
    async def open(
        cls,
        root: Path,
        *,
        name: str = "filesystem",
        fsync: bool = True,
        io_threads: int = 4,
        clock: Callable[[], float] = time.time,
    ) -> FilesystemTier:
        """Create ``root`` if needed and rebuild the index from what is on disk."""
        tier = cls(root, name=name, fsync=fsync, io_threads=io_threads, clock=clock)
        try:
            await tier._run(tier._recover)
        except BaseException:
            tier._pool.shutdown(wait=False)
            raise
        return tier

    @property
    def name(self) -> str:
        return self._name

    @property
    def root(self) -> Path:
        return self._root

    def path_of(self, key: str) -> Path:
        """Where ``key``'s file lives (whether or not it exists)."""
        return self._root / fanout(key) / file_name(key)

    # -- the Tier protocol -------------------------------------------------------------------

    async def put(self, key: str, data: BytesLike, *, expires_at: float | None = None) -> None:
        self._check_open()
        check_key(self._name, key)
        if expires_at is not None and (math.isnan(expires_at) or expires_at <= self._clock()):
            await self._run(self._unlink, key)
            return
        await self._run(self._write, key, as_bytes_view(data), expires_at)

    async def get_into(self, key: str, dst: memoryview) -> int | None:
        meta = await self._live(key)
        if meta is None:
            self._misses += 1
            return None
        if meta.size > dst.nbytes:
            raise DestinationTooSmallError(self._name, meta.size, dst.nbytes)
        size = await self._run(self._read_into, key, dst)
        if size is None:
            self._misses += 1
        else:
            self._hits += 1
        return size

    async def get(self, key: str) -> bytes | None:
        meta = await self._live(key)
        data = None if meta is None else await self._run(self._read_all, key)
        if data is None:
            self._misses += 1
        else:
            self._hits += 1
        return data

    async def size_of(self, key: str) -> int | None:
        meta = await self._live(key)
        return None if meta is None else meta.size

    async def info(self, key: str) -> EntryInfo | None:
        return await self._live(key)

    async def contains(self, key: str) -> bool:
        return await self._live(key) is not None

    async def delete(self, key: str) -> bool:
        self._check_open()
        meta = await self._run(self._unlink, key)
        return meta is not None and not self._expired(meta, self._clock())

    async def iter_keys(self) -> AsyncIterator[str]:
        self._check_open()
        now = self._clock()
        with self._lock:
            snapshot = [k for k, m in self._index.items() if not self._expired(m, now)]
        for key in snapshot:
            yield key

    async def sweep(self, now: float) -> list[str]:
        self._check_open()
        with self._lock:
            due = [k for k, m in self._index.items() if self._expired(m, now)]
        if not due:
            return []
        removed = await self._run(self._unlink_many, due, now)
        self._expirations += len(removed)
        return removed

    async def stats(self) -> TierStats:
        with self._lock:
            entries, nbytes = len(self._index), self._bytes
        return TierStats(
            name=self._name,
            entries=entries,
            bytes=nbytes,
            hits=self._hits,
            misses=self._misses,
            evictions=0,
            expirations=self._expirations,
        )

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await asyncio.to_thread(self._pool.shutdown, wait=True)

    # -- event-loop side helpers -------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TierError(f"tier {self._name} is closed")

    @staticmethod
    def _expired(meta: EntryInfo, now: float) -> bool:
        return meta.expires_at is not None and meta.expires_at <= now

    async def _live(self, key: str) -> EntryInfo | None:
        """The index entry if live; an expired one is removed (from disk too) and is a miss."""
        self._check_open()
        meta = self._index.get(key)
        if meta is None or not self._expired(meta, self._clock()):
            return meta
        if await self._run(self._unlink_many, [key], self._clock()):
            self._expirations += 1
        return None

    async def _run(self, fn: Callable[..., _T], *args: object) -> _T:
        """Run blocking I/O in the pool. If the caller is cancelled, wait for the worker to
        finish first: it may be reading from or writing into the caller's buffer."""
        fut = asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            while not fut.done():
                try:
                    await asyncio.wait([fut])
                except asyncio.CancelledError:
                    continue
            if not fut.cancelled():
                fut.exception()  # retrieved: the cancellation is what the caller sees
            raise

    # -- worker-thread side ------------------------------------------------------------------

    def _write(self, key: str, data: memoryview, expires_at: float | None) -> None:
        path = self.path_of(key)
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            fd = self._create(tmp)
            try:
                write_all(fd, memoryview(encode_header(key, data.nbytes, expires_at)))
                write_all(fd, data)
                if self._fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            with self._lock:
                tmp.replace(path)
                old = self._index.get(key)
                self._index[key] = EntryInfo(data.nbytes, expires_at)
                self._bytes += data.nbytes - (old.size if old else 0)
            if self._fsync:
                fsync_dir(path.parent)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise TierError(f"tier {self._name}: write failed: {exc.strerror}") from exc

    def _create(self, tmp: Path) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        try:
            return os.open(tmp, flags, 0o600)
        except FileNotFoundError:
            tmp.parent.mkdir(mode=0o700, exist_ok=True)
            if self._fsync:
                fsync_dir(self._root)
            return os.open(tmp, flags, 0o600)

    def _open_entry(self, key: str) -> tuple[int, int] | None:
        """An open fd positioned at the value, and the value length; None if the file is gone.

        A file that does not hold what was put under ``key`` (a header that does not parse, a
        length that disagrees with the file or with the length put, another key) is removed
        and :class:`CorruptValueError` raised: the caller records it (not a plain miss)."""
        path = self.path_of(key)
        try:
            with self._lock:  # the file and the index entry of one put (a put renames under it)
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                put = self._index.get(key)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise TierError(f"tier {self._name}: read failed: {exc.strerror}") from exc
        try:
            stored_key, size, _expiry = read_header(fd)
            if stored_key != key:
                raise CorruptEntryError("key mismatch")
            if put is not None and put.size != size:
                raise CorruptEntryError("length differs from the value put")
        except CorruptEntryError as exc:
            os.close(fd)
            self._drop_corrupt(key, path, str(exc))
            raise CorruptValueError(
                f"tier {self._name}: stored file is corrupt ({exc}); it was removed"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        return fd, size

    def _read_into(self, key: str, dst: memoryview) -> int | None:
        opened = self._open_entry(key)
        if opened is None:
            return None
        fd, size = opened
        try:
            if size > dst.nbytes:  # replaced by a larger value since the index was read
                raise DestinationTooSmallError(self._name, size, dst.nbytes)
            with os.fdopen(fd, "rb", buffering=0, closefd=False) as f:
                done = 0
                target = dst[:size]
                while done < size:
                    got = f.readinto(target[done:])
                    if not got:
                        raise TierError(f"tier {self._name}: value shrank while being read")
                    done += got
            return size
        finally:
            os.close(fd)

    def _read_all(self, key: str) -> bytes | None:
        opened = self._open_entry(key)
        if opened is None:
            return None
        fd, size = opened
        try:
            data = os.read(fd, size) if size else b""
            while len(data) < size:
                more = os.read(fd, size - len(data))
                if not more:
                    raise TierError(f"tier {self._name}: value shrank while being read")
                data += more
            return data
        finally:
            os.close(fd)

    def _unlink(self, key: str) -> EntryInfo | None:
        path = self.path_of(key)
        with self._lock:
            meta = self._index.pop(key, None)
            if meta is not None:
                self._bytes -= meta.size
            try:
                path.unlink()
            except FileNotFoundError:
                return meta
            except OSError as exc:
                raise TierError(f"tier {self._name}: delete failed: {exc.strerror}") from exc
        if self._fsync:
            fsync_dir(path.parent)
        return meta

    def _unlink_many(self, keys: list[str], now: float) -> list[str]:
        """Remove the given keys that are still expired at ``now`` (a put may have renewed one)."""
        removed = []
        for key in keys:
            meta = self._index.get(key)
            if meta is None or not self._expired(meta, now):
                continue
            with self._lock:  # re-check under the lock: a concurrent put may have landed
                current = self._index.get(key)
                if current is None or not self._expired(current, now):
                    continue
            if self._unlink(key) is not None:
                removed.append(key)
        return removed

    def _drop_corrupt(self, key: str, path: Path, why: str) -> None:
        log.warning("tier.corrupt_entry", extra={"tier": self._name, "why": why})
        with self._lock:
            meta = self._index.pop(key, None)
            if meta is not None:
                self._bytes -= meta.size
            path.unlink(missing_ok=True)

    def _recover(self) -> None:
        """Rebuild the index from disk; remove temporary leftovers and unreadable files."""
        try:
            self._root.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise TierError(f"tier {self._name}: cannot create {self._root}: {exc}") from exc
        stray = corrupt = 0
        for sub in sorted(self._root.iterdir()):
            if not sub.is_dir() or not _FANOUT_DIR.fullmatch(sub.name):
                continue
            for path in sub.iterdir():
                if path.name.endswith(".tmp"):
                    path.unlink(missing_ok=True)
                    stray += 1
                    continue
                try:
                    key, meta = parse_file(path)
                except (CorruptEntryError, OSError):
                    path.unlink(missing_ok=True)
                    corrupt += 1
                    continue
                if self.path_of(key) != path:
                    path.unlink(missing_ok=True)
                    corrupt += 1
                    continue
                self._index[key] = meta
                self._bytes += meta.size
        log.info(
            "tier.recovered",
            extra={
                "tier": self._name,
                "entries": len(self._index),
                "bytes": self._bytes,
                "stray_tmp_removed": stray,
                "corrupt_removed": corrupt,
            },
        )

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

The root must be the process's own and private; it is opened once and every path is relative
to that descriptor; a fan-out directory is used only once checked ours (at start, or at the
first put that needs it): :mod:`~kvgov.connectors.tiers.fsroot`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import math
import os
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
    read_header,
    write_all,
)
from kvgov.connectors.tiers.fsroot import make_fanout, open_root, scan
from kvgov.errors import CorruptValueError, TierError

log = logging.getLogger(__name__)

_T = TypeVar("_T")

#: what a process that does not own the tier (``kvgov purge`` beside a running sidecar) takes
#: for a crash's leftover: a put's temporary file lives for the length of one write
STRAY_MIN_AGE_S = 600.0

_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


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
        #: leftovers younger than this are not removed at open (see :meth:`open`)
        self._stray_min_age_s = 0.0
        #: the root, opened and checked by ``fsroot.open_root``; every path is relative to it
        self._root_fd = -1
        #: fan-out directories checked to be our own and private (a put lstats only a new one)
        self._fanouts: set[str] = set()

    @classmethod
    async def open(
        cls,
        root: Path,
        *,
        name: str = "filesystem",
        fsync: bool = True,
        io_threads: int = 4,
        clock: Callable[[], float] = time.time,
        stray_min_age_s: float = 0.0,
    ) -> FilesystemTier:
        """Create ``root`` if needed and rebuild the index from what is on disk.
        ``stray_min_age_s``: remove only leftovers (``*.tmp``) at least that old; a process
        other than the sidecar that owns the tier (``kvgov purge``) must not take the
        sidecar's puts in progress for a crash's leftovers (:data:`STRAY_MIN_AGE_S`)."""
        tier = cls(root, name=name, fsync=fsync, io_threads=io_threads, clock=clock)
        tier._stray_min_age_s = stray_min_age_s
        try:
            await tier._run(tier._recover)
        except BaseException:
            tier._pool.shutdown(wait=False)
            if tier._root_fd >= 0:
                os.close(tier._root_fd)
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
        if self._root_fd >= 0:
            os.close(self._root_fd)
            self._root_fd = -1

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
        sub, name = fanout(key), file_name(key)
        if sub not in self._fanouts:
            self._check_fanout(sub)
        path, tmp = f"{sub}/{name}", f"{sub}/.{name}.{secrets.token_hex(6)}.tmp"
        root = self._root_fd
        try:
            fd = self._create(sub, tmp)
            try:
                write_all(fd, memoryview(encode_header(key, data.nbytes, expires_at)))
                write_all(fd, data)
                if self._fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            with self._lock:
                os.replace(tmp, path, src_dir_fd=root, dst_dir_fd=root)
                old = self._index.get(key)
                self._index[key] = EntryInfo(data.nbytes, expires_at)
                self._bytes += data.nbytes - (old.size if old else 0)
            if self._fsync:
                fsync_dir(sub, dir_fd=root)
        except OSError as exc:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=root)
            raise TierError(f"tier {self._name}: write failed: {exc.strerror}") from exc

    def _create(self, sub: str, tmp: str) -> int:
        try:
            return os.open(tmp, _CREATE_FLAGS, 0o600, dir_fd=self._root_fd)
        except FileNotFoundError:  # its fan-out directory was removed since it was checked
            self._fanouts.discard(sub)
            self._check_fanout(sub)
            return os.open(tmp, _CREATE_FLAGS, 0o600, dir_fd=self._root_fd)

    def _check_fanout(self, sub: str) -> None:
        """Use ``<root>/<sub>`` only once made or found ours and private; the check is
        remembered (nobody else can replace it in our root), so a put does not repeat it."""
        try:
            why = make_fanout(self._root_fd, sub, fsync=self._fsync)
        except OSError as exc:
            raise TierError(f"tier {self._name}: write failed: {exc.strerror}") from exc
        if why is None:
            self._fanouts.add(sub)
            return
        raise TierError(
            f"tier {self._name}: {self._root / sub} is not this process's own and private"
            f" ({why}); nothing is written through it",
            hint=f"remove {self._root / sub}: kvgov makes its own (0700) at the next put",
        )

    def _entry(self, key: str) -> tuple[str, str] | None:
        """A key's fan-out directory and file path (relative to the root), or None when that
        directory is not one checked ours: a file there is none of ours to read or delete."""
        sub = fanout(key)
        if sub not in self._fanouts:
            return None
        return sub, f"{sub}/{file_name(key)}"

    def _open_entry(self, key: str) -> tuple[int, int] | None:
        """An open fd positioned at the value, and the value length; None if the file is gone.

        A file that does not hold what was put under ``key`` (a header that does not parse, a
        length that disagrees with the file or with the length put, another key) is removed
        and :class:`CorruptValueError` raised: the caller records it (not a plain miss)."""
        entry = self._entry(key)
        if entry is None:
            return None
        path = entry[1]
        try:
            with self._lock:  # the file and the index entry of one put (a put renames under it)
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._root_fd)
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
        entry = self._entry(key)
        with self._lock:
            meta = self._index.pop(key, None)
            if meta is not None:
                self._bytes -= meta.size
            if entry is None:
                return meta
            try:
                os.unlink(entry[1], dir_fd=self._root_fd)
            except FileNotFoundError:
                return meta
            except OSError as exc:
                raise TierError(f"tier {self._name}: delete failed: {exc.strerror}") from exc
        if self._fsync:
            fsync_dir(entry[0], dir_fd=self._root_fd)
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

    def _drop_corrupt(self, key: str, path: str, why: str) -> None:
        log.warning("tier.corrupt_entry", extra={"tier": self._name, "why": why})
        with self._lock:
            meta = self._index.pop(key, None)
            if meta is not None:
                self._bytes -= meta.size
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path, dir_fd=self._root_fd)

    def _recover(self) -> None:
        """Open the root (:func:`~kvgov.connectors.tiers.fsroot.open_root`) and rebuild the
        index from disk, removing temporary leftovers and unreadable files of our own."""
        self._root_fd = open_root(self._root, self._name)
        try:
            found = scan(self._root_fd, stray_min_age_s=self._stray_min_age_s)
        except OSError as exc:
            raise TierError(
                f"tier {self._name}: cannot read {self._root}: {exc.strerror or exc}"
            ) from exc
        self._index = found.entries
        self._bytes = sum(meta.size for meta in found.entries.values())
        self._fanouts = found.fanouts
        if found.untrusted or found.kept:
            log.warning(
                "tier.untrusted_skipped",
                extra={
                    "tier": self._name,
                    "fanout_dirs": found.untrusted,
                    "entries_kept": found.kept,
                    "hint": "remove them: only the sidecar's own files and 0700 directories"
                    " belong in the tier root",
                },
            )
        log.info(
            "tier.recovered",
            extra={
                "tier": self._name,
                "entries": len(self._index),
                "bytes": self._bytes,
                "stray_tmp_removed": found.stray,
                "young_tmp_kept": found.young,
                "corrupt_removed": found.corrupt,
                "untrusted_skipped": len(found.untrusted) + found.kept,
            },
        )

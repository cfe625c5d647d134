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

**Disk bound** (``max_bytes``; the sidecar always sets one: ``tiers.filesystem_max_bytes``).
The tier counts the disk space of its files (header, key and value rounded up to whole
blocks: :func:`~kvgov.connectors.tiers.fsformat.footprint`), those of the puts being written
(their temporary files) and of the evicted files not yet removed; opening it counts what it
finds. Before a put would pass the bound, its least recently used entries (a put or a read
makes an entry the most recent; at start, the files' modification times order them) are taken
out of the index, reported to ``on_evict`` on the event loop (the sidecar records each as
``kv:evict``, as the memory tier's) and their files removed by the put's worker before it
writes. The key being put and those of other puts in progress are never chosen. A value
larger than the bound, or a put that finds the room all held by puts in progress, is refused
with :class:`~kvgov.errors.TierError` (a chain then removes the key from every tier). Least
recently used rather than soonest to expire: the policy gives every entry of a class the same
TTL, so expiry order is put order, which drops a hot shared prefix first and, across classes,
a value just written before an old one. A tier found over its bound at start (the bound
lowered) is brought within it by its next put.
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
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TypeVar

from kvgov.connectors.tiers.base import (
    BytesLike,
    DestinationTooSmallError,
    EntryInfo,
    EvictListener,
    TierStats,
    as_bytes_view,
    check_key,
    notify_evict,
)
from kvgov.connectors.tiers.fsformat import (
    CorruptEntryError,
    encode_header,
    fanout,
    file_name,
    footprint,
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

#: the block size counted where the filesystem does not say (``statvfs``)
DEFAULT_BLOCK = 4096


class _Ticket:
    """What one put holds of the bound until its file is in the index (or it failed):
    ``need``, its file's footprint; ``held``, counted meanwhile: until the files evicted for
    it are removed, the larger of theirs and ``need`` (its worker removes them before it
    writes, so the two never take the disk at once), then ``need``."""

    __slots__ = ("held", "need")

    def __init__(self, need: int) -> None:
        self.need = need
        self.held = 0


#: an evicted entry whose file is still to be removed: key, index entry, footprint
_Victim = tuple[str, EntryInfo, int]


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
        max_bytes: int | None = None,
        on_evict: EvictListener | None = None,
    ) -> None:
        if max_bytes is not None and max_bytes <= 0:
            raise TierError(f"tier {name}: max_bytes must be positive, not {max_bytes}")
        self._root = root
        self._name = name
        self._fsync = fsync
        self._clock = clock
        self._max = max_bytes
        self._on_evict = on_evict
        self._pool = concurrent.futures.ThreadPoolExecutor(io_threads, f"kvgov-tier-{name}")
        self._lock = threading.Lock()  # guards the index, the byte counts, renames and unlinks
        #: least recently used first
        self._index: OrderedDict[str, EntryInfo] = OrderedDict()
        self._bytes = 0  # the indexed values' lengths (stats)
        self._disk = 0  # the indexed files' footprints
        #: held by puts in progress (their ``_Ticket.held``): their temporary files, or the
        #: files evicted for them not yet removed
        self._pending = 0
        self._stranded = 0  # footprints of evicted files whose removal failed
        #: keys with puts in progress (how many of each): never evicted meanwhile
        self._putting: dict[str, int] = {}
        self._block = DEFAULT_BLOCK
        self._hits = self._misses = self._evictions = self._expirations = 0
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
        max_bytes: int | None = None,
        on_evict: EvictListener | None = None,
    ) -> FilesystemTier:
        """Create ``root`` if needed and rebuild the index from what is on disk.
        ``stray_min_age_s``: remove only leftovers (``*.tmp``) at least that old; a process
        other than the sidecar that owns the tier (``kvgov purge``) must not take the
        sidecar's puts in progress for a crash's leftovers (:data:`STRAY_MIN_AGE_S`).
        ``max_bytes``: the disk bound (None: none); ``on_evict(tier, key, nbytes)`` hears of
        each entry evicted for it, on the event loop."""
        tier = cls(
            root,
            name=name,
            fsync=fsync,
            io_threads=io_threads,
            clock=clock,
            max_bytes=max_bytes,
            on_evict=on_evict,
        )
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

    @property
    def capacity_bytes(self) -> int | None:
        """The disk bound (None: none)."""
        return self._max

    @property
    def used_bytes(self) -> int:
        """The disk space the tier's files take, in whole blocks, with what puts in progress
        hold (their temporary files, or the files evicted for them not yet removed): what
        :attr:`capacity_bytes` bounds."""
        return self._disk + self._pending + self._stranded

    # -- the Tier protocol -------------------------------------------------------------------

    async def put(self, key: str, data: BytesLike, *, expires_at: float | None = None) -> None:
        self._check_open()
        check_key(self._name, key)
        if expires_at is not None and (math.isnan(expires_at) or expires_at <= self._clock()):
            await self._run(self._unlink, key)
            return
        view = as_bytes_view(data)
        ticket = _Ticket(footprint(key, view.nbytes, self._block))
        victims = self._make_room(key, view.nbytes, ticket)
        try:
            await self._run(self._write, key, view, expires_at, ticket, victims)
        finally:
            with self._lock:
                self._release(ticket)  # (a no-op once the put's worker did it)
            left = self._putting.pop(key) - 1
            if left:
                self._putting[key] = left

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
            evictions=self._evictions,
            expirations=self._expirations,
            capacity_bytes=self._max,
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
        """The index entry if live (now the most recently used); an expired one is removed
        (from disk too) and is a miss."""
        self._check_open()
        meta = self._index.get(key)
        if meta is None:
            return None
        if not self._expired(meta, self._clock()):
            with self._lock:
                if key in self._index:
                    self._index.move_to_end(key)
            return meta
        if await self._run(self._unlink_many, [key], self._clock()):
            self._expirations += 1
        return None

    def _make_room(self, key: str, size: int, ticket: _Ticket) -> list[_Victim]:
        """Reserve ``ticket.need`` bytes for a put of ``key`` (a ``size``-byte value), taking
        out of the index first the least recently used entries that must go for it to fit
        within the bound; reports each to ``on_evict``. Their files are removed by the put's
        worker (:meth:`_drop`) before it writes. Raises :class:`TierError` for a value larger
        than the bound, or when the room is held by puts in progress."""
        need = ticket.need
        victims: list[_Victim] = []
        freed = 0
        with self._lock:
            if self._max is not None:
                if need > self._max:
                    raise TierError(
                        f"tier {self._name}: a {size}-byte value exceeds the tier's"
                        f" {self._max} bytes",
                        hint="raise tiers.filesystem_max_bytes (and the tier's volume with it)"
                        " or keep chunks this large out of the filesystem tier",
                    )
                over = self.used_bytes + need - self._max
                if over > 0:
                    for k, meta in self._index.items():
                        if k == key or k in self._putting:
                            continue  # (the key's old file goes when the new one replaces it)
                        fp = footprint(k, meta.size, self._block)
                        victims.append((k, meta, fp))
                        freed += fp
                        if freed >= over:
                            break
                    if freed < over:
                        raise TierError(
                            f"tier {self._name}: no room for a {size}-byte value: its"
                            f" {self._max} bytes are held by puts in progress (or by"
                            " evicted files it could not remove)",
                            hint="raise tiers.filesystem_max_bytes well above the bytes puts"
                            " have in flight (dataplane.buffer_pool_bytes)",
                        )
                    for k, meta, fp in victims:
                        del self._index[k]
                        self._bytes -= meta.size
                        self._disk -= fp
                    self._evictions += len(victims)
            ticket.held = max(need, freed)
            self._pending += ticket.held
            self._putting[key] = self._putting.get(key, 0) + 1
        for k, meta, _fp in victims:
            self._notify_evict(k, meta.size)
        return victims

    def _notify_evict(self, key: str, size: int) -> None:
        notify_evict(log, self._on_evict, self._name, key, size)

    def _release(self, ticket: _Ticket) -> None:
        """Give back what a put holds (the lock held); idempotent."""
        self._pending -= ticket.held
        ticket.held = 0

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

    def _write(
        self,
        key: str,
        data: memoryview,
        expires_at: float | None,
        ticket: _Ticket,
        victims: list[_Victim],
    ) -> None:
        try:
            if victims:
                self._drop(victims)
                with self._lock:  # from here the put holds its own file's room only
                    self._pending -= ticket.held - ticket.need
                    ticket.held = ticket.need
            self._write_file(key, data, expires_at, ticket)
        finally:
            with self._lock:
                self._release(ticket)

    def _drop(self, victims: list[_Victim]) -> None:
        """Remove the files of entries evicted for a put (before it writes its own). One put
        again since is left alone: its rename replaced the evicted file."""
        subs = set()
        for key, _meta, fp in victims:
            entry = self._entry(key)
            with self._lock:
                if entry is None or key in self._index:
                    continue
                try:
                    os.unlink(entry[1], dir_fd=self._root_fd)
                except FileNotFoundError:
                    continue  # deleted meanwhile
                except OSError as exc:
                    # counted until a restart finds it (and reconciles it: it is recorded gone)
                    self._stranded += fp
                    log.error(
                        "tier.evict_unlink_failed",
                        extra={"tier": self._name, "error": exc.strerror},
                    )
                    continue
            subs.add(entry[0])
        if self._fsync:
            for sub in subs:
                try:
                    fsync_dir(sub, dir_fd=self._root_fd)
                except OSError as exc:  # the eviction stands; a file back after a crash is an
                    # orphan the next start removes and records
                    log.warning(
                        "tier.evict_sync_failed", extra={"tier": self._name, "error": exc.strerror}
                    )

    def _write_file(
        self, key: str, data: memoryview, expires_at: float | None, ticket: _Ticket
    ) -> None:
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
                self._forget(key)  # its file was just replaced
                self._index[key] = EntryInfo(data.nbytes, expires_at)  # the most recent
                self._bytes += data.nbytes
                self._disk += ticket.need
                self._release(ticket)
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

    def _forget(self, key: str) -> EntryInfo | None:
        """Take ``key`` out of the index and the byte counts (the lock held)."""
        meta = self._index.pop(key, None)
        if meta is not None:
            self._bytes -= meta.size
            self._disk -= footprint(key, meta.size, self._block)
        return meta

    def _unlink(self, key: str) -> EntryInfo | None:
        entry = self._entry(key)
        with self._lock:
            meta = self._forget(key)
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
            self._forget(key)
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
        try:
            self._block = os.fstatvfs(self._root_fd).f_frsize or DEFAULT_BLOCK
        except OSError:
            self._block = DEFAULT_BLOCK
        # least recently used first: in the order they were put, as far as the files say
        order = sorted(found.entries, key=lambda k: found.put_at.get(k, 0.0))
        self._index = OrderedDict((k, found.entries[k]) for k in order)
        self._bytes = sum(meta.size for meta in found.entries.values())
        self._disk = sum(footprint(k, m.size, self._block) for k, m in found.entries.items())
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
        if self._max is not None and self._disk > self._max:
            log.warning(
                "tier.over_bound",
                extra={
                    "tier": self._name,
                    "disk_bytes": self._disk,
                    "max_bytes": self._max,
                    "hint": "the next put evicts (and records) what it must to fit",
                },
            )
        log.info(
            "tier.recovered",
            extra={
                "tier": self._name,
                "entries": len(self._index),
                "bytes": self._bytes,
                "disk_bytes": self._disk,
                "max_bytes": self._max,
                "stray_tmp_removed": found.stray,
                "young_tmp_kept": found.young,
                "corrupt_removed": found.corrupt,
                "untrusted_skipped": len(found.untrusted) + found.kept,
            },
        )

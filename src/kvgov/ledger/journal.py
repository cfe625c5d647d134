"""The ledger's local journal: events made durable on local disk before Postgres has them.

A sidecar acknowledges a put once its ledger event is *durable or durably queued*
(``docs/ledger.md``). Waiting for Postgres means one commit per few puts: the client's window
bounds the batch, and each commit's fixed cost (in the writer and in Postgres) is paid per
handful of events. With the journal, the event is appended here and ``fdatasync``-ed (one
sync for every event that arrived meanwhile: group commit), the put is acknowledged, and the
writer commits the journal to Postgres in large batches behind it.

On disk: a directory of segment files ``journal-<first position>.log``, each an 8-byte magic
then records::

    u32 length | u32 crc32(length, position, payload) | u64 position | payload (the event)

Positions count every record ever journaled for the chain, one by one, across segments and
restarts. Postgres holds the chain's mark (``ledger_journal_marks.applied_upto``), moved in the
same transaction as the events it covers, so on start the records after the mark are exactly
the acknowledged events the chain does not hold: they are replayed, none lost, none twice.
The mark is a mutable row the runtime database role can write, so before anything is deleted
on its word the writer confirms it against the chain (``check`` of :meth:`Journal.open`).

Recovery: a torn record at the end of the last segment (a crash mid-write: never acknowledged,
since acknowledgement waits for the sync) is cut off, with a warning. Anything else that does
not read back (a bad record before the end, a gap in positions, an unknown format) stops
start-up with :class:`~kvgov.errors.LedgerError`: acknowledged events are at stake, and an
operator decides (the hint says how to set the damaged file aside).

Threads: :meth:`Journal.append` on any thread (the event loop); :meth:`Journal.sync` on one
thread at a time (the writer's journal thread); :meth:`Journal.trim` on the committer thread.
"""

from __future__ import annotations

import contextlib
import fcntl
import marshal
import os
import struct
import threading
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, NamedTuple

from kvgov.errors import LedgerError
from kvgov.ledger.events import EntryChange, Event, JSONValue
from kvgov.logging import get_logger
from kvgov.privatefs import NOFOLLOW, NotPrivateError, describe, open_dir, read_file
from kvgov.types import EntryState, EventKind, Outcome, Scope, Sensitivity

log = get_logger(__name__)

MAGIC = b"KVGJRNL1"
#: length, crc32, position
_HEAD = struct.Struct(">IIQ")
_LEN_POS = struct.Struct(">IQ")
#: one event's JSON is a few hundred bytes; anything near this is not an event
MAX_RECORD_BYTES = 1 << 20
_PREFIX, _SUFFIX = "journal-", ".log"
_LOCK_NAME = "lock"
_OWNER_NAME = "chain"


def _not_private(path: Path, what: str, st: os.stat_result) -> LedgerError:
    """A journal directory or segment that is not this process's own, or that another user
    may write: replay chains whatever records the segments hold, so whoever could write them
    could forge acknowledged events (docs/threat-model.md: "0600 files in a 0700 directory";
    an emptyDir or a shared host path is 0777 until kvgov makes its own)."""
    return LedgerError(
        f"the ledger journal {what} {path} is not this process's own and private"
        f" ({describe(st)}): anyone who can write it could forge ledger events",
        hint=(
            "point ledger.journal_dir at a directory only the sidecar's user owns and"
            " writes (chmod 700, no symlink), e.g. a new one inside data_dir"
        ),
    )


def _segment_names(where: int | Path) -> list[str]:
    """The segments' names in a directory (a descriptor, or a path), in position order."""
    with os.scandir(where) as it:
        names: Iterable[str] = [e.name for e in it]
    return sorted(n for n in names if n.startswith(_PREFIX) and n.endswith(_SUFFIX))


def _segment_paths(directory: Path) -> list[Path]:
    return [directory / n for n in _segment_names(directory)]


def _span(name: str, scan: _Scan) -> tuple[int, int]:
    """A segment's first and last positions: its records', or, with none, the one its name
    gives and the one before."""
    if scan.records:
        return scan.records[0][0], scan.records[-1][0]
    try:
        first = int(name[len(_PREFIX) : -len(_SUFFIX)] or 0)
    except ValueError:
        first = 0
    return first, first - 1


#: what :meth:`Journal.open` asks to confirm a mark with: the last record at or below it still
#: on disk, and the first one after it (either None); raises to refuse the mark
MarkCheck = Callable[[tuple[int, bytes] | None, tuple[int, bytes] | None], None]


def _crc(length: int, pos: int, payload: bytes | memoryview) -> int:
    return zlib.crc32(payload, zlib.crc32(_LEN_POS.pack(length, pos)))


def encode_record(pos: int, payload: bytes) -> bytes:
    """One record: header and payload."""
    n = len(payload)
    return _HEAD.pack(n, _crc(n, pos, payload), pos) + payload


@dataclass(slots=True)
class _Segment:
    #: its file's name in the journal directory
    name: str
    first: int
    #: the last position written to it (``first - 1`` while empty)
    last: int
    size: int


@dataclass(slots=True)
class _Scan:
    records: list[tuple[int, bytes]]
    #: bytes up to the end of the last good record
    good_bytes: int
    #: why reading stopped before the end of the file, or None
    damage: str | None


def _scan(data: bytes, expect_first: int | None) -> _Scan:
    """Read one segment's records; stop at the first one that does not read back."""
    if data[: len(MAGIC)] != MAGIC:
        return _Scan([], 0, "not a kvgov journal segment (bad magic)")
    off = len(MAGIC)
    records: list[tuple[int, bytes]] = []
    expect = expect_first
    view = memoryview(data)
    while off < len(data):
        if len(data) - off < _HEAD.size:
            return _Scan(records, off, f"a torn record header at offset {off}")
        n, crc, pos = _HEAD.unpack_from(data, off)
        end = off + _HEAD.size + n
        if n > MAX_RECORD_BYTES or end > len(data):
            return _Scan(records, off, f"a torn or oversize record at offset {off}")
        payload = view[off + _HEAD.size : end]
        if _crc(n, pos, payload) != crc:
            return _Scan(records, off, f"a record failing its checksum at offset {off}")
        if expect is not None and pos != expect:
            return _Scan(records, off, f"position {pos} where {expect} was due, offset {off}")
        records.append((pos, bytes(payload)))
        expect = pos + 1
        off = end
    return _Scan(records, off, None)


@dataclass(frozen=True, slots=True)
class SegmentInfo:
    """One segment as :func:`inspect_journal` read it."""

    name: str
    first: int
    last: int
    records: int
    nbytes: int
    #: why reading stopped before the end of the file (None: read to its end)
    damage: str | None


@dataclass(frozen=True, slots=True)
class JournalReport:
    directory: str
    #: the chain the journal belongs to (None: never used)
    chain_id: str | None
    #: a process holds the journal's lock (a running sidecar)
    in_use: bool
    segments: list[SegmentInfo]

    @property
    def records(self) -> list[int]:
        """Positions of the records that read back (in order)."""
        return [p for s in self.segments for p in range(s.first, s.last + 1) if s.records]

    @property
    def blocks_start(self) -> bool:
        """Damage a start refuses: anywhere but in the last segment."""
        return any(s.damage is not None for s in self.segments[:-1])

    def to_dict(self) -> dict[str, Any]:
        return {
            "directory": self.directory,
            "chain_id": self.chain_id,
            "in_use": self.in_use,
            "blocks_start": self.blocks_start,
            "segments": [
                {
                    "name": s.name,
                    "first": s.first,
                    "last": s.last,
                    "records": s.records,
                    "bytes": s.nbytes,
                    "damage": s.damage,
                }
                for s in self.segments
            ],
        }


def inspect_journal(directory: Path) -> JournalReport:
    """Read a journal directory without changing it (no lock taken, nothing cut off): what
    ``kvgov audit journal`` shows an operator, for instance before moving a damaged segment
    aside."""
    owner = directory / _OWNER_NAME
    chain_id = owner.read_text(encoding="utf-8") if owner.exists() else None
    in_use = False
    lock = directory / _LOCK_NAME
    if lock.exists():
        fd = os.open(lock, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            in_use = True
        finally:
            os.close(fd)  # closing the descriptor drops a lock taken here
    segments: list[SegmentInfo] = []
    expect: int | None = None
    for path in _segment_paths(directory):
        try:
            data = path.read_bytes()
        except FileNotFoundError:  # deleted meanwhile by the running sidecar
            continue
        scan = _scan(data, expect)
        first, last = _span(path.name, scan)
        if scan.records:
            expect = last + 1
        segments.append(
            SegmentInfo(path.name, first, last, len(scan.records), len(data), scan.damage)
        )
    return JournalReport(str(directory), chain_id, in_use, segments)


class Journal:
    """One chain's journal directory. ``open`` first (it returns what to replay)."""

    def __init__(self, directory: Path, *, segment_bytes: int = 64 << 20, fsync: bool = True):
        if segment_bytes < 4096:
            raise LedgerError("journal segment size must be at least 4096 bytes")
        self.directory = directory
        self._segment_bytes = segment_bytes
        self._fsync = fsync
        #: the directory, held open from :meth:`open` to :meth:`close`: everything in it is
        #: named relative to this descriptor, never by path again (:mod:`kvgov.privatefs`)
        self._dir_fd = -1
        self._lock_fd = -1
        self._fd = -1
        self._segments: list[_Segment] = []
        self._seg_lock = threading.Lock()
        self._buf: list[bytes] = []
        self._buf_lock = threading.Lock()
        self._next = 1
        #: the last position known durable on disk
        self.durable = 0
        self.syncs = 0
        self.broken: str | None = None

    # -- start ----------------------------------------------------------------------------

    def open(
        self, applied_upto: int, *, chain_id: str = "", check: MarkCheck | None = None
    ) -> list[tuple[int, bytes]]:
        """Lock the directory, read every segment and return the records after
        ``applied_upto`` (the chain's mark), in order. Segments wholly applied are deleted;
        a torn tail of the last one is cut off. Raises :class:`LedgerError` if the directory
        is another process's or another chain's (its positions count that chain's records),
        or a record that is not the last does not read back.

        ``check``, when given, is called before anything is deleted with the last record at
        or below the mark that is still on disk and the first one after it (either None):
        the mark is a mutable row the runtime database role can write, so the caller confirms
        it against the chain (:func:`kvgov.ledger.writing.replay.check_mark`). An exception
        from it closes the journal, every segment left as it is, and propagates."""
        d = self.directory
        try:
            self._dir_fd = open_dir(d)
        except NotPrivateError as err:
            raise _not_private(d, "directory", err.st) from None
        except OSError as err:
            raise LedgerError(
                f"cannot open the ledger journal at {d}: {err.strerror}",
                hint="ledger.journal_dir must be a writable local directory",
            ) from err
        try:
            self._lock_fd = self._open(_LOCK_NAME, os.O_RDWR | os.O_CREAT)
        except OSError as err:
            self.close(applied_upto=-1)
            raise LedgerError(
                f"cannot open the ledger journal's lock in {d}: {err.strerror}",
                hint="ledger.journal_dir must be a writable local directory",
            ) from err
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            self.close(applied_upto=-1)
            raise LedgerError(
                f"the ledger journal at {d} is in use by another process",
                hint="each sidecar needs its own data_dir (or ledger.journal_dir)",
            ) from err
        self._check_owner(chain_id)
        names = _segment_names(self._dir_fd)
        pending: list[tuple[int, bytes]] = []
        #: the last record at or below the mark still on disk (what the mark claims applied)
        held: tuple[int, bytes] | None = None
        expect: int | None = None
        last_pos = 0
        for i, name in enumerate(names):
            try:
                data = read_file(self._dir_fd, name)
            except (NotPrivateError, OSError) as err:
                self.close(applied_upto=-1)
                if isinstance(err, NotPrivateError):
                    raise _not_private(d / name, "segment", err.st) from None
                raise LedgerError(
                    f"cannot read ledger journal segment {name}: {err.strerror}"
                ) from err
            scan = _scan(data, expect)
            is_last = i == len(names) - 1
            if scan.damage is not None:
                if not is_last:
                    self.close(applied_upto=-1)
                    raise LedgerError(
                        f"ledger journal segment {name} is damaged: {scan.damage}",
                        hint=(
                            "acknowledged ledger events may be in it: `kvgov audit journal`"
                            " shows what reads back; keep a copy for the audit trail, then move"
                            f" it and every later segment out of {d} to start (their events"
                            " are then missing from the chain)"
                        ),
                    )
                log.warning(
                    "ledger.journal.truncated",
                    extra={
                        "segment": name,
                        "damage": scan.damage,
                        "bytes_dropped": len(data) - scan.good_bytes,
                    },
                )
                self._truncate(name, max(scan.good_bytes, len(MAGIC)))
            first, last = _span(name, scan)
            if scan.records:
                expect, last_pos = last + 1, last
            size = max(scan.good_bytes, len(MAGIC))
            self._segments.append(_Segment(name, first, last, size))
            pending.extend(r for r in scan.records if r[0] > applied_upto)
            if scan.records and scan.records[0][0] <= applied_upto:
                held = [r for r in scan.records if r[0] <= applied_upto][-1]
        if check is not None:
            try:
                check(held, pending[0] if pending else None)
            except BaseException:
                self.close(applied_upto=-1)  # nothing deleted on a mark not confirmed
                raise
        self._next = max(last_pos, applied_upto) + 1
        self.durable = self._next - 1
        self.trim(applied_upto)
        if self._segments:
            tail = self._segments[-1]
            self._fd = self._open(tail.name, os.O_WRONLY | os.O_APPEND)
        return pending

    def _open(self, name: str, flags: int) -> int:
        """Open ``name`` in the journal's directory (by its descriptor; a symlink is not
        followed), 0600 if created."""
        return os.open(name, flags | NOFOLLOW, 0o600, dir_fd=self._dir_fd)

    def _check_owner(self, chain_id: str) -> None:
        """The directory's chain, written on first use: replaying one chain's records into
        another would record them twice (their positions count the first chain's mark)."""
        found: str | None
        try:
            found = read_file(self._dir_fd, _OWNER_NAME).decode("utf-8", "replace")
        except FileNotFoundError:
            found = None
        except NotPrivateError as err:
            self.close(applied_upto=-1)
            raise _not_private(self.directory / _OWNER_NAME, "owner file", err.st) from None
        if found != chain_id and not _segment_names(self._dir_fd):
            found = None  # nothing to replay: the directory is free for this chain
        if found is None:
            tmp = _OWNER_NAME + ".tmp"
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=self._dir_fd)  # a leftover (or something planted)
            fd = self._open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            try:
                os.write(fd, chain_id.encode("utf-8"))
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, _OWNER_NAME, src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)
            if self._fsync:
                self._sync_dir()
            return
        if found != chain_id:
            self.close(applied_upto=-1)
            raise LedgerError(
                f"the ledger journal at {self.directory} belongs to chain {found!r},"
                f" not {chain_id!r}",
                hint=(
                    "start once with that ledger.chain_id to commit what it holds (a clean"
                    " stop empties it), or give this chain its own ledger.journal_dir"
                ),
            )

    def _truncate(self, name: str, size: int) -> None:
        fd = self._open(name, os.O_RDWR)
        try:
            if size <= len(MAGIC):
                os.ftruncate(fd, 0)
                os.write(fd, MAGIC)
            else:
                os.ftruncate(fd, size)
            os.fsync(fd)
        finally:
            os.close(fd)

    # -- writing --------------------------------------------------------------------------

    def append(self, payload: bytes) -> int:
        """Queue one record; returns its position (durable once :meth:`sync` has passed it)."""
        if len(payload) > MAX_RECORD_BYTES:
            raise LedgerError(f"ledger event too large for the journal ({len(payload)} bytes)")
        with self._buf_lock:
            pos = self._next
            self._next = pos + 1
            self._buf.append(encode_record(pos, payload))
        return pos

    @property
    def last_position(self) -> int:
        return self._next - 1

    def sync(self) -> int:
        """Write what was appended and sync it; returns the last durable position. An
        :class:`OSError` leaves the journal ``broken`` (the caller stops using it)."""
        with self._buf_lock:
            buf, self._buf = self._buf, []
            upto = self._next - 1
        if not buf:
            return self.durable
        if self.broken is not None:
            raise OSError(self.broken)
        try:
            with self._seg_lock:
                first_pos = _HEAD.unpack_from(buf[0])[2]
                tail = self._segments[-1] if self._segments else None
                if tail is None or self._fd < 0 or tail.size >= self._segment_bytes:
                    tail = self._new_segment(first_pos)
                data = b"".join(buf)
                view = memoryview(data)
                while view.nbytes:
                    n = os.write(self._fd, view)
                    view = view[n:]
                if self._fsync:
                    os.fdatasync(self._fd)
                tail.size += len(data)
                tail.last = upto
        except OSError as err:
            self.broken = f"{type(err).__name__}: {err.strerror or err}"
            raise
        self.syncs += 1
        self.durable = upto
        return upto

    def _new_segment(self, first_pos: int) -> _Segment:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        name = f"{_PREFIX}{first_pos:020d}{_SUFFIX}"
        fd = self._open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND)
        os.write(fd, MAGIC)
        if self._fsync:
            os.fdatasync(fd)
            self._sync_dir()
        self._fd = fd
        seg = _Segment(name, first_pos, first_pos - 1, len(MAGIC))
        self._segments.append(seg)
        return seg

    def _sync_dir(self) -> None:
        os.fsync(self._dir_fd)

    def trim(self, applied_upto: int) -> None:
        """Delete the segments every record of which the chain holds, the one being written
        too (the next sync starts a new one): applied records do not linger on disk, and an
        idle sidecar's journal is empty."""
        with self._seg_lock:
            if self._dir_fd < 0:  # closed: what is left stays for the next start
                return
            keep: list[_Segment] = []
            last = len(self._segments) - 1
            for i, seg in enumerate(self._segments):
                if seg.last <= applied_upto:
                    if i == last and self._fd >= 0:
                        os.close(self._fd)
                        self._fd = -1
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(seg.name, dir_fd=self._dir_fd)
                else:
                    keep.append(seg)
            self._segments = keep

    def pending_bytes(self) -> int:
        with self._seg_lock:
            return sum(s.size for s in self._segments)

    def close(self, applied_upto: int) -> None:
        """Close; when the chain holds every record, delete the segments too (a clean stop
        leaves an empty journal)."""
        with self._seg_lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
            clean = applied_upto >= self._next - 1 and not self._buf
            if clean:
                for seg in self._segments:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(seg.name, dir_fd=self._dir_fd)
                self._segments = []
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
        if self._dir_fd >= 0:
            os.close(self._dir_fd)
            self._dir_fd = -1


# -- events as journal payloads --------------------------------------------------------------
#
# A payload is ``marshal`` of a flat tuple laid out as :class:`EventRecord` (and, nested, an
# :class:`EntryRecord`): the fields in the order the record type declares them, enums as their
# values, times as integer microseconds since the epoch (UTC). Code reads and writes the fields
# by name, through the record types; their declaration order is the on-disk layout. ``marshal``
# of str, int, float, bool, None, list, dict and tuple is what the journal needs at a fraction
# of JSON's cost per event (the encoding runs on the event loop for every journaled event;
# measured in ``docs/ledger.md``, "Throughput"). Its format is CPython's own, stable for
# these types since Python 3.4; a journal is read back by the process that wrote it or its
# restart, and each record is checksummed. :meth:`EventRecord.to_event` checks every field's
# type: a record that is not an event is refused.
#
# Versions: the first field is the layout's version. Version 1 is the only one so far. A new
# layout gets a new record type and version number, and :func:`decode_event` keeps reading
# version 1, so a journal written before an upgrade is replayed after it.

#: the layout :func:`encode_event` writes
CODEC_VERSION = 1
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_US = timedelta(microseconds=1)

#: a value as ``marshal`` writes it for the journal: JSON-like, and tuples (a record, tiers)
Plain = str | int | float | bool | None | tuple["Plain", ...] | list[Any] | dict[Any, Any]


def _micros(moment: datetime) -> int:
    return (moment - _EPOCH) // _US


def _moment(micros: object) -> datetime:
    if type(micros) is not int:
        raise TypeError("a time is not an integer")
    return _EPOCH + micros * _US


class EntryRecord(NamedTuple):
    """An :class:`~kvgov.ledger.events.EntryChange` as a journal record carries it (version 1
    layout: these fields, in this order)."""

    key_digest: str
    state: str
    tenant: str | None
    owner: str | None
    scope_user: str | None
    model: str | None
    key_id: str | None
    request_id: str | None
    decision_id: str | None
    policy_revision: str | None
    scope: str | None
    sensitivity: str | None
    size: int | None
    key_version: int | None
    tiers: tuple[str, ...] | None
    expires_us: int | None

    @staticmethod
    def fields_of(c: EntryChange) -> tuple[Plain, ...]:
        """``c`` as this record's fields, in their order, in a plain tuple (what ``marshal``
        writes). Not built by keyword: that costs ~1 us per event on the event loop; the
        journal tests check that each field lands under its name."""
        return (
            c.key_digest,  # key_digest
            c.state._value_,  # state (``_value_``: ``.value`` is a Python-level property)
            c.tenant,  # tenant
            c.owner,  # owner
            c.scope_user,  # scope_user
            c.model,  # model
            c.key_id,  # key_id
            c.request_id,  # request_id
            c.decision_id,  # decision_id
            c.policy_revision,  # policy_revision
            None if c.scope is None else c.scope._value_,  # scope
            None if c.sensitivity is None else c.sensitivity._value_,  # sensitivity
            c.size,  # size
            c.key_version,  # key_version
            c.tiers,  # tiers
            None if c.expires_at is None else _micros(c.expires_at),  # expires_us
        )

    @classmethod
    def read(cls, fields: object) -> EntryRecord:
        """The record an entry's tuple is (fields unchecked until :meth:`to_change`)."""
        if type(fields) is not tuple or len(fields) != len(cls._fields):
            raise ValueError("not an entry change")
        return cls._make(fields)

    def to_change(self) -> EntryChange:
        """The entry change, every field's type checked (a record read back is untrusted)."""
        _check_texts(
            (
                self.key_digest,
                self.tenant,
                self.owner,
                self.scope_user,
                self.model,
                self.key_id,
                self.request_id,
                self.decision_id,
                self.policy_revision,
            )
        )
        _check_int(self.size)
        _check_int(self.key_version)
        tiers = self.tiers
        if tiers is not None:
            if type(tiers) is not tuple:
                raise TypeError("tiers")
            _check_texts(tiers)
        return EntryChange(
            key_digest=self.key_digest,
            state=EntryState(self.state),
            tenant=self.tenant,
            owner=self.owner,
            scope_user=self.scope_user,
            scope=None if self.scope is None else Scope(self.scope),
            sensitivity=None if self.sensitivity is None else Sensitivity(self.sensitivity),
            model=self.model,
            size=self.size,
            tiers=tiers,
            key_id=self.key_id,
            key_version=self.key_version,
            expires_at=None if self.expires_us is None else _moment(self.expires_us),
            request_id=self.request_id,
            decision_id=self.decision_id,
            policy_revision=self.policy_revision,
        )


class EventRecord(NamedTuple):
    """An :class:`~kvgov.ledger.events.Event` as a journal record carries it (version 1
    layout: these fields, in this order; ``entry`` last)."""

    version: int
    kind: str
    occurred_us: int
    tenant: str | None
    actor: str | None
    request_id: str | None
    key_digest: str | None
    tier: str | None
    reason: str | None
    decision_id: str | None
    policy_revision: str | None
    principal: str | None
    nbytes: int | None
    outcome: str | None
    attrs: dict[str, JSONValue] | None
    payload: dict[str, JSONValue] | None
    #: the entry change's fields, laid out as :class:`EntryRecord`
    entry: tuple[Plain, ...] | None

    @staticmethod
    def fields_of(e: Event) -> tuple[Plain, ...]:
        """``e`` as this record's fields, in their order, in a plain tuple (what ``marshal``
        writes; the entry change nested the same way). Not built by keyword: that costs ~2.5
        us per event on the event loop; the journal tests check that each field lands under
        its name."""
        c = e.entry
        return (
            CODEC_VERSION,  # version
            e.kind._value_,  # kind (``_value_``: ``.value`` is a Python-level property)
            _micros(e.occurred_at),  # occurred_us
            e.tenant,  # tenant
            e.actor,  # actor
            e.request_id,  # request_id
            e.key_digest,  # key_digest
            e.tier,  # tier
            e.reason,  # reason
            e.decision_id,  # decision_id
            e.policy_revision,  # policy_revision
            e.principal,  # principal
            e.nbytes,  # nbytes
            None if e.outcome is None else e.outcome._value_,  # outcome
            dict(e.attrs) if e.attrs else None,  # attrs
            None if e.payload is None else dict(e.payload),  # payload
            None if c is None else EntryRecord.fields_of(c),  # entry
        )

    @classmethod
    def read(cls, fields: object) -> EventRecord:
        """The record a payload's tuple is (fields unchecked until :meth:`to_event`)."""
        if type(fields) is not tuple or len(fields) != len(cls._fields):
            raise ValueError("not an event record")
        if fields[0] != CODEC_VERSION:
            raise ValueError(f"not a version-{CODEC_VERSION} event record")
        return cls._make(fields)

    def to_event(self) -> Event:
        """The event, every field's type checked (a record read back is untrusted)."""
        _check_texts(
            (
                self.tenant,
                self.actor,
                self.request_id,
                self.key_digest,
                self.tier,
                self.reason,
                self.decision_id,
                self.policy_revision,
                self.principal,
            )
        )
        _check_int(self.nbytes)
        attrs, extra = self.attrs, self.payload
        if attrs is not None and type(attrs) is not dict:
            raise TypeError("attrs")
        if extra is not None and type(extra) is not dict:
            raise TypeError("payload")
        return Event(
            kind=EventKind(self.kind),
            tenant=self.tenant,
            actor=self.actor,
            request_id=self.request_id,
            key_digest=self.key_digest,
            tier=self.tier,
            nbytes=self.nbytes,
            outcome=None if self.outcome is None else Outcome(self.outcome),
            reason=self.reason,
            decision_id=self.decision_id,
            policy_revision=self.policy_revision,
            principal=self.principal,
            attrs=attrs or {},
            payload=extra,
            entry=None if self.entry is None else EntryRecord.read(self.entry).to_change(),
            occurred_at=_moment(self.occurred_us),
        )


def encode_event(event: Event) -> bytes:
    """An event as a payload that :func:`decode_event` turns back into an equal event.
    Raises :class:`LedgerError` for what cannot be carried exactly."""
    fields = EventRecord.fields_of(event)
    try:
        return marshal.dumps(fields)
    except ValueError:  # a subclass of str, int, dict...: carry plain values
        try:
            return marshal.dumps(_plain(fields))
        except (TypeError, ValueError) as err:
            raise LedgerError(f"event cannot be journaled: {err}") from None
    except TypeError as err:
        raise LedgerError(f"event cannot be journaled: {err}") from None


def _plain(value: object) -> Plain:
    """``value`` with subclasses of the JSON-like types turned into the types themselves."""
    if value is None:
        return None
    if type(value) in (str, int, float, bool) and isinstance(value, str | int | float):
        return value  # already plain (bool is an int)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    raise TypeError(f"{type(value).__name__} is not a JSON value")


def decode_event(payload: bytes) -> Event:
    """The event :func:`encode_event` wrote. Raises :class:`LedgerError` if it is not one."""
    try:
        # our own checksummed records, in a 0700 directory beside the sidecar's keys; every
        # field is type-checked by to_event
        fields = marshal.loads(payload)  # noqa: S302
        return EventRecord.read(fields).to_event()
    except (ValueError, KeyError, TypeError, EOFError, OverflowError) as err:
        raise LedgerError(f"a journal record is not a ledger event: {type(err).__name__}") from None


def _check_texts(values: Iterable[object]) -> None:
    if any(v is not None and type(v) is not str for v in values):
        raise TypeError("a text field is not text")


def _check_int(value: object) -> None:
    if value is not None and type(value) is not int:
        raise TypeError("a count is not an integer")

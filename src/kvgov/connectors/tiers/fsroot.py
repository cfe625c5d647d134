"""The filesystem tier's root: opened only when it is the sidecar's own, walked safely at start.

A root that another local user can write (an emptyDir is 0777, a hostPath or an NVMe mount is
shared, a path under /tmp) lets them plant ``<root>/00 -> /some/dir``: the start-up walk
followed it and deleted every file there that was not a tier file (the sidecar's KEK, signing
and pseudonym keys, its ledger journal), and puts wrote through it. So the root must be a
directory of the process's own uid that group and others cannot write (:mod:`kvgov.privatefs`,
the ledger journal's rule), checked on the descriptor the tier then keeps: every later
operation is relative to it (``dir_fd``), never to the path, which someone able to write the
root's parent could swap for a symlink. Inside it, a fan-out directory is used only once it
is checked the same way (by ``lstat``: a symlink never passes), and the walk removes only
regular files of the process's own uid.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvgov.connectors.tiers.base import EntryInfo
from kvgov.connectors.tiers.fsformat import CorruptEntryError, fanout, file_name, parse_file
from kvgov.errors import TierError
from kvgov.privatefs import DIR_FLAGS, NotPrivateError, describe, is_private, open_dir

FANOUT_DIR = re.compile(r"[0-9a-f]{2}")


def open_root(root: Path, tier: str) -> int:
    """Create ``root`` (0700) if it is missing, open it without following a symlink and
    return the descriptor if it is ours and private; :class:`TierError` otherwise. What was
    opened is checked, not the path: a root someone else created first (in a parent they can
    write) is theirs, and refused."""
    try:
        return open_dir(root)
    except NotPrivateError as exc:
        raise _refused(root, tier, exc) from None
    except OSError as exc:
        raise TierError(f"tier {tier}: cannot create {root}: {exc}") from exc


def _refused(root: Path, tier: str, exc: NotPrivateError) -> TierError:
    st = exc.st
    if stat.S_ISLNK(st.st_mode):
        what = "is a symlink"
    elif not stat.S_ISDIR(st.st_mode):
        what = "is not a directory"
    else:
        what = "is not this process's own and private"
    return TierError(
        f"the {tier} tier's root {root} {what} ({describe(st)}): whoever can write it"
        " could make the sidecar delete or write files outside it through a planted symlink,"
        " or keep back and swap its values",
        hint=(
            "point tiers.filesystem_path at a directory only the sidecar's user owns and"
            " writes (chmod 700, no symlink), e.g. a new one kvgov creates inside data_dir"
            " (the default is <data_dir>/tiers/fs)"
        ),
    )


def fanout_problem(root_fd: int, sub: str) -> str | None:
    """None if ``<root>/<sub>`` is a directory of ours that others cannot write (by
    ``lstat``), else what it is. The root being ours and private, nobody else can replace
    it after this check."""
    st = os.stat(sub, dir_fd=root_fd, follow_symlinks=False)
    return None if is_private(st, stat.S_ISDIR) else describe(st)


def make_fanout(root_fd: int, sub: str, *, fsync: bool) -> str | None:
    """Create ``<root>/<sub>`` (0700) unless it is there; then as :func:`fanout_problem`."""
    try:
        os.mkdir(sub, 0o700, dir_fd=root_fd)
    except FileExistsError:
        return fanout_problem(root_fd, sub)
    if fsync:
        os.fsync(root_fd)
    return fanout_problem(root_fd, sub)


@dataclass(slots=True)
class Scan:
    """What :func:`scan` found under the root."""

    entries: dict[str, EntryInfo] = field(default_factory=dict)
    #: each entry's file's last modification (``st_mtime``): when it was put
    put_at: dict[str, float] = field(default_factory=dict)
    #: the fan-out directories checked ours and private
    fanouts: set[str] = field(default_factory=set)
    #: fan-out names that are not (symlinks, another uid's, writable by others): skipped
    untrusted: list[str] = field(default_factory=list)
    stray: int = 0
    corrupt: int = 0
    #: entries of checked fan-out directories that are not our regular files: left alone
    kept: int = 0
    #: leftovers (``*.tmp``) too young to be taken for a crash's: left alone
    young: int = 0


def scan(root_fd: int, *, stray_min_age_s: float = 0.0) -> Scan:
    """Index the tier's files; remove our own leftovers (``*.tmp`` last modified at least
    ``stray_min_age_s`` ago: a younger one may be a put in progress in the process that owns
    the tier, when another one opens it) and files that do not parse or sit under the wrong
    name; enter no fan-out entry that fails the check."""
    found = Scan()
    stale_before = time.time() - stray_min_age_s if stray_min_age_s > 0 else math.inf
    with os.scandir(root_fd) as it:
        subs = sorted(e.name for e in it if FANOUT_DIR.fullmatch(e.name))
    for sub in subs:
        try:
            problem = fanout_problem(root_fd, sub)
        except FileNotFoundError:
            continue  # removed since it was listed
        if problem is not None:
            found.untrusted.append(sub)
            continue
        try:
            fd = os.open(sub, DIR_FLAGS, dir_fd=root_fd)
        except FileNotFoundError:
            continue
        try:
            _scan_dir(sub, fd, found, stale_before)
        finally:
            os.close(fd)
        found.fanouts.add(sub)
    return found


def _scan_dir(sub: str, dir_fd: int, found: Scan, stale_before: float) -> None:
    me = os.geteuid()
    with os.scandir(dir_fd) as it:
        names = [e.name for e in it]
    for name in names:
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            # gone since it was listed: the tier's owner renamed its put into place or deleted
            # a value while another process (kvgov purge) opened the tier
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_uid != me:
            found.kept += 1  # a symlink, a FIFO (opening it would hang), another uid's file
            continue
        if name.endswith(".tmp"):
            if st.st_mtime >= stale_before:
                found.young += 1  # perhaps a put in progress in the tier's own process
                continue
            found.stray += 1
        else:
            try:
                key, meta = parse_file(name, dir_fd=dir_fd)
            except FileNotFoundError:
                continue  # deleted by the tier's owner since: neither an entry nor corrupt
            except (CorruptEntryError, OSError):
                key = None
            if key is not None and fanout(key) == sub and file_name(key) == name:
                found.entries[key] = meta
                found.put_at[key] = st.st_mtime
                continue
            found.corrupt += 1
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dir_fd)

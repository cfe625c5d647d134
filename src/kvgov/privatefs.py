"""Whether a file or directory on local disk is this process's own and private.

The sidecar keeps state on local disk that whoever can write could forge or turn against it:
the ledger journal's segments (replayed into the chain at start) and the filesystem tier's
directories (a symlink planted there made the sidecar delete or write files outside them).
Both take an ``lstat`` (a symlink is never of the kind asked for) and refuse what
:func:`is_private` does not accept, saying why with :func:`describe`
(``docs/threat-model.md``: "0600 files in a 0700 directory").

Both keep the directory open (:func:`open_dir`) and name everything inside it relative to that
descriptor (``dir_fd``), never by path again: whoever can write the directory's *parent* (a
0777 emptyDir or hostPath above ``data_dir``) could otherwise rename the checked directory away
and put a symlink to one of theirs in its place, after the check.

Key files (the KEK, the signing and pseudonym keys) are read with :func:`read_private_file`:
checked on the file opened (a Kubernetes Secret's symlink is followed), 0600 or stricter and
this process's user's own.

Files kvgov takes an identity, a trust or a credential from (the engine tokens, the database
and Redis URLs, OPA's token, the trusted ledger keys, a public key a receipt is checked
against) are read with :func:`read_guarded_file`: checked the same way on the file opened (a
Kubernetes Secret's or ConfigMap's symlinks followed), owned by this process's user or root and
writable by no one else: whoever could write one could admit their own engine, point the
sidecar at their database, or make a forged chain verify (review r16's notes). Those that hold
a secret may be read by the file's group (a Secret under the pod's ``fsGroup`` is 0440), never
by others.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

from kvgov.errors import ConfigError, StartupError

#: the mode bits that let another user write
WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH
#: a directory opened as itself: never through a symlink
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: what every open inside such a directory adds: a symlink planted there is not followed
NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


class NotPrivateError(Exception):
    """What is at a path is not this process's own and private (a symlink, another kind of
    file, another user's, or writable by others); ``st`` is what was found."""

    def __init__(self, st: os.stat_result) -> None:
        super().__init__(describe(st))
        self.st = st


def is_private(st: os.stat_result, is_kind: Callable[[int], bool]) -> bool:
    """``st`` (an ``lstat``) is of the kind asked for (``stat.S_ISDIR``, ``stat.S_ISREG``),
    owned by this process's effective uid, and neither group nor others may write it.

    Group and others may read: the journal and the tier hold pseudonyms, digests and
    ciphertext, and what the tier creates inside its root is 0700 and 0600 anyway."""
    return is_kind(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & WRITABLE_BY_OTHERS


def describe(st: os.stat_result) -> str:
    """What :func:`is_private` looked at, for an error message: mode, owner and our uid."""
    return (
        f"{stat.filemode(st.st_mode)}, owner uid {st.st_uid};"
        f" this process runs as uid {os.geteuid()}"
    )


def open_dir(path: Path) -> int:
    """Create ``path`` (0700, parents too) if it is missing, open it without following a
    symlink and return the descriptor if it is ours and private (:func:`is_private`, checked
    on the descriptor: what was opened, not the path). Raises :class:`NotPrivateError` for a
    symlink, something not a directory, or a directory that is not ours and private; an
    :class:`OSError` when it cannot be created or opened."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, DIR_FLAGS)
    except OSError:
        try:
            st = os.lstat(path)
        except OSError:
            st = None
        if st is not None and not stat.S_ISDIR(st.st_mode):
            raise NotPrivateError(st) from None  # a symlink, a file
        raise
    st = os.fstat(fd)
    if not is_private(st, stat.S_ISDIR):
        os.close(fd)
        raise NotPrivateError(st)
    return fd


def read_file(dir_fd: int, name: str) -> bytes:
    """The bytes of ``name`` in the directory ``dir_fd`` if it is a regular file of ours that
    others cannot write (opened without following a symlink, and without blocking: a FIFO
    planted there would hang a blocking open). Raises :class:`NotPrivateError`, or
    :class:`FileNotFoundError` when it is gone."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | NOFOLLOW, dir_fd=dir_fd)
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise NotPrivateError(os.stat(name, dir_fd=dir_fd, follow_symlinks=False)) from None
    try:
        st = os.fstat(fd)
        if not is_private(st, stat.S_ISREG):
            raise NotPrivateError(st)
        return _read_all(fd, st.st_size)
    finally:
        os.close(fd)


def read_private_file(path: Path, what: str) -> bytes:
    """The bytes of a key file that only its owner can read, and whose owner is this process's
    user (``what`` names it in errors). The checks are made on the file opened, not on the
    path: a symlink is followed (a Kubernetes Secret's files are links), but what it reaches
    must pass. A 0600 file of another user (planted in a parent others can write) is refused
    like a loose one: it is someone else's key."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise StartupError(
            f"{what} not found: {path}", hint="run `kvgov init` to create it"
        ) from None
    except OSError as exc:
        raise StartupError(f"cannot read {what} {path}: {exc}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise StartupError(f"{what} {path} is not a regular file")
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise StartupError(f"{what} {path} is readable by others", hint=f"chmod 600 {path}")
        if st.st_uid != os.geteuid():
            raise StartupError(
                f"{what} {path} belongs to uid {st.st_uid}, not to this process's"
                f" (uid {os.geteuid()}): it is not this sidecar's key",
                hint=f"provision it as the sidecar's user (chown {os.geteuid()} {path})",
            )
        return _read_all(fd, st.st_size)
    except OSError as exc:
        raise StartupError(f"cannot read {what} {path}: {exc}") from exc
    finally:
        os.close(fd)


def guarded_problem(mode: int, uid: int, *, secret: bool) -> str | None:
    """Why :func:`read_guarded_file` refuses a file of ``mode`` owned by ``uid``, or None: not
    a regular file; writable by group or others; owned by a uid that is neither this
    process's effective uid nor root's; with ``secret``, readable (or anything) by others. The
    reason names the mode and the owner, never what the file holds."""
    octal = f"{stat.S_IMODE(mode):04o}"
    shown = f"mode {octal}, {stat.filemode(mode)}"
    if not stat.S_ISREG(mode):
        return f"is not a regular file ({stat.filemode(mode)})"
    if mode & WRITABLE_BY_OTHERS:
        who = " and ".join(
            name
            for bit, name in ((stat.S_IWGRP, "its group"), (stat.S_IWOTH, "others"))
            if mode & bit
        )
        return f"is writable by {who} ({shown}): whoever can write it decides what it says"
    if uid not in (os.geteuid(), 0):
        return (
            f"belongs to uid {uid}, neither this process's (uid {os.geteuid()}) nor root:"
            " its owner decides what it says"
        )
    if secret and mode & stat.S_IRWXO:
        return f"is readable by others ({shown}): it holds a secret"
    return None


def read_guarded_file(path: Path, what: str, *, secret: bool) -> bytes:
    """The bytes of a file kvgov takes an identity, a trust or a credential from (``what``
    names it in errors, e.g. the setting), checked on the file opened, like
    :func:`read_private_file` (a Kubernetes Secret's or ConfigMap's symlinks are followed, what
    they reach must pass; a FIFO does not block the open): refused per :func:`guarded_problem`
    (``secret``: it holds one). Raises :class:`ConfigError` naming the file and why (its mode,
    its owner, or the ``OSError``'s reason), never what it holds."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        problem = guarded_problem(st.st_mode, st.st_uid, secret=secret)
        if problem is not None:
            mode = "0440 (a Kubernetes Secret: defaultMode 0440)" if secret else "go-w"
            raise ConfigError(
                f"{what} {path} {problem}",
                hint=f"chmod {mode} {path}, owned by this process's user (uid {os.geteuid()})"
                " or root",
            )
        return _read_all(fd, st.st_size)
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror}") from None
    finally:
        os.close(fd)


def _read_all(fd: int, size: int) -> bytes:
    """What is left to read of ``fd`` (``size``: its length by ``fstat``, a first guess)."""
    chunks = []
    while chunk := os.read(fd, max(size, 1 << 16)):
        chunks.append(chunk)
    return b"".join(chunks)

"""Whether a file or directory on local disk is this process's own and private.

The sidecar keeps state on local disk that whoever can write could forge or turn against it:
the ledger journal's segments (replayed into the chain at start) and the filesystem tier's
directories (a symlink planted there made the sidecar delete or write files outside them).
Both take an ``lstat`` (a symlink is never of the kind asked for) and refuse what
:func:`is_private` does not accept, saying why with :func:`describe`
(``docs/threat-model.md``: "0600 files in a 0700 directory").
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable

#: the mode bits that let another user write
WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH


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

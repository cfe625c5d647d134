"""Attack: a key file of another user, planted where the sidecar looks for its own.

Review 4a (observation): the KEK, signing and pseudonym key files were checked for their mode
only (``stat``, then a second read by path): a sidecar running as root (or any user able to
read it) accepted a 0600 key file that another user created first in a parent they could
write, and sealed, signed or pseudonymised with a key that user knows. Now the file opened is
checked, its owner included: it must be this process's user's.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from kvgov.errors import StartupError
from kvgov.keys.kek import generate_kek_file, read_kek_file
from kvgov.ledger.chain import generate_signing_key_file, load_signing_key
from kvgov.ledger.pseudonym import Pseudonymizer, generate_pseudonym_key_file

OTHER_UID = 54321

KEYS: list[tuple[str, Callable[[Path], object], Callable[[Path], object]]] = [
    ("kek", generate_kek_file, read_kek_file),
    ("signing", generate_signing_key_file, load_signing_key),
    ("pseudonym", generate_pseudonym_key_file, Pseudonymizer.from_file),
]


@pytest.mark.parametrize(("name", "make", "read"), KEYS, ids=[k[0] for k in KEYS])
def test_a_key_file_of_another_user_is_refused(
    tmp_path: Path, name: str, make: Callable[[Path], object], read: Callable[[Path], object]
) -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    path = tmp_path / f"{name}.key"
    make(path)
    read(path)  # ours: accepted
    os.chown(path, OTHER_UID, -1)  # planted by someone else, still 0600
    with pytest.raises(StartupError, match=f"belongs to uid {OTHER_UID}"):
        read(path)


@pytest.mark.parametrize(("name", "make", "read"), KEYS, ids=[k[0] for k in KEYS])
def test_a_symlinked_key_file_of_ours_is_read(
    tmp_path: Path, name: str, make: Callable[[Path], object], read: Callable[[Path], object]
) -> None:
    """A Kubernetes Secret's files are symlinks (``..data/...``): followed, the target checked."""
    target = tmp_path / "..data" / f"{name}.key"
    target.parent.mkdir()
    make(target)
    link = tmp_path / f"{name}.key"
    link.symlink_to(target)
    read(link)

"""Attack: the engine's container re-modes a sidecar file through the Unix socket's path.

The socket's folder is a volume both containers write (the engine connects there). The sidecar
bound its socket and then ``chmod``-ed it to 0660 *by path*: between the two, the engine could
replace the socket with a symlink to a file of the sidecar's, and the ``chmod`` made that file
group-readable and group-writable (the engine runs in the sidecar's group: a journal segment it
could then write, a key file it could read). Now the socket is bound and moded in a private
folder and renamed into place (review 4a, observation "socket chmod"). The race is made
deterministic here: the "engine" plants its symlink right after each bind.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.security import doors
from tests.security.conftest import ProdDatabase


@pytest.fixture
def short_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="kvu-"))  # a socket path must stay short
    yield d
    shutil.rmtree(d, ignore_errors=True)


def victim_file(tmp_path: Path) -> Path:
    """A file of the sidecar's, 0600: what the engine would have re-moded."""
    victim = tmp_path / "journal-segment"
    victim.write_bytes(b"acknowledged ledger events")
    victim.chmod(0o600)
    return victim


def after_each_bind(monkeypatch: pytest.MonkeyPatch, engine: Callable[[Path], bool]) -> list[str]:
    """Run ``engine(the path just bound)`` right after every Unix bind of this event loop (the
    race, made deterministic); the paths it acted on are listed in what is returned."""
    loop_type = type(asyncio.get_running_loop())
    real = loop_type.create_unix_server
    acted: list[str] = []

    async def bind_then_act(self: Any, factory: Any, path: str, **kw: Any) -> Any:
        srv = await real(self, factory, path, **kw)
        if engine(Path(path)):
            acted.append(path)
        return srv

    monkeypatch.setattr(loop_type, "create_unix_server", bind_then_act)
    return acted


def assert_unmoded(victim: Path, acted: list[str]) -> None:
    assert acted, "the race was not run"
    mode = stat.S_IMODE(victim.stat().st_mode)
    assert mode == 0o600, f"the sidecar re-moded its own file to {oct(mode)}"


async def test_a_symlink_swapped_in_after_bind_is_not_followed(
    tmp_path: Path, prod_db: ProdDatabase, short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sock = short_dir / "d.sock"
    victim = victim_file(tmp_path)

    def swap(bound: Path) -> bool:  # the engine: the socket's path now points at the victim
        sock.unlink(missing_ok=True)
        sock.symlink_to(victim)
        return True

    acted = after_each_bind(monkeypatch, swap)
    async with doors.sidecar(tmp_path, prod_db, unix_path=str(sock)):
        assert_unmoded(victim, acted)
        st = os.lstat(sock)
        assert stat.S_ISSOCK(st.st_mode), "the path is not the sidecar's socket"
        assert stat.S_IMODE(st.st_mode) == 0o660
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(sock))  # the listener is the one at the path
        left = sorted(p.name for p in short_dir.iterdir())  # noqa: ASYNC240
        assert left == ["d.sock"], f"a staging leftover: {left}"


async def test_the_socket_is_group_reachable_and_nothing_else_is_left(
    tmp_path: Path, prod_db: ProdDatabase, short_dir: Path
) -> None:
    sock = short_dir / "d.sock"
    async with doors.sidecar(tmp_path, prod_db, unix_path=str(sock)):
        st = os.lstat(sock)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660
        left = sorted(p.name for p in short_dir.iterdir())  # noqa: ASYNC240
        assert left == ["d.sock"], left


async def test_a_staging_folder_swapped_after_bind_is_not_followed(
    tmp_path: Path, prod_db: ProdDatabase, short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review 5, finding A: the socket was bound in a private staging folder but then moded
    by path: the engine could rename that folder aside right after the bind and put its own
    in its place, holding ``s -> <a sidecar file>``. Now the mode and the rename go through
    the descriptor of the folder the sidecar made."""
    sock = short_dir / "d.sock"
    victim = victim_file(tmp_path)

    def swap_folder(bound: Path) -> bool:  # the sidecar's folder aside, the engine's in
        staging = bound.parent
        if staging.parent != short_dir:
            return False
        staging.rename(short_dir / "moved-aside")
        staging.mkdir(mode=0o700)
        (staging / "s").symlink_to(victim)
        return True

    acted = after_each_bind(monkeypatch, swap_folder)
    async with doors.sidecar(tmp_path, prod_db, unix_path=str(sock)):
        assert_unmoded(victim, acted)
        assert stat.S_ISSOCK(os.lstat(sock).st_mode)
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(sock))


async def test_a_folder_planted_at_the_socket_path_stops_start_up_with_a_clear_error(
    tmp_path: Path, prod_db: ProdDatabase, short_dir: Path
) -> None:
    """The engine's container (review r8, H3) makes a folder where the socket goes: the
    sidecar's start raised a bare IsADirectoryError; it now says what holds the path and why
    it may be there, and leaves the folder alone."""
    from kvgov.errors import ConfigError

    sock = short_dir / "d.sock"
    (sock / "planted").mkdir(parents=True)
    with pytest.raises(ConfigError, match="something that is not a socket holds the path"):
        async with doors.sidecar(tmp_path, prod_db, unix_path=str(sock)):
            pass
    assert (sock / "planted").is_dir()

"""The embedded SQLite ledger's files are private: the data directory is created 0700 and
``ledger.db`` with its ``-wal`` and ``-shm`` files 0600, whatever the process umask."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kvgov.db.engine import make_engine, upgrade
from kvgov.ledger.events import Event
from kvgov.ledger.writer import LedgerWriter
from kvgov.types import EventKind


@pytest.fixture
def permissive_umask() -> Iterator[None]:
    old = os.umask(0o002)  # group-writable, world-readable by default
    try:
        yield
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.usefixtures("permissive_umask")
async def test_sqlite_ledger_files_are_private(tmp_path: Path) -> None:
    data = tmp_path / "data" / "node"
    url = f"sqlite:///{(data / 'ledger.db').as_posix()}"
    upgrade(url)
    engine = make_engine(url)
    writer = LedgerWriter(engine, chain_id="node-a", signing_key=Ed25519PrivateKey.generate())
    await writer.start()
    try:
        await writer.append(Event(kind=EventKind.KV_GET, tenant="acme"))
        # while the writer's engine is open, the WAL and its shared-memory index exist
        with engine.connect():
            files = {p.name: mode(p) for p in data.iterdir()}
    finally:
        await writer.close()
        engine.dispose()
    assert mode(data) == 0o700
    assert files == {"ledger.db": 0o600, "ledger.db-wal": 0o600, "ledger.db-shm": 0o600}


@pytest.mark.usefixtures("permissive_umask")
def test_an_existing_directory_is_left_as_it_is(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    upgrade(f"sqlite:///{(shared / 'ledger.db').as_posix()}")
    assert mode(shared) == 0o755  # the operator's directory: not ours to change
    assert mode(shared / "ledger.db") == 0o600

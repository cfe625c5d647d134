"""The keyring on the ledger's real ``SqlKeyStore`` (SQLite and Postgres): rows, rotation, shred."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine

from kvgov.db.engine import make_engine, upgrade
from kvgov.db.keystore import SqlKeyStore
from kvgov.errors import KeyDestroyedError, SealError
from kvgov.keys.kek import FileKekProvider, generate_kek_file
from kvgov.keys.keyring import Keyring
from kvgov.keys.sealed import parse_header
from kvgov.types import KeyState

pytestmark = pytest.mark.postgres

CK = b"llama|chunk-7"


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    upgrade(db_url)
    eng = make_engine(db_url, pool_size=2)
    yield eng
    eng.dispose()


@pytest.fixture
def kek(tmp_path: Path) -> FileKekProvider:
    return FileKekProvider(generate_kek_file(tmp_path / "kek.key"))


def test_sealed_data_survives_a_restart_and_rotation(engine: Engine, kek: FileKekProvider) -> None:
    ring = Keyring(SqlKeyStore(engine), kek, segment_size=4096, usage_batch=2)
    data = os.urandom(20_000)
    v1 = ring.seal("acme", CK, data)
    ring.seal("acme", CK, b"more")
    ring.seal("acme", CK, b"and more", user="p-1")
    ring.rotate("acme")
    v2 = ring.seal("acme", CK, data)
    assert (parse_header(v1).key_version, parse_header(v2).key_version) == (1, 2)
    ring.flush_usage()

    fresh = Keyring(SqlKeyStore(engine), kek)  # another process: only the database is shared
    assert fresh.open(v1, tenant="acme", cache_key=CK) == data
    assert fresh.open(v2, tenant="acme", cache_key=CK) == data
    assert fresh.current("acme").version == 2
    listed = [(k.key_id, k.version, k.state, k.usage_count) for k in fresh.list("acme")]
    assert listed == [
        ("t:acme", 1, KeyState.RETIRED, 2),
        ("t:acme", 2, KeyState.ACTIVE, 1),
        ("u:acme:p-1", 1, KeyState.ACTIVE, 1),
    ]
    # the database holds only wrapped keys: nothing in a row opens data without the KEK
    rows = SqlKeyStore(engine).versions("acme")
    assert all(r.wrapped is not None and r.kek_id == kek.kek_id for r in rows)


def test_shred_on_the_database(engine: Engine, kek: FileKekProvider) -> None:
    ring = Keyring(SqlKeyStore(engine), kek)
    mine = ring.seal("acme", CK, b"user data" * 100, user="p-1")
    tenant = ring.seal("acme", CK, b"tenant data" * 100)
    other = ring.seal("globex", CK, b"globex" * 100)
    destroyed = ring.shred("acme", "p-1")
    assert [(k.key_id, k.state) for k in destroyed] == [("u:acme:p-1", KeyState.DESTROYED)]
    for process in (ring, Keyring(SqlKeyStore(engine), kek)):
        with pytest.raises(KeyDestroyedError, match=r"u:acme:p-1 v1 was destroyed"):
            process.open(mine, tenant="acme", cache_key=CK)
        assert process.open(tenant, tenant="acme", cache_key=CK) == b"tenant data" * 100
        assert process.open(other, tenant="globex", cache_key=CK) == b"globex" * 100
        with pytest.raises(SealError, match="another tenant"):
            process.open(other, tenant="acme", cache_key=CK)
    row = SqlKeyStore(engine).get("u:acme:p-1", 1)
    assert row is not None and row.wrapped is None and row.destroyed_at is not None


def test_two_processes_creating_the_same_key_agree(engine: Engine, kek: FileKekProvider) -> None:
    one = Keyring(SqlKeyStore(engine), kek)
    two = Keyring(SqlKeyStore(engine), kek)
    a = one.current("acme")
    b = two.current("acme")  # finds the row one created
    assert (a.key_id, a.version) == (b.key_id, b.version)
    sealed = one.seal("acme", CK, b"x" * 50)
    assert two.open(sealed, tenant="acme", cache_key=CK) == b"x" * 50

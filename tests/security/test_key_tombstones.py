"""A crypto-shredded data key stays destroyed: the runtime role cannot write it back.

A shred leaves ``data_keys`` rows ``state='destroyed', wrapped=NULL``; the runtime role may
UPDATE ``data_keys``. An attacker with those credentials and a copy of a wrapped DEK taken
before the purge (a SELECT, a backup, a lagging replica) tries to restore it, revive the row,
or delete the tombstone so an INSERT can bring the key back; each attempt is refused by the
owner's trigger (migration 0007), which the runtime role cannot drop, and data sealed under the
key stays unreadable in a running and a restarted sidecar. The controls: what kvgov itself does
to ``data_keys`` as the runtime role (creation, rotation, usage counts, a shred, a KEK
provider's re-wrap in place) still works.

The same writes through SQLAlchemy, as the runtime issues statements, are refused on either
dialect (``db_url``): SQLite got its triggers later (a migration on top of 0008), which also
refuse SQLite's own ways around them (``INSERT OR REPLACE``, ``REPLACE``, ``UPDATE OR
REPLACE``, a ``DELETE`` without ``WHERE``). SQLite has no roles: whoever can write its file can
drop them; they hold against the application's own statements.

Roles are cluster-wide and other runs share the server: ``tests/pgroles.py``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import sqlalchemy as sa
from alembic import command
from psycopg import errors as pg_errors

from kvgov.db.engine import alembic_config, make_engine, upgrade
from kvgov.db.keystore import SqlKeyStore
from kvgov.errors import KeyDestroyedError
from kvgov.keys.ids import wrap_aad
from kvgov.keys.kek import FileKekProvider, generate_kek_file
from kvgov.keys.keyring import Keyring
from kvgov.types import KeyState
from tests.pgroles import RoleDatabase, role_database

pytestmark = pytest.mark.postgres

CK = b"digest-of-alice-chunk-0001"
KID = "u:acme:p-alice"
SEG = 4096


@pytest.fixture
def kek(tmp_path: Path) -> FileKekProvider:
    return FileKekProvider(generate_kek_file(tmp_path / "kek.key"))


@pytest.fixture
def db() -> Iterator[RoleDatabase]:
    """Migrated by the owner, the runtime role granted: what ``kvgov db upgrade`` deploys."""
    with role_database() as db:
        upgrade(db.owner_url, runtime_role=db.runtime)
        yield db


def _ring(engine: object, kek: FileKekProvider) -> Keyring:
    return Keyring(SqlKeyStore(engine), kek, segment_size=SEG)  # type: ignore[arg-type]


def _row(db: RoleDatabase, version: int = 1) -> tuple[object, ...]:
    with psycopg.connect(db.admin_dsn) as conn:
        row = conn.execute(
            "SELECT state, wrapped, destroyed_at, usage_count FROM data_keys"
            " WHERE key_id = %s AND version = %s",
            (KID, version),
        ).fetchone()
    assert row is not None
    return tuple(row)


# the attacker's writes, with the wrapped DEK copied before the purge as %(w)s
UNSHRED = [
    (
        "UPDATE data_keys SET wrapped = %(w)s, state = 'retired', destroyed_at = NULL"
        " WHERE key_id = %(k)s AND version = 1"
    ),
    "UPDATE data_keys SET wrapped = %(w)s, state = 'active' WHERE key_id = %(k)s AND version = 1",
    "UPDATE data_keys SET wrapped = %(w)s WHERE key_id = %(k)s AND version = 1",
    "UPDATE data_keys SET state = 'retired' WHERE key_id = %(k)s AND version = 1",
    "UPDATE data_keys SET destroyed_at = NULL WHERE key_id = %(k)s AND version = 1",
    # move the tombstone aside, then insert the key again under its id and version
    "UPDATE data_keys SET version = 99 WHERE key_id = %(k)s AND version = 1",
    "UPDATE data_keys SET key_id = 'u:acme:gone' WHERE key_id = %(k)s AND version = 1",
    # a new row that is not destroyed yet has no bytes, or a 'destroyed' row with bytes
    (
        "INSERT INTO data_keys SELECT key_id, 7, tenant, \"user\", 'retired', NULL, kek_id,"
        " created_at, 0, NULL FROM data_keys WHERE key_id = %(k)s AND version = 1"
    ),
    (
        "INSERT INTO data_keys SELECT key_id, 8, tenant, \"user\", 'destroyed', %(w)s, kek_id,"
        " created_at, 0, now() FROM data_keys WHERE key_id = %(k)s AND version = 1"
    ),
]


@pytest.mark.parametrize("statement", UNSHRED, ids=range(len(UNSHRED)))
def test_runtime_role_cannot_unshred_a_destroyed_key(
    db: RoleDatabase, kek: FileKekProvider, statement: str
) -> None:
    engine = make_engine(db.runtime_url)  # the sidecar and the CLI connect as the runtime role
    try:
        sidecar = _ring(engine, kek)
        secret = os.urandom(10_000)
        sealed = sidecar.seal("acme", CK, secret, user="p-alice")
        with psycopg.connect(db.dsn(db.runtime), autocommit=True) as att:
            copied = att.execute("SELECT wrapped FROM data_keys WHERE key_id = %s", (KID,))
            wrapped = copied.fetchone()[0]  # type: ignore[index]
        assert wrapped is not None

        purge = _ring(engine, kek)  # the purge's key step: a keyring of its own, same store
        assert [k.key_id for k in purge.shred("acme", "p-alice")] == [KID]
        sidecar.shred("acme", "p-alice")  # the purge's tiers@S step on the sidecar
        before = _row(db)
        assert before[:2] == ("destroyed", None)

        with psycopg.connect(db.dsn(db.runtime), autocommit=True) as att:
            with pytest.raises(pg_errors.RaiseException, match="kvgov: data key"):
                att.execute(statement, {"w": wrapped, "k": KID})
        assert _row(db) == before

        for ring in (sidecar, _ring(engine, kek)):  # running, and restarted
            with pytest.raises(KeyDestroyedError):
                ring.open(sealed, tenant="acme", cache_key=CK)
    finally:
        engine.dispose()


def test_a_destroyed_key_cannot_be_deleted_even_by_the_owner(
    db: RoleDatabase, kek: FileKekProvider
) -> None:
    engine = make_engine(db.runtime_url)
    try:
        ring = _ring(engine, kek)
        ring.seal("acme", CK, b"x" * 100, user="p-alice")
        ring.seal("acme", CK, b"x" * 100, user="p-bob")
        ring.shred("acme", "p-alice")
    finally:
        engine.dispose()
    with psycopg.connect(db.dsn(db.owner), autocommit=True) as owner:
        with pytest.raises(pg_errors.RaiseException, match="DELETE of destroyed data key"):
            owner.execute("DELETE FROM data_keys WHERE key_id = %s", (KID,))
        with pytest.raises(pg_errors.RaiseException, match="TRUNCATE"):
            owner.execute("TRUNCATE data_keys")
        # a live key is not a tombstone (nothing in kvgov deletes one, but it is not guarded)
        assert owner.execute("DELETE FROM data_keys WHERE key_id = 'u:acme:p-bob'").rowcount == 1
    with psycopg.connect(db.dsn(db.runtime), autocommit=True) as att:
        with pytest.raises(pg_errors.InsufficientPrivilege):
            att.execute("DELETE FROM data_keys WHERE key_id = %s", (KID,))
        for sql in (
            "ALTER TABLE data_keys DISABLE TRIGGER data_keys_tombstones",
            "DROP TRIGGER data_keys_tombstones ON data_keys",
            "DROP FUNCTION kvgov_data_key_tombstone() CASCADE",
        ):
            with pytest.raises(pg_errors.InsufficientPrivilege):
                att.execute(sql)
    assert _row(db)[0] == "destroyed"


def test_what_kvgov_does_to_data_keys_still_works(db: RoleDatabase, kek: FileKekProvider) -> None:
    """Controls, as the runtime role: create, count usage, rotate, re-wrap in place, shred (and
    count usage a sidecar flushes after a shred elsewhere), then a new version after the shred."""
    engine = make_engine(db.runtime_url)
    try:
        ring = Keyring(SqlKeyStore(engine), kek, segment_size=SEG, usage_batch=1)
        sealed1 = ring.seal("acme", CK, b"one" * 1000, user="p-alice")
        info = ring.rotate("acme", "p-alice")
        assert (info.version, _row(db, 1)[0], _row(db, 2)[0]) == (2, "retired", "active")
        sealed2 = ring.seal("acme", CK, b"two" * 1000, user="p-alice")

        # a KEK provider's re-wrap in place: new bytes for a live row, the same key inside
        store = SqlKeyStore(engine)
        row = store.get(KID, 1)
        assert row is not None and row.wrapped is not None
        dek = kek.unwrap(row.wrapped, wrap_aad(KID, 1, "acme"))
        rewrapped = kek.wrap(dek, wrap_aad(KID, 1, "acme"))
        assert rewrapped != row.wrapped
        with psycopg.connect(db.dsn(db.runtime), autocommit=True) as conn:
            n = conn.execute(
                "UPDATE data_keys SET wrapped = %s WHERE key_id = %s AND version = 1",
                (rewrapped, KID),
            ).rowcount
        assert n == 1
        fresh = _ring(engine, kek)
        assert bytes(fresh.open(sealed1, tenant="acme", cache_key=CK)) == b"one" * 1000

        # another process shreds; this one still flushes the usage it counted meanwhile
        other = Keyring(SqlKeyStore(engine), kek, segment_size=SEG, usage_batch=1000)
        other.seal("acme", CK, b"late", user="p-alice")  # counted in memory, not flushed
        assert [k.version for k in ring.shred("acme", "p-alice")] == [1, 2]
        used = _row(db, 2)[3]
        other.flush_usage()
        assert _row(db, 2)[:2] == ("destroyed", None)
        assert _row(db, 2)[3] == used + 1  # type: ignore[operator]
        assert other.revalidate().dropped == ((KID, 2),)
        for r in (ring, other, _ring(engine, kek)):
            for sealed in (sealed1, sealed2):
                with pytest.raises(KeyDestroyedError):
                    r.open(sealed, tenant="acme", cache_key=CK)

        # the scope's next put creates a new version
        sealed3 = ring.seal("acme", CK, b"three", user="p-alice")
        assert ring.current("acme", "p-alice").version == 3
        assert bytes(_ring(engine, kek).open(sealed3, tenant="acme", cache_key=CK)) == b"three"
        assert store.get(KID, 3).state is KeyState.ACTIVE  # type: ignore[union-attr]
    finally:
        engine.dispose()


def test_upgrade_marks_keys_left_without_bytes_destroyed(kek: FileKekProvider) -> None:
    """A row a shred racing a rotation left ``retired`` with no bytes (before the fix) is
    destroyed by the migration, so every keyring's revalidation drops it."""
    with role_database() as db:
        upgrade(db.owner_url, "0006", runtime_role=db.runtime)
        engine = make_engine(db.runtime_url)
        try:
            ring = _ring(engine, kek)
            ring.seal("acme", CK, b"x" * 10, user="p-alice")
            with psycopg.connect(db.dsn(db.runtime), autocommit=True) as att:
                att.execute(
                    "UPDATE data_keys SET wrapped = NULL, state = 'retired' WHERE key_id = %s",
                    (KID,),
                )
            upgrade(db.owner_url, runtime_role=db.runtime)
            state, wrapped, destroyed_at, _ = _row(db)
            assert (state, wrapped) == ("destroyed", None) and destroyed_at is not None
        finally:
            engine.dispose()


# -- both dialects, through SQLAlchemy --------------------------------------------------------

#: the attacker's writes as SQLAlchemy text, the wrapped DEK copied before the purge as :w
UNSHRED_SQL = [
    (
        "UPDATE data_keys SET wrapped = :w, state = 'retired', destroyed_at = NULL"
        " WHERE key_id = :k AND version = 1"
    ),
    "UPDATE data_keys SET wrapped = :w, state = 'active' WHERE key_id = :k AND version = 1",
    "UPDATE data_keys SET wrapped = :w WHERE key_id = :k AND version = 1",
    "UPDATE data_keys SET state = 'retired' WHERE key_id = :k AND version = 1",
    "UPDATE data_keys SET destroyed_at = NULL WHERE key_id = :k AND version = 1",
    "UPDATE data_keys SET kek_id = 'another-kek' WHERE key_id = :k AND version = 1",
    "UPDATE data_keys SET version = 99 WHERE key_id = :k AND version = 1",
    "UPDATE data_keys SET key_id = 'u:acme:gone' WHERE key_id = :k AND version = 1",
    "UPDATE data_keys SET tenant = 'globex' WHERE key_id = :k AND version = 1",
    "UPDATE data_keys SET \"user\" = 'p-bob' WHERE key_id = :k AND version = 1",
    (
        "INSERT INTO data_keys SELECT key_id, 7, tenant, \"user\", 'retired', NULL, kek_id,"
        " created_at, 0, NULL FROM data_keys WHERE key_id = :k AND version = 1"
    ),
    (
        "INSERT INTO data_keys SELECT key_id, 8, tenant, \"user\", 'destroyed', :w, kek_id,"
        " created_at, 0, CURRENT_TIMESTAMP FROM data_keys WHERE key_id = :k AND version = 1"
    ),
    # an upsert over the tombstone (an UPDATE on both dialects)
    (
        "INSERT INTO data_keys SELECT key_id, version, tenant, \"user\", 'active', :w, kek_id,"
        " created_at, 0, NULL FROM data_keys WHERE key_id = :k AND version = 1"
        " ON CONFLICT (key_id, version) DO UPDATE SET wrapped = excluded.wrapped,"
        " state = excluded.state, destroyed_at = NULL"
    ),
]

#: SQLite's REPLACE deletes the conflicting row without firing DELETE triggers, then inserts
SQLITE_UNSHRED_SQL = [
    (
        "INSERT OR REPLACE INTO data_keys SELECT key_id, version, tenant, \"user\", 'active',"
        " :w, kek_id, created_at, 0, NULL FROM data_keys WHERE key_id = :k AND version = 1"
    ),
    (
        "REPLACE INTO data_keys SELECT key_id, version, tenant, \"user\", 'retired', :w,"
        " kek_id, created_at, 0, NULL FROM data_keys WHERE key_id = :k AND version = 1"
    ),
    # a live row moved onto the tombstone's identity, replacing it
    (
        "UPDATE OR REPLACE data_keys SET key_id = :k, \"user\" = 'p-alice'"
        " WHERE key_id = 'u:acme:p-bob' AND version = 1"
    ),
]

#: deleting the tombstone (then an INSERT could bring the key id and version back)
DELETE_SQL = [
    "DELETE FROM data_keys WHERE key_id = :k AND version = 1",
    "DELETE FROM data_keys WHERE key_id = :k",
    "DELETE FROM data_keys",  # SQLite's truncate optimisation: off while a DELETE trigger exists
]


def _shredded(db_url: str, kek: FileKekProvider) -> tuple[sa.Engine, Keyring, bytearray, bytes]:
    """A migrated ledger where alice's key sealed a chunk, was copied, then shredded (bob's key
    stays live): the engine, the sidecar's keyring, the sealed chunk, the copied wrapped DEK."""
    upgrade(db_url)
    engine = make_engine(db_url)
    sidecar = _ring(engine, kek)
    sealed = sidecar.seal("acme", CK, os.urandom(10_000), user="p-alice")
    sidecar.seal("acme", CK, b"x" * 100, user="p-bob")
    with engine.connect() as conn:
        wrapped = conn.execute(
            sa.text("SELECT wrapped FROM data_keys WHERE key_id = :k"), {"k": KID}
        ).scalar_one()
    assert wrapped is not None
    assert [k.key_id for k in _ring(engine, kek).shred("acme", "p-alice")] == [KID]
    sidecar.shred("acme", "p-alice")
    return engine, sidecar, sealed, bytes(wrapped)


def _rows(engine: sa.Engine) -> list[tuple[object, ...]]:
    with engine.connect() as conn:
        return [
            tuple(r)
            for r in conn.execute(
                sa.text(
                    'SELECT key_id, version, tenant, "user", state, wrapped, kek_id,'
                    " destroyed_at, usage_count FROM data_keys ORDER BY key_id, version"
                )
            )
        ]


def _unshred(db_url: str, kek: FileKekProvider, statement: str) -> None:
    engine, sidecar, sealed, wrapped = _shredded(db_url, kek)
    try:
        before = _rows(engine)
        assert before[0][4:6] == ("destroyed", None)
        with pytest.raises(sa.exc.DBAPIError, match="kvgov: data key"):
            with engine.begin() as conn:  # the runtime's own connection and statements
                conn.execute(sa.text(statement), {"w": wrapped, "k": KID})
        assert _rows(engine) == before
        for ring in (sidecar, _ring(engine, kek)):  # running, and restarted
            with pytest.raises(KeyDestroyedError):
                ring.open(sealed, tenant="acme", cache_key=CK)
    finally:
        engine.dispose()


@pytest.mark.parametrize("statement", UNSHRED_SQL, ids=range(len(UNSHRED_SQL)))
def test_a_destroyed_key_cannot_be_unshredded_on_either_dialect(
    db_url: str, kek: FileKekProvider, statement: str
) -> None:
    _unshred(db_url, kek, statement)


@pytest.mark.parametrize("statement", SQLITE_UNSHRED_SQL, ids=range(len(SQLITE_UNSHRED_SQL)))
def test_sqlite_replace_cannot_bring_a_destroyed_key_back(
    sqlite_url: str, kek: FileKekProvider, statement: str
) -> None:
    _unshred(sqlite_url, kek, statement)


@pytest.mark.parametrize("statement", DELETE_SQL, ids=range(len(DELETE_SQL)))
def test_a_destroyed_key_cannot_be_deleted_on_either_dialect(
    db_url: str, kek: FileKekProvider, statement: str
) -> None:
    engine = _shredded(db_url, kek)[0]
    try:
        before = _rows(engine)
        with pytest.raises(sa.exc.DBAPIError, match="DELETE of destroyed data key"):
            with engine.begin() as conn:
                conn.execute(sa.text(statement), {"k": KID})
        assert _rows(engine) == before
        with engine.begin() as conn:  # a live key is no tombstone (nothing in kvgov deletes one)
            gone = conn.execute(sa.text("DELETE FROM data_keys WHERE key_id = 'u:acme:p-bob'"))
            assert gone.rowcount == 1
    finally:
        engine.dispose()


def test_what_kvgov_does_to_data_keys_still_works_on_either_dialect(
    db_url: str, kek: FileKekProvider
) -> None:
    """Controls: create, count usage, rotate, re-wrap in place, shred, count usage a sidecar
    flushes after a shred elsewhere, then a new version after the shred."""
    upgrade(db_url)
    engine = make_engine(db_url)
    try:
        ring = Keyring(SqlKeyStore(engine), kek, segment_size=SEG, usage_batch=1)
        sealed1 = ring.seal("acme", CK, b"one" * 1000, user="p-alice")
        assert ring.rotate("acme", "p-alice").version == 2
        store = SqlKeyStore(engine)
        row = store.get(KID, 1)
        assert row is not None and row.wrapped is not None and row.state is KeyState.RETIRED
        dek = kek.unwrap(row.wrapped, wrap_aad(KID, 1, "acme"))
        rewrapped = kek.wrap(dek, wrap_aad(KID, 1, "acme"))
        with engine.begin() as conn:
            done = conn.execute(
                sa.text("UPDATE data_keys SET wrapped = :w WHERE key_id = :k AND version = 1"),
                {"w": rewrapped, "k": KID},
            )
            assert done.rowcount == 1
        assert bytes(_ring(engine, kek).open(sealed1, tenant="acme", cache_key=CK)) == b"one" * 1000

        other = Keyring(SqlKeyStore(engine), kek, segment_size=SEG, usage_batch=1000)
        other.seal("acme", CK, b"late", user="p-alice")  # counted in memory, not flushed
        assert [k.version for k in ring.shred("acme", "p-alice")] == [1, 2]
        used = store.get(KID, 2).usage_count  # type: ignore[union-attr]
        other.flush_usage()
        after = store.get(KID, 2)
        assert after is not None and after.state is KeyState.DESTROYED and after.wrapped is None
        assert after.usage_count == used + 1
        assert ring.shred("acme", "p-alice") == []  # a second shred finds nothing to do

        sealed3 = ring.seal("acme", CK, b"three", user="p-alice")
        assert ring.current("acme", "p-alice").version == 3
        assert bytes(_ring(engine, kek).open(sealed3, tenant="acme", cache_key=CK)) == b"three"
    finally:
        engine.dispose()


def _data_key_triggers(engine: sa.Engine) -> set[str]:
    with engine.connect() as conn:
        return set(
            conn.execute(
                sa.text(
                    "SELECT name FROM sqlite_master WHERE type = 'trigger'"
                    " AND tbl_name = 'data_keys'"
                )
            ).scalars()
        )


def test_the_sqlite_guard_installs_on_an_existing_ledger_and_comes_off(
    sqlite_url: str, kek: FileKekProvider
) -> None:
    """From 0009 (no SQLite guard) to head and back: a row left without bytes is destroyed on
    the way up; the downgrade removes the triggers and nothing else."""
    upgrade(sqlite_url, "0009")
    engine = make_engine(sqlite_url)
    try:
        ring = _ring(engine, kek)
        ring.seal("acme", CK, b"x" * 100, user="p-alice")
        ring.seal("acme", CK, b"x" * 100, user="p-bob")
        ring.seal("acme", CK, b"x" * 100, user="p-carol")
        with engine.connect() as conn:
            wrapped = conn.execute(
                sa.text("SELECT wrapped FROM data_keys WHERE key_id = :k"), {"k": KID}
            ).scalar_one()
        ring.shred("acme", "p-alice")
        revive = "UPDATE data_keys SET wrapped = :w, state = 'retired' WHERE key_id = :k"
        with engine.begin() as conn:  # what a shred racing a rotation left before 0007's fix
            conn.execute(
                sa.text(
                    "UPDATE data_keys SET wrapped = NULL, state = 'retired'"
                    " WHERE key_id = 'u:acme:p-bob'"
                )
            )
            conn.execute(  # and one marked destroyed whose bytes survived
                sa.text("UPDATE data_keys SET state = 'destroyed' WHERE key_id = 'u:acme:p-carol'")
            )
        assert _data_key_triggers(engine) == set()

        upgrade(sqlite_url)
        assert len(_data_key_triggers(engine)) == 6
        bob = SqlKeyStore(engine).get("u:acme:p-bob", 1)
        assert bob is not None and bob.state is KeyState.DESTROYED and bob.destroyed_at
        carol = SqlKeyStore(engine).get("u:acme:p-carol", 1)
        assert carol is not None and carol.state is KeyState.DESTROYED
        scrubbed = carol.wrapped is None  # (no wrapped bytes in a failure's message)
        assert scrubbed, "a row marked destroyed kept its wrapped bytes"
        with pytest.raises(sa.exc.DBAPIError, match="kvgov: data key was destroyed"):
            with engine.begin() as conn:
                conn.execute(sa.text(revive), {"w": wrapped, "k": KID})

        command.downgrade(alembic_config(sqlite_url), "0009")
        assert _data_key_triggers(engine) == set()
        with engine.begin() as conn:  # the hole the guard closes is open again
            assert conn.execute(sa.text(revive), {"w": wrapped, "k": KID}).rowcount == 1
        upgrade(sqlite_url)
        assert len(_data_key_triggers(engine)) == 6
    finally:
        engine.dispose()

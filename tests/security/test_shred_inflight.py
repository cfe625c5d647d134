"""A shred reaches what is already in progress.

* A put sealing segment by segment, and a streamed get opening segment by segment, hold a
  ``KeyHandle`` built before the shred: the next segment fails with ``KeyDestroyedError``
  (docs/keys.md: "a put already holding the handle fails rather than seal under it").
* A rotation reads the latest version, then retires it: a shred landing in between must leave
  the row destroyed (not ``retired`` without bytes), so every other sidecar's revalidation drops
  its cached copy. On SQLite and on Postgres as the runtime role (where the tombstone trigger
  of migration 0007 is in place, and the rotation must still go through).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from sqlalchemy import Engine

from kvgov.db.engine import make_engine, upgrade
from kvgov.db.keystore import SqlKeyStore
from kvgov.errors import KeyDestroyedError
from kvgov.keys.kek import FileKekProvider, generate_kek_file
from kvgov.keys.keyring import Keyring
from kvgov.keys.sealed import sealed_size
from kvgov.keys.store import InMemoryKeyStore
from kvgov.types import KeyState, WrappedKey
from tests.pgroles import role_database

CK = b"digest-of-chunk"
SEG = 4096
KID = "u:acme:p-alice"


@pytest.fixture
def kek(tmp_path: Path) -> FileKekProvider:
    return FileKekProvider(generate_kek_file(tmp_path / "kek.key"))


def test_a_put_in_progress_fails_after_a_shred(kek: FileKekProvider) -> None:
    ring = Keyring(InMemoryKeyStore(), kek, segment_size=SEG)
    plain = os.urandom(3 * SEG)
    dst = bytearray(sealed_size(len(plain), SEG))
    writer = ring.sealer("acme", CK, len(plain), dst, user="p-alice", segment_size=SEG)
    writer.seal_segment(0, plain[:SEG])
    before = bytes(dst)

    ring.shred("acme", "p-alice")  # the purge's key step / tiers@S step on this sidecar

    with pytest.raises(KeyDestroyedError):
        writer.seal_segment(1, plain[SEG : 2 * SEG])
    assert bytes(dst) == before  # nothing sealed under the destroyed key
    with pytest.raises(KeyDestroyedError):
        writer.seal_segment(2, plain[2 * SEG :])


def test_a_streamed_get_in_progress_fails_after_a_shred(kek: FileKekProvider) -> None:
    ring = Keyring(InMemoryKeyStore(), kek, segment_size=SEG)
    plain = os.urandom(3 * SEG)
    sealed = ring.seal("acme", CK, plain, user="p-alice")
    reader = ring.reader(sealed, tenant="acme", cache_key=CK)
    out = bytearray(len(plain))
    reader.open_segment(0, memoryview(out)[:SEG])
    assert bytes(out[:SEG]) == plain[:SEG]

    ring.shred("acme", "p-alice")

    with pytest.raises(KeyDestroyedError):
        reader.open_segment(1, memoryview(out)[SEG : 2 * SEG])
    assert bytes(out[SEG:]) == bytes(2 * SEG)  # no plaintext after the shred
    # a whole open in progress hands nothing back either
    whole = bytearray(b"\xff" * len(plain))
    with pytest.raises(KeyDestroyedError):
        reader.open_into(whole)
    assert bytes(whole) == bytes(len(plain))


def test_a_revalidation_stops_a_put_in_progress(kek: FileKekProvider) -> None:
    """Shredded by another process: the sidecar's revalidation destroys the handle a put holds."""
    store = InMemoryKeyStore()
    sidecar = Keyring(store, kek, segment_size=SEG)
    plain = os.urandom(2 * SEG)
    dst = bytearray(sealed_size(len(plain), SEG))
    writer = sidecar.sealer("acme", CK, len(plain), dst, user="p-alice", segment_size=SEG)
    writer.seal_segment(0, plain[:SEG])
    Keyring(store, kek, segment_size=SEG).shred("acme", "p-alice")  # `kvgov keys shred`
    assert sidecar.revalidate().dropped == ((KID, 1),)
    with pytest.raises(KeyDestroyedError):
        writer.seal_segment(1, plain[SEG:])


class RacingStore(SqlKeyStore):
    """The real SQL store; another process's shred lands right after ``latest``."""

    race: Keyring | None = None

    def latest(self, key_id: str) -> WrappedKey | None:
        row = super().latest(key_id)
        racer, self.race = self.race, None
        if racer is not None:
            racer.shred("acme", "p-alice")  # `kvgov keys shred` / a purge, elsewhere
        return row


@pytest.fixture(params=["sqlite", "postgres"])
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'ledger.db'}"
        upgrade(url)
        engine = make_engine(url)
        yield engine
        engine.dispose()
        return
    with role_database() as db:
        upgrade(db.owner_url, runtime_role=db.runtime)
        engine = make_engine(db.runtime_url)
        yield engine
        engine.dispose()


def test_a_rotation_racing_a_shred_leaves_the_key_destroyed(
    kek: FileKekProvider, engine: Engine
) -> None:
    other = Keyring(SqlKeyStore(engine), kek, segment_size=SEG)  # another sidecar
    plain = os.urandom(5000)
    sealed = other.seal("acme", CK, plain, user="p-alice")

    store = RacingStore(engine)
    rotating = Keyring(store, kek, segment_size=SEG)  # `kvgov keys rotate` / usage rotation
    rotating.get(KID, 1)  # it had the key cached too
    store.race = Keyring(SqlKeyStore(engine), kek, segment_size=SEG)
    info = rotating.rotate("acme", "p-alice")
    assert info.version == 2 and info.state is KeyState.ACTIVE

    row = SqlKeyStore(engine).get(KID, 1)
    assert row is not None
    assert (row.state, row.wrapped) == (KeyState.DESTROYED, None)
    assert other.revalidate().dropped == ((KID, 1),)
    for ring in (other, rotating, Keyring(SqlKeyStore(engine), kek, segment_size=SEG)):
        with pytest.raises(KeyDestroyedError):
            ring.open(sealed, tenant="acme", cache_key=CK)
    # the new version works for new data, everywhere
    sealed2 = rotating.seal("acme", CK, b"new", user="p-alice")
    assert bytes(other.open(sealed2, tenant="acme", cache_key=CK)) == b"new"


def test_revalidation_drops_a_version_left_without_bytes(kek: FileKekProvider) -> None:
    """A row a store reports ``retired`` yet without wrapped bytes counts as destroyed."""
    store = InMemoryKeyStore()
    sidecar = Keyring(store, kek, segment_size=SEG)
    sealed = sidecar.seal("acme", CK, b"x" * 100, user="p-alice")
    row = store.get(KID, 1)
    assert row is not None
    # what the old race left behind
    store._rows[(KID, 1)] = replace(row, state=KeyState.RETIRED, wrapped=None)
    assert store.states([KID]) == {(KID, 1): KeyState.DESTROYED}
    assert store.set_state(KID, 1, KeyState.ACTIVE) is False
    assert sidecar.revalidate().dropped == ((KID, 1),)
    with pytest.raises(KeyDestroyedError):
        sidecar.open(sealed, tenant="acme", cache_key=CK)
    # and the scope's next put creates a new version instead of failing on the empty row
    assert sidecar.current("acme", "p-alice").version == 2

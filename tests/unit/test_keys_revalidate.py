"""``Keyring.revalidate``: a keyring catches up with shreds and rotations made by another
keyring sharing its store (here two real keyrings over the real in-memory store and a real KEK
file: the second stands for the CLI or another sidecar)."""

from __future__ import annotations

import os
from collections.abc import Collection
from pathlib import Path

import pytest

from kvgov.errors import KeyDestroyedError, KeyNotFoundError
from kvgov.keys.kek import FileKekProvider, generate_kek_file
from kvgov.keys.keyring import Keyring
from kvgov.keys.revalidate import REVALIDATE_BATCH, plan
from kvgov.keys.sealed import parse_header
from kvgov.keys.store import InMemoryKeyStore
from kvgov.types import KeyState

CK = b"llama|chunk-0007"


class CountingStore(InMemoryKeyStore):
    """The real in-memory store, counting ``states`` reads and the key ids each one asked."""

    def __init__(self) -> None:
        super().__init__()
        self.state_reads: list[int] = []

    def states(self, key_ids: Collection[str]) -> dict[tuple[str, int], KeyState]:
        self.state_reads.append(len(key_ids))
        return super().states(key_ids)


@pytest.fixture
def kek(tmp_path: Path) -> FileKekProvider:
    return FileKekProvider(generate_kek_file(tmp_path / "kek.key"))


@pytest.fixture
def store() -> CountingStore:
    return CountingStore()


@pytest.fixture
def node(store: CountingStore, kek: FileKekProvider) -> Keyring:
    """The running sidecar's keyring."""
    return Keyring(store, kek, segment_size=4096)


@pytest.fixture
def elsewhere(store: CountingStore, kek: FileKekProvider) -> Keyring:
    """Another process on the same store: ``kvgov keys``, another sidecar."""
    return Keyring(store, kek, segment_size=4096)


def test_a_shred_elsewhere_drops_the_cached_key(node: Keyring, elsewhere: Keyring) -> None:
    acme, globex, alice = os.urandom(9000), os.urandom(5000), os.urandom(3000)
    sealed = node.seal("acme", CK, acme)
    other = node.seal("globex", CK, globex)
    user = node.seal("acme", CK, alice, user="p-alice")
    held = node.current("acme")

    assert [k.key_id for k in elsewhere.shred("acme", "p-alice")] == ["u:acme:p-alice"]
    # the window: until it revalidates, the node still holds its copy
    assert node.open(user, tenant="acme", cache_key=CK) == alice

    done = node.revalidate()
    assert done.dropped == (("u:acme:p-alice", 1),)
    assert done.checked == 3
    with pytest.raises(KeyDestroyedError, match="was destroyed"):
        node.open(user, tenant="acme", cache_key=CK)
    assert node.open(sealed, tenant="acme", cache_key=CK) == acme  # the tenant key lives on
    assert not held.destroyed

    elsewhere.shred("acme")
    done = node.revalidate()
    assert done.dropped == (("t:acme", 1),)
    assert done.forgotten == ("t:acme",)
    assert held.destroyed  # a seal still holding the handle fails too
    with pytest.raises(KeyDestroyedError):
        held.aead  # noqa: B018
    with pytest.raises(KeyDestroyedError):
        node.open(sealed, tenant="acme", cache_key=CK)
    assert node.open(other, tenant="globex", cache_key=CK) == globex  # other tenants unaffected

    # new data for the shredded scope goes under a new version, never the destroyed one
    fresh = node.seal("acme", CK, b"after" * 100)
    assert parse_header(fresh).key_version == 2
    assert node.open(fresh, tenant="acme", cache_key=CK) == b"after" * 100
    assert not node.revalidate().changed


def test_a_rotation_elsewhere_moves_new_data_to_the_new_version(
    node: Keyring, elsewhere: Keyring, store: CountingStore
) -> None:
    old = node.seal("acme", CK, b"v1" * 2000)
    node.seal("globex", CK, b"g" * 100)
    assert elsewhere.rotate("acme").version == 2
    assert parse_header(node.seal("acme", CK, b"x")).key_version == 1  # not seen yet

    done = node.revalidate()
    assert done.renewed == (("t:acme", 2),)
    assert done.dropped == ()
    new = node.seal("acme", CK, b"v2" * 2000)
    assert parse_header(new).key_version == 2
    assert node.open(old, tenant="acme", cache_key=CK) == b"v1" * 2000
    assert elsewhere.open(new, tenant="acme", cache_key=CK) == b"v2" * 2000
    assert parse_header(node.seal("globex", CK, b"g")).key_version == 1
    # the node used the other's version: it created none of its own
    assert [(r.key_id, r.version, r.state) for r in store.versions()] == [
        ("t:acme", 1, KeyState.RETIRED),
        ("t:acme", 2, KeyState.ACTIVE),
        ("t:globex", 1, KeyState.ACTIVE),
    ]


def test_one_store_read_per_batch_and_none_when_nothing_is_cached(
    node: Keyring, store: CountingStore
) -> None:
    assert node.revalidate().checked == 0
    assert store.state_reads == []
    for i in range(REVALIDATE_BATCH + 1):
        node.current(f"t{i}")
    done = node.revalidate()
    assert done.checked == REVALIDATE_BATCH + 1
    assert not done.changed
    assert store.state_reads == [REVALIDATE_BATCH, 1]


def test_a_row_gone_from_the_store_is_dropped_too(node: Keyring, store: CountingStore) -> None:
    sealed = node.seal("acme", CK, b"a" * 100)
    del store._rows[("t:acme", 1)]  # e.g. a database restored from before the key existed
    assert node.revalidate().dropped == (("t:acme", 1),)
    with pytest.raises(KeyNotFoundError):
        node.open(sealed, tenant="acme", cache_key=CK)


def test_plan_only_touches_what_was_cached_when_it_read() -> None:
    states = {
        ("t:a", 1): KeyState.RETIRED,
        ("t:a", 2): KeyState.ACTIVE,
        ("t:b", 1): KeyState.DESTROYED,
        ("t:c", 3): KeyState.ACTIVE,
        ("t:d", 1): KeyState.RETIRED,
    }
    cached = [("t:a", 1), ("t:b", 1), ("t:c", 3), ("t:d", 1)]
    active = {"t:a": 1, "t:b": 1, "t:c": 3, "t:d": 1}
    todo = plan(cached, active, states)
    assert todo.drop == {("t:b", 1)}
    assert todo.renew == {"t:a": 2}
    assert todo.forget == {"t:b", "t:d"}
    # a version this process created after the read (t:c v4) is not in ``cached``: kept
    assert plan([("t:c", 3)], {"t:c": 3}, states).drop == frozenset()

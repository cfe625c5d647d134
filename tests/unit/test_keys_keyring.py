"""The keyring over a real KEK file and the in-memory store: scopes, rotation, shredding, usage."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from kvgov.config import Settings
from kvgov.errors import KeyDestroyedError, KeyManagementError, KeyNotFoundError, SealError
from kvgov.keys.kek import FileKekProvider, generate_kek_file
from kvgov.keys.keyring import KeyInfo, Keyring, tenant_of
from kvgov.keys.sealed import parse_header, sealed_size
from kvgov.keys.store import InMemoryKeyStore
from kvgov.types import EventKind, KeyState, WrappedKey

CK = b"llama|chunk-0001"


class CountingStore(InMemoryKeyStore):
    """The real in-memory store, counting add_usage calls (to show usage is batched)."""

    def __init__(self) -> None:
        super().__init__()
        self.usage_calls = 0

    def add_usage(self, key_id: str, version: int, count: int) -> None:
        self.usage_calls += 1
        super().add_usage(key_id, version, count)


@pytest.fixture
def kek(tmp_path: Path) -> FileKekProvider:
    return FileKekProvider(generate_kek_file(tmp_path / "kek.key"))


@pytest.fixture
def store() -> CountingStore:
    return CountingStore()


@pytest.fixture
def changes() -> list[tuple[EventKind, WrappedKey]]:
    return []


@pytest.fixture
def ring(
    store: CountingStore, kek: FileKekProvider, changes: list[tuple[EventKind, WrappedKey]]
) -> Keyring:
    return Keyring(store, kek, segment_size=4096, on_change=lambda k, r: changes.append((k, r)))


def test_tenant_and_user_keys_are_distinct_scopes(ring: Keyring, store: CountingStore) -> None:
    t = ring.current("acme")
    u = ring.current("acme", "p-42")
    assert (t.key_id, t.version, t.user) == ("t:acme", 1, None)
    assert (u.key_id, u.version, u.user) == ("u:acme:p-42", 1, "p-42")
    assert ring.current("acme") is t
    rows = store.versions("acme")
    assert [(r.key_id, r.state) for r in rows] == [
        ("t:acme", KeyState.ACTIVE),
        ("u:acme:p-42", KeyState.ACTIVE),
    ]
    assert all(r.wrapped is not None and len(r.wrapped) == 1 + 12 + 32 + 16 for r in rows)
    assert "t:acme" in repr(t)


def test_round_trip_through_the_keyring(ring: Keyring) -> None:
    data = os.urandom(10_000)
    sealed = ring.seal("acme", CK, data, user="p-1")
    assert parse_header(sealed).key_id == "u:acme:p-1"
    assert ring.open(sealed, tenant="acme", cache_key=CK) == data
    out = bytearray(len(data))
    assert ring.open_into(sealed, out, tenant="acme", cache_key=CK) == len(data)
    assert out == data


def test_streaming_sealer_records_the_key_used(ring: Keyring) -> None:
    data = os.urandom(9000)
    dst = bytearray(sealed_size(len(data), 4096))
    writer = ring.sealer("acme", CK, len(data), dst)
    assert (writer.key.key_id, writer.key.version) == ("t:acme", 1)
    writer.seal_from(data)
    assert ring.open(dst, tenant="acme", cache_key=CK) == data


def test_another_tenant_cannot_open_it(ring: Keyring) -> None:
    sealed = ring.seal("acme", CK, b"secret kv" * 100)
    ring.current("globex")
    with pytest.raises(SealError, match="another tenant"):
        ring.open(sealed, tenant="globex", cache_key=CK)
    with pytest.raises(SealError, match="another cache key"):
        ring.open(sealed, tenant="acme", cache_key=b"other")


def test_rotation_keeps_old_data_readable_and_new_data_uses_v2(
    ring: Keyring, changes: list[tuple[EventKind, WrappedKey]]
) -> None:
    old = os.urandom(5000)
    sealed_v1 = ring.seal("acme", CK, old)
    assert parse_header(sealed_v1).key_version == 1
    info = ring.rotate("acme")
    assert (info.key_id, info.version, info.state) == ("t:acme", 2, KeyState.ACTIVE)
    new = os.urandom(5000)
    sealed_v2 = ring.seal("acme", CK, new)
    assert parse_header(sealed_v2).key_version == 2
    assert ring.open(sealed_v1, tenant="acme", cache_key=CK) == old
    assert ring.open(sealed_v2, tenant="acme", cache_key=CK) == new
    states = [(k.version, k.state) for k in ring.list("acme")]
    assert states == [(1, KeyState.RETIRED), (2, KeyState.ACTIVE)]
    assert [k for k, _ in changes] == [EventKind.KEY_CREATED, EventKind.KEY_ROTATED]


def test_rotation_survives_a_restart(store: CountingStore, kek: FileKekProvider) -> None:
    first = Keyring(store, kek)
    sealed_v1 = first.seal("acme", CK, b"a" * 3000)
    first.rotate("acme")
    second = Keyring(store, kek)  # a fresh process: nothing cached, rows in the store
    assert second.current("acme").version == 2
    assert second.open(sealed_v1, tenant="acme", cache_key=CK) == b"a" * 3000


def test_automatic_rotation_by_usage(store: CountingStore, kek: FileKekProvider) -> None:
    ring = Keyring(store, kek, rotate_after_chunks=3, usage_batch=2)
    versions = [parse_header(ring.seal("acme", CK, b"x" * 10)).key_version for _ in range(7)]
    assert versions == [1, 1, 1, 2, 2, 2, 3]
    usage = {k.version: (k.usage_count, k.state) for k in ring.list("acme")}
    assert usage == {1: (3, KeyState.RETIRED), 2: (3, KeyState.RETIRED), 3: (1, KeyState.ACTIVE)}


def test_usage_is_counted_per_version_and_batched(ring: Keyring, store: CountingStore) -> None:
    for _ in range(10):
        ring.seal("acme", CK, b"x")
    assert store.usage_calls == 0  # still in memory
    assert [k.usage_count for k in ring.list("acme")] == [10]  # list flushes
    assert store.usage_calls == 1
    ring.rotate("acme")
    ring.seal("acme", CK, b"x")
    ring.flush_usage()
    assert [(k.version, k.usage_count) for k in ring.list("acme")] == [(1, 10), (2, 1)]


def test_shred_destroys_rows_and_memory_copies(
    ring: Keyring, store: CountingStore, changes: list[tuple[EventKind, WrappedKey]]
) -> None:
    acme = ring.seal("acme", CK, b"acme data" * 50)
    acme_user = ring.seal("acme", CK, b"user data" * 50, user="p-7")
    globex = ring.seal("globex", CK, b"globex data" * 50)
    held = ring.current("acme")
    ring.rotate("acme")
    destroyed = ring.shred("acme")
    assert sorted((k.key_id, k.version) for k in destroyed) == [
        ("t:acme", 1),
        ("t:acme", 2),
        ("u:acme:p-7", 1),
    ]
    assert all(isinstance(k, KeyInfo) and k.state is KeyState.DESTROYED for k in destroyed)
    assert all(r.wrapped is None for r in store.versions("acme"))
    for sealed in (acme, acme_user):
        with pytest.raises(KeyDestroyedError, match="destroyed"):
            ring.open(sealed, tenant="acme", cache_key=CK)
    with pytest.raises(KeyDestroyedError):
        held.aead  # noqa: B018 - a handle held across the shred is dead too
    assert ring.open(globex, tenant="globex", cache_key=CK) == b"globex data" * 50
    assert [k for k, _ in changes].count(EventKind.KEY_SHREDDED) == 3
    assert ring.shred("acme") == []  # nothing left to destroy
    # a fresh process with the same store cannot open it either
    with pytest.raises(KeyDestroyedError):
        Keyring(store, ring._kek).open(acme, tenant="acme", cache_key=CK)


def test_shred_one_user_leaves_the_tenant_key(ring: Keyring) -> None:
    tenant_data = ring.seal("acme", CK, b"t" * 100)
    user_data = ring.seal("acme", CK, b"u" * 100, user="p-1")
    other_user = ring.seal("acme", CK, b"o" * 100, user="p-2")
    destroyed = ring.shred("acme", "p-1")
    assert [(k.key_id, k.version) for k in destroyed] == [("u:acme:p-1", 1)]
    with pytest.raises(KeyDestroyedError):
        ring.open(user_data, tenant="acme", cache_key=CK)
    assert ring.open(tenant_data, tenant="acme", cache_key=CK) == b"t" * 100
    assert ring.open(other_user, tenant="acme", cache_key=CK) == b"o" * 100
    # the user comes back: new data gets a new version, the shredded one stays destroyed
    assert ring.current("acme", "p-1").version == 2
    with pytest.raises(KeyDestroyedError):
        ring.open(user_data, tenant="acme", cache_key=CK)


def test_bounded_cache_reloads_from_the_store(store: CountingStore, kek: FileKekProvider) -> None:
    ring = Keyring(store, kek, cache_max=2)
    sealed = {t: ring.seal(t, CK, t.encode() * 10) for t in ("a", "b", "c", "d", "e")}
    assert len(ring._cache) <= 2
    for t, s in sealed.items():
        assert ring.open(s, tenant=t, cache_key=CK) == t.encode() * 10


def test_another_kek_cannot_unwrap_the_rows(
    store: CountingStore, kek: FileKekProvider, tmp_path: Path
) -> None:
    sealed = Keyring(store, kek).seal("acme", CK, b"x" * 10)
    other = FileKekProvider(generate_kek_file(tmp_path / "other.key"))
    with pytest.raises(KeyManagementError, match="does not unwrap"):
        Keyring(store, other).open(sealed, tenant="acme", cache_key=CK)


def test_unknown_version(ring: Keyring) -> None:
    with pytest.raises(KeyNotFoundError):
        ring.get("t:acme", 9)


@pytest.mark.parametrize(
    "tenant", ["", "a:b", "a b", "x" * 65, "tab\t", "nb\u00a0sp", "fs\x1c", "ls\u2028"]
)
def test_invalid_tenant_names(ring: Keyring, tenant: str) -> None:
    for _ in range(2):  # key ids are remembered per scope: a refusal is not
        with pytest.raises(KeyManagementError):
            ring.current(tenant)
        with pytest.raises(KeyManagementError):
            ring.current("acme", user=tenant if 0 < len(tenant) <= 64 else "p1:")


def test_tenant_of() -> None:
    assert tenant_of("t:acme") == "acme"
    assert tenant_of("u:acme:p1") == "acme"
    assert tenant_of("u:acme") is None
    assert tenant_of("x:acme") is None


def test_concurrent_sealing_counts_every_chunk(store: CountingStore, kek: FileKekProvider) -> None:
    ring = Keyring(store, kek, usage_batch=7, rotate_after_chunks=15)
    results: list[tuple[bytes, bytearray]] = []
    lock = threading.Lock()

    def work(n: int) -> None:
        for i in range(40):
            data = f"{n}-{i}".encode() * 30
            sealed = ring.seal("acme" if i % 2 else "globex", CK, data, user=f"p{n % 3}")
            with lock:
                results.append((data, sealed))

    threads = [threading.Thread(target=work, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for data, sealed in results:
        tenant = "acme" if parse_header(sealed).key_id.startswith("u:acme") else "globex"
        assert ring.open(sealed, tenant=tenant, cache_key=CK) == data
    assert sum(k.usage_count for k in ring.list()) == 240
    # rotation happens before the next chunk; racing sealers may overshoot by one chunk each
    assert all(k.usage_count <= 15 + len(threads) for k in ring.list())
    assert any(k.state is KeyState.RETIRED for k in ring.list())


def test_from_settings(tmp_path: Path, store: CountingStore) -> None:
    generate_kek_file(tmp_path / "kek.key")
    settings = Settings(data_dir=tmp_path)
    ring = Keyring.from_settings(settings, store)
    assert ring.segment_size == settings.keys.segment_size
    assert ring.open(ring.seal("acme", CK, b"x"), tenant="acme", cache_key=CK) == b"x"


def test_close_flushes_usage(store: CountingStore, kek: FileKekProvider) -> None:
    ring = Keyring(store, kek)
    sealed = ring.seal("acme", CK, b"x")
    ring.close()
    assert [k.usage_count for k in InMemoryKeyStore.versions(store, "acme")] == [1]
    assert ring.open(sealed, tenant="acme", cache_key=CK) == b"x"  # reloads from the store


class FlakyStore(InMemoryKeyStore):
    """The in-memory store with a switch that makes add_usage fail (a stand-in for a database
    outage, which cannot be produced on demand here without disturbing other tests)."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False

    def add_usage(self, key_id: str, version: int, count: int) -> None:
        if self.down:
            raise ConnectionError("database unreachable")
        super().add_usage(key_id, version, count)


def test_a_failed_usage_flush_never_fails_a_seal(kek: FileKekProvider) -> None:
    store = FlakyStore()
    ring = Keyring(store, kek, usage_batch=2)
    ring.current("acme")
    store.down = True
    sealed = [ring.seal("acme", CK, b"x") for _ in range(5)]  # flushes fail, seals do not
    store.down = False
    ring.flush_usage()
    assert [k.usage_count for k in ring.list("acme")] == [5]
    assert all(ring.open(s, tenant="acme", cache_key=CK) == b"x" for s in sealed)

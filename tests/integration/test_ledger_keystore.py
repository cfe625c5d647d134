"""One contract for every ``WrappedKeyStore``: the in-memory one and ``SqlKeyStore`` on SQLite
and Postgres run the same tests."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime

import pytest

from kvgov.db.engine import make_engine, upgrade
from kvgov.db.keystore import SqlKeyStore
from kvgov.keys.store import InMemoryKeyStore, WrappedKeyStore
from kvgov.types import KeyState, WrappedKey

pytestmark = pytest.mark.postgres

NOW = datetime(2026, 3, 4, 5, 6, 7, 123456, tzinfo=UTC)


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def store(request: pytest.FixtureRequest) -> Iterator[WrappedKeyStore]:
    if request.param == "memory":
        yield InMemoryKeyStore()
        return
    url = request.getfixturevalue("pg_url" if request.param == "postgres" else "sqlite_url")
    upgrade(url)
    engine = make_engine(url)
    yield SqlKeyStore(engine)
    engine.dispose()


def key(key_id: str, version: int, tenant: str = "acme", user: str | None = None) -> WrappedKey:
    return WrappedKey(
        key_id=key_id,
        version=version,
        tenant=tenant,
        user=user,
        state=KeyState.ACTIVE,
        wrapped=bytes([version]) * 40,
        kek_id="kek-1",
        created_at=NOW,
    )


def test_add_get_latest_round_trip(store: WrappedKeyStore) -> None:
    k1, k2 = key("t:acme", 1), key("t:acme", 2)
    store.add(k1)
    store.add(k2)
    assert store.get("t:acme", 1) == k1  # byte for byte, aware timestamp included
    assert store.latest("t:acme") == k2
    assert store.get("t:acme", 3) is None
    assert store.latest("t:nobody") is None
    with pytest.raises(ValueError, match="exists"):
        store.add(key("t:acme", 1))


def test_versions_are_ordered_and_filtered(store: WrappedKeyStore) -> None:
    for k in (key("u:acme:b", 1, user="b"), key("t:acme", 2), key("t:acme", 1)):
        store.add(k)
    store.add(key("t:globex", 1, tenant="globex"))
    assert [(k.key_id, k.version) for k in store.versions("acme")] == [
        ("t:acme", 1),
        ("t:acme", 2),
        ("u:acme:b", 1),
    ]
    assert len(store.versions()) == 4


def test_state_and_usage(store: WrappedKeyStore) -> None:
    store.add(key("t:acme", 1))
    store.set_state("t:acme", 1, KeyState.RETIRED)
    store.add_usage("t:acme", 1, 5)
    store.add_usage("t:acme", 1, 7)
    got = store.get("t:acme", 1)
    assert got is not None
    assert (got.state, got.usage_count) == (KeyState.RETIRED, 12)
    with pytest.raises(KeyError):
        store.set_state("t:acme", 9, KeyState.RETIRED)
    with pytest.raises(KeyError):
        store.add_usage("t:acme", 9, 1)


def test_destroy_a_user_then_a_tenant(store: WrappedKeyStore) -> None:
    store.add(key("t:acme", 1))
    store.add(key("u:acme:alice", 1, user="alice"))
    store.add(key("u:acme:alice", 2, user="alice"))
    store.add(key("u:acme:bob", 1, user="bob"))
    store.add(key("t:globex", 1, tenant="globex"))

    gone = store.destroy("acme", "alice")
    assert sorted((k.key_id, k.version) for k in gone) == [("u:acme:alice", 1), ("u:acme:alice", 2)]
    assert all(k.state is KeyState.DESTROYED and k.wrapped is None for k in gone)
    assert all(k.destroyed_at is not None for k in gone)
    stored = store.get("u:acme:alice", 2)
    assert stored is not None and stored.wrapped is None and stored.state is KeyState.DESTROYED
    assert store.destroy("acme", "alice") == []  # already destroyed: not repeated

    gone = store.destroy("acme", None)  # the whole tenant: tenant key and remaining user keys
    assert sorted(k.key_id for k in gone) == ["t:acme", "u:acme:bob"]
    assert all(k.wrapped is None for k in store.versions("acme"))
    kept = store.get("t:globex", 1)
    assert kept is not None and kept.wrapped == bytes([1]) * 40


def test_destroy_survives_another_writer_committing_between_its_read_and_its_writes(
    sqlite_url: str,
) -> None:
    """On SQLite a transaction that reads, then writes, fails at once ("database is locked")
    if another connection committed in between, unless it took the write lock at BEGIN. The
    ledger writer commits all the time, so a purge's key shredding met this in the demo."""
    import threading

    from sqlalchemy import event, text

    upgrade(url := sqlite_url)
    engine, other = make_engine(url), make_engine(url)
    store = SqlKeyStore(engine)
    store.add(key("t:acme", 1))
    done = threading.Event()

    def write_elsewhere() -> None:
        with other.begin() as conn:
            conn.execute(text("UPDATE data_keys SET usage_count = usage_count + 1 WHERE 0"))
            conn.execute(text("CREATE TABLE IF NOT EXISTS scratch (n INTEGER)"))
        done.set()

    fired: list[str] = []

    def after_read(conn: object, cursor: object, statement: str, *args: object) -> None:
        if statement.lstrip().upper().startswith("SELECT") and not fired:
            fired.append(statement)
            threading.Thread(target=write_elsewhere, daemon=True).start()
            done.wait(0.5)  # with the write lock held, the other writer waits for our commit

    event.listen(engine, "after_cursor_execute", after_read)
    try:
        destroyed = store.destroy("acme", None)
        assert [(k.key_id, k.version) for k in destroyed] == [("t:acme", 1)]
        assert fired, "destroy read nothing first: the race this test sets up did not happen"
        assert done.wait(15), "the other writer never got its turn"
        got = store.get("t:acme", 1)
        assert got is not None and got.state is KeyState.DESTROYED
    finally:
        engine.dispose()
        other.dispose()

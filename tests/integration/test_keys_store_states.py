"""``WrappedKeyStore.states`` (what ``Keyring.revalidate`` reads) on every store: the in-memory
one and ``SqlKeyStore`` on SQLite and Postgres run the same contract."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime

import pytest

from kvgov.db.engine import make_engine, upgrade
from kvgov.db.keystore import SqlKeyStore
from kvgov.keys.store import InMemoryKeyStore, WrappedKeyStore
from kvgov.types import KeyState, WrappedKey

pytestmark = pytest.mark.postgres

NOW = datetime(2026, 3, 4, 5, 6, 7, tzinfo=UTC)


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


def key(key_id: str, version: int, tenant: str, user: str | None = None) -> WrappedKey:
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


def test_states_of_every_version_of_the_key_ids_asked(store: WrappedKeyStore) -> None:
    for k in (
        key("t:acme", 1, "acme"),
        key("t:acme", 2, "acme"),
        key("u:acme:p1", 1, "acme", "p1"),
        key("t:globex", 1, "globex"),
    ):
        store.add(k)
    store.set_state("t:acme", 1, KeyState.RETIRED)
    assert store.states([]) == {}
    assert store.states(["t:nobody"]) == {}
    assert store.states(["t:acme", "t:nobody"]) == {
        ("t:acme", 1): KeyState.RETIRED,
        ("t:acme", 2): KeyState.ACTIVE,
    }
    store.destroy("acme", "p1")
    assert store.states({"u:acme:p1", "t:globex"}) == {
        ("u:acme:p1", 1): KeyState.DESTROYED,
        ("t:globex", 1): KeyState.ACTIVE,
    }
    store.destroy("acme", None)
    states = store.states(["t:acme", "u:acme:p1", "t:globex"])
    assert {ident for ident, s in states.items() if s is KeyState.DESTROYED} == {
        ("t:acme", 1),
        ("t:acme", 2),
        ("u:acme:p1", 1),
    }
    assert states[("t:globex", 1)] is KeyState.ACTIVE

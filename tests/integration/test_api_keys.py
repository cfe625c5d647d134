"""``GET /v1/keys`` and ``POST /v1/keys/rotate`` on a real Postgres ledger with the real keyring
(KEK file, SqlKeyStore) and ledger writer: rotation is recorded like ``kvgov keys rotate``,
takes effect at once in the keyring the API was given (the sidecar's), old data still opens,
user ids are pseudonymised, and no key material ever appears in an answer.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from kvgov.db.keystore import SqlKeyStore
from kvgov.db.models import LedgerEvent, table
from kvgov.keys.kek import FileKekProvider
from kvgov.keys.keyring import Keyring
from kvgov.keys.sealed import parse_header
from kvgov.ledger.verify import verify
from kvgov.types import EventKind
from tests.integration.test_api_support import ApiWorld, api_world, bearer

pytestmark = pytest.mark.postgres

CK = b"llama|chunk-7"


@pytest.fixture
def world(pg_url: str, tmp_path: Path) -> Iterator[ApiWorld]:
    with api_world(pg_url, tmp_path) as w:
        yield w


@pytest.fixture
def sidecar_keyring(world: ApiWorld) -> Keyring:
    """The keyring a sidecar seals with, handed to the API as the sidecar does."""
    ring = Keyring(SqlKeyStore(world.engine), FileKekProvider(world.settings.kek_path))
    world.ctx.keyring = ring
    return ring


@pytest.fixture
async def client(world: ApiWorld) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=world.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://kvgov.test") as c:
        yield c


def key_events(world: ApiWorld) -> list[dict[str, object]]:
    t = table(LedgerEvent)
    kinds = [str(EventKind.KEY_CREATED), str(EventKind.KEY_ROTATED)]
    with world.engine.connect() as conn:
        rows = conn.execute(select(t).where(t.c.kind.in_(kinds)).order_by(t.c.seq)).all()
    return [dict(r._mapping) for r in rows]


async def test_rotation_takes_effect_at_once_and_is_recorded(
    world: ApiWorld, client: httpx.AsyncClient, sidecar_keyring: Keyring
) -> None:
    admin = bearer(world.tokens.admin)
    old = sidecar_keyring.seal("globex", CK, b"v1 data" * 100)
    assert parse_header(old).key_version == 1

    r = await client.post("/v1/keys/rotate", json={"tenant": "globex"}, headers=admin)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["rotated"]["key_id"] == "t:globex"
    assert body["rotated"]["version"] == 2 and body["rotated"]["state"] == "active"
    # the sidecar's keyring seals new data under v2 at once, and v1 data still opens
    new = sidecar_keyring.seal("globex", CK, b"v2 data")
    assert parse_header(new).key_version == 2
    assert sidecar_keyring.open(old, tenant="globex", cache_key=CK) == b"v1 data" * 100

    events = key_events(world)
    assert [(e["kind"], e["attrs"]) for e in events][-1] == (
        "key:rotated",
        {"key_id": "t:globex", "version": 2},
    )
    last = events[-1]
    assert last["principal"] == f"token:{world.tokens.admin_id}"
    assert last["reason"] == "api rotate"
    assert [body["ledger"][0]["chain_id"], body["ledger"][0]["seq"]] == [
        last["chain_id"],
        last["seq"],
    ]

    r = await client.get("/v1/keys?tenant=globex", headers=bearer(world.tokens.auditor))
    assert r.status_code == 200, r.text
    listed = [(k["version"], k["state"], k["usage_count"]) for k in r.json()["items"]]
    # usage the keyring counted in memory is flushed before listing
    assert listed == [(1, "retired", 1), (2, "active", 1)]
    assert verify(world.engine).ok


async def test_user_keys_are_named_by_pseudonym_and_never_show_material(
    world: ApiWorld, client: httpx.AsyncClient
) -> None:
    admin = bearer(world.tokens.admin)
    raw = "alice@acme.example"
    alice = world.seeded.users[raw]
    first = await client.post(
        "/v1/keys/rotate", json={"tenant": "acme", "user": raw}, headers=admin
    )
    assert first.status_code == 200, first.text
    assert first.json()["rotated"] == {
        **first.json()["rotated"],
        "key_id": f"u:acme:{alice}",
        "version": 1,
        "user": alice,
    }
    assert [e["kind"] for e in key_events(world)] == ["key:created"]
    await client.post("/v1/keys/rotate", json={"tenant": "acme"}, headers=admin)

    r = await client.get(
        "/v1/keys", params={"tenant": "acme", "user": raw}, headers=bearer(world.tokens.auditor)
    )
    assert [k["key_id"] for k in r.json()["items"]] == [f"u:acme:{alice}"]
    everything = await client.get("/v1/keys", headers=bearer(world.tokens.auditor))
    assert {k["key_id"] for k in everything.json()["items"]} == {"t:acme", f"u:acme:{alice}"}
    for resp in (first, r, everything):
        assert raw not in resp.text
        assert "wrapped" not in resp.text
    for row in SqlKeyStore(world.engine).versions():
        assert row.wrapped is not None
        assert base64.b64encode(row.wrapped).decode() not in everything.text
        assert row.wrapped.hex() not in everything.text
    for event in key_events(world):
        assert raw not in str(event)


async def test_list_filters_pages_and_tenant_scope(
    world: ApiWorld, client: httpx.AsyncClient
) -> None:
    admin = bearer(world.tokens.admin)
    for tenant in ("acme", "acme", "globex", "initech"):
        r = await client.post("/v1/keys/rotate", json={"tenant": tenant}, headers=admin)
        assert r.status_code == 200, r.text
    auditor = bearer(world.tokens.auditor)
    seen: list[tuple[str, int]] = []
    url: str | None = "/v1/keys?limit=2"
    while url is not None:
        page = (await client.get(url, headers=auditor)).json()
        seen += [(k["key_id"], k["version"]) for k in page["items"]]
        url = page["next"]
    assert seen == [("t:acme", 1), ("t:acme", 2), ("t:globex", 1), ("t:initech", 1)]
    active = (await client.get("/v1/keys?state=active", headers=auditor)).json()["items"]
    assert [(k["key_id"], k["version"]) for k in active] == [
        ("t:acme", 2),
        ("t:globex", 1),
        ("t:initech", 1),
    ]
    scoped = (await client.get("/v1/keys", headers=bearer(world.tokens.auditor_acme))).json()
    assert {k["tenant"] for k in scoped["items"]} == {"acme"}
    r = await client.get("/v1/keys?user=bob", headers=auditor)
    assert r.status_code == 422 and r.json()["code"] == "invalid_input"


@pytest.mark.parametrize(
    "body",
    [
        {"tenant": "a:b"},
        {"tenant": "has space"},
        {"tenant": ""},
        {"tenant": "x" * 65},
        {"tenant": "acme", "user": ""},
        {"tenant": "acme", "shred": True},
    ],
)
async def test_bad_rotation_requests_are_422(
    world: ApiWorld, client: httpx.AsyncClient, body: dict[str, object]
) -> None:
    r = await client.post("/v1/keys/rotate", json=body, headers=bearer(world.tokens.admin))
    assert r.status_code == 422, r.text
    assert r.headers["content-type"] == "application/problem+json"
    assert key_events(world) == []


async def test_there_is_no_rest_shred(world: ApiWorld, client: httpx.AsyncClient) -> None:
    admin = bearer(world.tokens.admin)
    for path in ("/v1/keys/shred", "/v1/keys/t:acme"):
        r = await client.post(path, json={"tenant": "acme"}, headers=admin)
        assert r.status_code in (404, 405)
    r = await client.delete("/v1/keys/t:acme", headers=admin)
    assert r.status_code in (404, 405)


async def test_without_a_kek_rotation_is_503_and_changes_nothing(
    world: ApiWorld, client: httpx.AsyncClient
) -> None:
    world.settings.kek_path.unlink()
    r = await client.post(
        "/v1/keys/rotate", json={"tenant": "acme"}, headers=bearer(world.tokens.admin)
    )
    assert r.status_code == 503, r.text
    assert r.json()["code"] == "unavailable"
    assert SqlKeyStore(world.engine).versions() == []


async def test_a_rotation_the_ledger_cannot_record_changes_nothing(
    world: ApiWorld, client: httpx.AsyncClient, sidecar_keyring: Keyring
) -> None:
    """r15 F6 (API side): the key event is appended before the keyring rotates, so a ledger
    that refuses it (backpressure, database down) leaves the key as it was."""
    import asyncio

    from kvgov.errors import LedgerBackpressureError
    from kvgov.ledger.events import Appended, Event

    sidecar_keyring.seal("globex", CK, b"v1 data")
    real = world.ctx.sink

    class FullForKeys:
        """The sidecar's sink with no room for key events (api:access still lands)."""

        def submit(self, event: Event) -> asyncio.Future[Appended]:
            if event.kind in (EventKind.KEY_ROTATED, EventKind.KEY_CREATED):
                raise LedgerBackpressureError("ledger queue full")
            return real.submit(event)

        async def append(self, event: Event) -> Appended:
            if event.kind in (EventKind.KEY_ROTATED, EventKind.KEY_CREATED):
                raise LedgerBackpressureError("ledger queue full")
            return await real.append(event)

    world.ctx.sink = FullForKeys()
    try:
        r = await client.post(
            "/v1/keys/rotate", json={"tenant": "globex"}, headers=bearer(world.tokens.admin)
        )
    finally:
        world.ctx.sink = real
    versions = [(k.version, k.state) for k in SqlKeyStore(world.engine).versions("globex")]
    assert versions == [(1, "active")], (
        f"POST /v1/keys/rotate rotated globex's key although the ledger refused the event"
        f" ({r.status_code}): {versions}"
    )
    assert r.status_code == 503, r.text
    assert parse_header(sidecar_keyring.seal("globex", CK, b"more")).key_version == 1
    assert key_events(world) == []

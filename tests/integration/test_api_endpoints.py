"""Every /v1 endpoint against a real Postgres ledger seeded through the real LedgerWriter."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select, text
from sqlalchemy.orm import Session

from kvgov.db.engine import make_engine
from kvgov.db.models import LedgerEvent
from kvgov.ledger.events import Event
from kvgov.types import EventKind
from tests.integration.test_api_support import (
    EXPECTED_STATS,
    POLICY_REV,
    T0,
    ApiWorld,
    api_world,
    bearer,
)

pytestmark = pytest.mark.postgres


@pytest.fixture
def world(pg_url: str, tmp_path: Path) -> Iterator[ApiWorld]:
    with api_world(pg_url, tmp_path) as w:
        yield w


@pytest.fixture
async def client(world: ApiWorld) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=world.app)
    async with httpx.AsyncClient(
        transport=transport,
        base_url="http://kvgov.test",
        headers=bearer(world.tokens.auditor),
    ) as c:
        yield c


def _assert_no_raw_ids(world: ApiWorld, body: str) -> None:
    for raw in world.seeded.users:
        assert raw not in body
        assert raw.split("@")[0] not in body


# -- entries -----------------------------------------------------------------------------------


async def test_entries_lists_everything_newest_first(world: ApiWorld, client: httpx.AsyncClient):
    r = await client.get("/v1/entries")
    assert r.status_code == 200
    items = r.json()["items"]
    d = world.seeded.digests
    assert [i["key_digest"] for i in items] == [d[n] for n in ("g2", "g1", "b1", "a3", "a2", "a1")]
    a1 = items[-1]
    assert a1["tenant"] == "acme"
    assert a1["owner"] == world.seeded.users["alice@acme.example"]
    assert a1["tiers"] == ["memory", "filesystem"]
    assert a1["size"] == 1000
    assert a1["state"] == "live"
    assert a1["created_request_id"] == "req-a1"
    assert a1["policy_revision"] == POLICY_REV
    assert r.json()["next"] is None
    _assert_no_raw_ids(world, r.text)


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ({"tenant": "acme"}, ["b1", "a3", "a2", "a1"]),
        ({"tenant": "acme", "user": "alice@acme.example"}, ["a3", "a2", "a1"]),
        ({"tenant": "acme", "user": "bob@acme.example"}, ["b1"]),
        ({"sensitivity": "phi"}, ["b1"]),
        ({"tier": "memory"}, ["b1", "a2", "a1"]),  # g2 was evicted: its tiers are empty
        ({"tier": "redis"}, ["g1"]),
        ({"state": "deleted"}, ["g2"]),
        ({"state": "live", "tenant": "globex"}, ["g1"]),
        ({"since": (T0.replace(minute=3)).isoformat()}, ["g2", "g1", "b1", "a3"]),
        ({"until": (T0.replace(minute=3)).isoformat()}, ["a2", "a1"]),
        ({"since": "2026-11-20T09:02:00", "until": "2026-11-20T09:05:00Z"}, ["b1", "a3", "a2"]),
    ],
)
async def test_entry_filters(world: ApiWorld, client: httpx.AsyncClient, query, expected):
    r = await client.get("/v1/entries", params=query)
    assert r.status_code == 200, r.text
    d = world.seeded.digests
    assert [i["key_digest"] for i in r.json()["items"]] == [d[n] for n in expected]


async def test_entry_pages_follow_next_until_null(world: ApiWorld, client: httpx.AsyncClient):
    seen: list[str] = []
    url: str | None = "/v1/entries?limit=2"
    pages = 0
    while url:
        r = await client.get(url)
        assert r.status_code == 200
        body = r.json()
        assert len(body["items"]) <= 2
        seen += [i["key_digest"] for i in body["items"]]
        url = body["next"]
        pages += 1
    assert pages == 3
    everything = (await client.get("/v1/entries")).json()["items"]
    assert seen == [i["key_digest"] for i in everything]
    assert len(set(seen)) == 6


async def test_user_filter_needs_a_tenant(client: httpx.AsyncClient):
    r = await client.get("/v1/entries", params={"user": "alice@acme.example"})
    assert r.status_code == 422
    assert r.headers["content-type"] == "application/problem+json"
    assert r.json()["code"] == "invalid_input"


@pytest.mark.parametrize(
    "params",
    [
        {"cursor": "not-a-cursor!!"},
        {"cursor": "WzEsMiwzXQ"},  # base64 of [1,2,3]: not our shape
        # deeply nested (the longest a cursor may be): a bad cursor, not a server error
        {"cursor": base64.urlsafe_b64encode(b"[" * 760).decode().rstrip("=")},
        {"limit": 0},
        {"limit": 100000},
        {"state": "sideways"},
        {"sensitivity": "secret-ish"},
        {"since": "yesterday"},
        {"tenant": "bad\x00tenant"},
    ],
)
async def test_invalid_parameters_are_422_problems(client: httpx.AsyncClient, params):
    r = await client.get("/v1/entries", params=params)
    assert r.status_code == 422, r.text
    assert r.headers["content-type"] == "application/problem+json"
    body = r.json()
    assert body["status"] == 422
    assert body["type"].startswith("https://kvgov.dev/problems/")
    assert body["instance"] == "/v1/entries"  # the route's template (it has no parameter)


async def test_unknown_route_is_a_404_problem(client: httpx.AsyncClient):
    r = await client.get("/v1/nothing-here")
    assert r.status_code == 404
    assert r.headers["content-type"] == "application/problem+json"
    assert r.json()["code"] == "not_found"
    assert "instance" not in r.json()  # no route: nothing to name but the path itself


# -- provenance --------------------------------------------------------------------------------


async def test_provenance_lists_chunks_in_served_order_with_their_creators(
    world: ApiWorld, client: httpx.AsyncClient
):
    r = await client.get("/v1/requests/req-a2/provenance")
    assert r.status_code == 200, r.text
    body = r.json()
    d, users = world.seeded.digests, world.seeded.users
    assert body["request_id"] == "req-a2"
    assert body["tenant"] == "acme"
    assert body["user"] == users["bob@acme.example"]
    chunks = body["chunks"]
    assert [c["key_digest"] for c in chunks] == [d["a2"], d["a1"]]
    assert [c["position"] for c in chunks] == [0, 1]
    assert [c["tier"] for c in chunks] == ["memory", "filesystem"]
    for c in chunks:
        assert c["created"]["request_id"] == "req-a1"
        assert c["created"]["user"] == users["alice@acme.example"]
        assert c["created"]["policy_revision"] == POLICY_REV
        assert c["created"]["decision_id"] == "d-put-acme"
    assert chunks[0]["created"]["created_at"].startswith("2026-11-20T09:02:00")
    assert chunks[1]["created"]["created_at"].startswith("2026-11-20T09:01:00")
    _assert_no_raw_ids(world, r.text)
    # one answer, one shape: the CLI prints the very document the API returns
    cli = await world.cli("provenance", "req-a2", "--json")
    assert cli.exit_code == 0, cli.output
    assert json.loads(cli.stdout) == body
    scoped = await client.get("/v1/requests/req-a2/provenance", params={"tenant": "acme"})
    cli = await world.cli("provenance", "req-a2", "--tenant", "acme", "--json")
    assert json.loads(cli.stdout) == scoped.json() == body


async def test_provenance_of_a_request_that_reused_nothing_is_empty(
    world: ApiWorld, client: httpx.AsyncClient
):
    r = await client.get("/v1/requests/req-g3/provenance")
    assert r.status_code == 200
    assert r.json()["chunks"] == []
    cli = await world.cli("provenance", "req-g3", "--json")
    assert cli.exit_code == 1  # the CLI says "nothing loaded" by its exit code, same document
    assert json.loads(cli.stdout) == r.json()


async def test_provenance_of_an_unknown_request_is_404(world: ApiWorld, client: httpx.AsyncClient):
    r = await client.get("/v1/requests/req-nope/provenance")
    assert r.status_code == 404
    assert r.headers["content-type"] == "application/problem+json"
    assert r.json()["code"] == "not_found"
    cli = await world.cli("provenance", "req-nope", "--json")
    assert cli.exit_code == 1
    assert cli.stdout == ""
    assert "no request 'req-nope'" in cli.stderr


# -- footprint ---------------------------------------------------------------------------------


async def test_footprint_shows_what_is_cached_where_until_when_and_reuse(
    world: ApiWorld, client: httpx.AsyncClient
):
    r = await client.get("/v1/users/alice@acme.example/footprint", params={"tenant": "acme"})
    assert r.status_code == 200, r.text
    body = r.json()
    d = world.seeded.digests
    assert body["user"] == world.pseudo.user("acme", "alice@acme.example")
    assert body["entries_by_state"] == {"live": 3}
    assert body["live_bytes_by_tier"] == {"memory": 3000, "filesystem": 5000}
    assert body["live_until"].startswith("2026-11-21T09:03:00")
    assert body["requests_served"] == 2  # req-a2 (bob) and req-a3 (alice)
    by_digest = {i["key_digest"]: i for i in body["items"]}
    assert set(by_digest) == {d["a1"], d["a2"], d["a3"]}
    assert by_digest[d["a1"]]["reused_by"] == ["req-a2", "req-a3"]
    assert by_digest[d["a2"]]["reused_by"] == ["req-a2"]
    assert by_digest[d["a3"]]["reused_by"] == []
    assert by_digest[d["a1"]]["expires_at"].startswith("2026-11-21T09:01:00")
    _assert_no_raw_ids(world, r.text)
    # `kvgov provenance --user` answers from the same query: the same pseudonym and, for each
    # chunk the user created, the same reused_by (the footprint also lists chunks scoped to or
    # put by the user, and pages; the CLI adds per-request counts: docs/api.md)
    cli = await world.cli(
        "provenance", "--user", "alice@acme.example", "--tenant", "acme", "--json"
    )
    assert cli.exit_code == 0, cli.output
    reuse = json.loads(cli.stdout)
    assert (reuse["tenant"], reuse["user"]) == ("acme", body["user"])
    assert {e["key_digest"]: e["reused_by"] for e in reuse["entries"]} == {
        k: i["reused_by"] for k, i in by_digest.items()
    }
    assert reuse["requests"] == [
        {"request_id": "req-a2", "chunks": 2},
        {"request_id": "req-a3", "chunks": 1},
    ]


async def test_footprint_pages(world: ApiWorld, client: httpx.AsyncClient):
    r = await client.get(
        "/v1/users/alice@acme.example/footprint", params={"tenant": "acme", "limit": 2}
    )
    first = r.json()
    assert len(first["items"]) == 2 and first["next"]
    second = (await client.get(first["next"])).json()
    assert len(second["items"]) == 1 and second["next"] is None


async def test_footprint_of_an_unknown_user_is_empty_and_needs_a_tenant(
    client: httpx.AsyncClient,
):
    r = await client.get("/v1/users/nobody/footprint", params={"tenant": "acme"})
    assert r.status_code == 200
    assert r.json()["items"] == [] and r.json()["entries_by_state"] == {}
    r = await client.get("/v1/users/nobody/footprint")
    assert r.status_code == 422
    assert r.headers["content-type"] == "application/problem+json"


# -- decisions ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ({}, ["d-deny-globex", "d-deny-acme", "d-put-globex", "d-put-acme"]),
        ({"outcome": "deny"}, ["d-deny-globex", "d-deny-acme"]),
        ({"outcome": "allow", "tenant": "acme"}, ["d-put-acme"]),
        ({"reason": "cross_user_scope"}, ["d-deny-acme"]),
        ({"reason": "cross_user"}, []),  # a whole reason code, not a substring
        ({"tenant": "globex"}, ["d-deny-globex", "d-put-globex"]),
        ({"operation": "get"}, ["d-deny-acme"]),
    ],
)
async def test_decision_filters(client: httpx.AsyncClient, query, expected):
    r = await client.get("/v1/decisions", params=query)
    assert r.status_code == 200, r.text
    assert [i["decision_id"] for i in r.json()["items"]] == expected


async def test_decision_details_and_pages(client: httpx.AsyncClient):
    r = await client.get("/v1/decisions", params={"limit": 1, "outcome": "deny"})
    first = r.json()
    item = first["items"][0]
    assert item["outcome"] == "deny"
    assert item["reasons"] == ["sensitivity_not_cacheable"]
    assert item["policy_revision"] == POLICY_REV
    assert item["chain_id"] == "seed-node" and item["seq"] > 0
    second = (await client.get(first["next"])).json()
    assert [i["decision_id"] for i in second["items"]] == ["d-deny-acme"]
    assert second["next"] is None


# -- audit -------------------------------------------------------------------------------------


async def test_verify_reports_an_intact_ledger(client: httpx.AsyncClient):
    r = await client.get("/v1/audit/verify")
    assert r.status_code == 200
    body = r.json()
    assert body["ok"] is True
    seed = next(c for c in body["chains"] if c["chain_id"] == "seed-node")
    assert seed["ok"] and seed["events"] == 19 and seed["checkpoints"] == 1
    assert seed["problem"] is None and seed["position"] is None


async def test_verify_finds_a_modified_event(world: ApiWorld, client: httpx.AsyncClient, pg_url):
    # tamper as the database superuser with the append-only guard switched off
    admin = make_engine(pg_url)
    try:
        with admin.begin() as conn:
            conn.execute(text("ALTER TABLE ledger_events DISABLE TRIGGER ALL"))
            conn.execute(
                text(
                    "UPDATE ledger_events SET nbytes = 999999 "
                    "WHERE chain_id = 'seed-node' AND seq = 5"
                )
            )
            conn.execute(text("ALTER TABLE ledger_events ENABLE TRIGGER ALL"))
    finally:
        admin.dispose()
    body = (await client.get("/v1/audit/verify")).json()
    assert body["ok"] is False
    seed = next(c for c in body["chains"] if c["chain_id"] == "seed-node")
    assert seed["ok"] is False
    assert seed["position"] == 5
    assert seed["problem"] == "modified"


async def test_checkpoints_are_listed_with_signatures(world: ApiWorld, client: httpx.AsyncClient):
    await world.ctx.sink.append(Event(kind=EventKind.SIDECAR_STARTED))
    world.writer.run(world.writer.writer.write_checkpoint())
    r = await client.get("/v1/audit/checkpoints")
    assert r.status_code == 200
    items = r.json()["items"]
    assert {i["chain_id"] for i in items} == {"seed-node", "api-node"}
    seed = next(i for i in items if i["chain_id"] == "seed-node")
    assert seed["seq"] == 19 and len(seed["head_hash"]) == 64
    assert len(base64.b64decode(seed["signature"])) == 64
    assert len(base64.b64decode(seed["public_key"])) == 32
    page = (await client.get("/v1/audit/checkpoints", params={"limit": 1})).json()
    assert len(page["items"]) == 1 and page["next"]
    rest = (await client.get(page["next"])).json()
    assert len(rest["items"]) == 1 and rest["next"] is None
    only = (await client.get("/v1/audit/checkpoints", params={"chain_id": "api-node"})).json()
    assert [i["chain_id"] for i in only["items"]] == ["api-node"]


# -- stats -------------------------------------------------------------------------------------


async def test_stats_per_tenant(client: httpx.AsyncClient):
    r = await client.get("/v1/stats")
    assert r.status_code == 200
    tenants = {t["tenant"]: t for t in r.json()["tenants"]}
    assert set(tenants) == set(EXPECTED_STATS)
    for name, expected in EXPECTED_STATS.items():
        got = tenants[name]
        for key, value in expected.items():
            assert got[key] == pytest.approx(value), (name, key)
    assert tenants["globex"]["entries_by_state"] == {"live": 1, "deleted": 1}


async def test_one_tenant_stats_and_time_window(client: httpx.AsyncClient):
    r = await client.get("/v1/tenants/acme/stats")
    assert r.status_code == 200
    assert r.json()["hits"] == 3 and r.json()["denials"] == 1
    later = await client.get("/v1/tenants/acme/stats", params={"since": "2026-11-20T09:12:00Z"})
    assert later.json()["hits"] == 1 and later.json()["puts"] == 0
    unknown = (await client.get("/v1/tenants/initech/stats")).json()
    assert unknown["entries"] == 0 and unknown["hit_rate"] is None


# -- tokens and admin audit trail --------------------------------------------------------------


async def test_admin_manages_tokens_and_each_admin_request_is_a_ledger_event(
    world: ApiWorld, client: httpx.AsyncClient
):
    admin = bearer(world.tokens.admin)
    r = await client.post(
        "/v1/tokens", json={"role": "auditor", "tenant": "acme", "name": "dash"}, headers=admin
    )
    assert r.status_code == 201, r.text
    created = r.json()
    assert created["token"].startswith("kvgov_") and created["tenant"] == "acme"
    new = bearer(created["token"])
    assert (await client.get("/v1/stats", headers=new)).json()["tenants"][0]["tenant"] == "acme"

    listed = (await client.get("/v1/tokens", headers=admin)).json()
    assert created["id"] in {t["id"] for t in listed}
    assert "token" not in json.dumps(listed).replace('"token:', "")  # never the secret
    assert created["token"] not in json.dumps(listed)

    assert (await client.delete(f"/v1/tokens/{created['id']}", headers=admin)).status_code == 204
    assert (await client.get("/v1/stats", headers=new)).status_code == 401
    missing = await client.delete("/v1/tokens/00000000-0000-0000-0000-000000000000", headers=admin)
    assert missing.status_code == 404

    with world.engine.connect() as conn:
        rows = conn.execute(
            select(LedgerEvent.kind, LedgerEvent.principal, LedgerEvent.attrs)
            .where(LedgerEvent.chain_id == "api-node")
            .order_by(LedgerEvent.seq)
        ).all()
    admin_principal = f"token:{world.tokens.admin_id}"
    kinds = [k for k, p, _ in rows if p == admin_principal]
    assert kinds.count("api:access") == 4  # create, list, revoke, revoke of a missing one
    assert "token:created" in kinds and "token:revoked" in kinds
    access = [a for k, p, a in rows if k == "api:access"]
    assert {a["route"] for a in access} == {"/v1/tokens", "/v1/tokens/{token_id}"}
    # the auditor's and the new token's reads were not recorded as admin accesses
    assert all(p == admin_principal for k, p, _ in rows if k == "api:access")


async def test_admin_reads_are_recorded_without_query_values(
    world: ApiWorld, client: httpx.AsyncClient
):
    r = await client.get(
        "/v1/users/alice@acme.example/footprint",
        params={"tenant": "acme"},
        headers=bearer(world.tokens.admin),
    )
    assert r.status_code == 200
    with Session(world.engine) as session:
        row = session.execute(
            select(LedgerEvent).where(LedgerEvent.kind == "api:access")
        ).scalar_one()
    assert row.principal == f"token:{world.tokens.admin_id}"
    assert row.tenant == "acme"
    assert row.attrs == {
        "method": "GET",
        "route": "/v1/users/{user}/footprint",
        "query": ["tenant"],
    }
    assert "alice" not in json.dumps(row.attrs)


@pytest.mark.parametrize("user", ["alice%40acme.example", "jo%41n", "alice%2Facme"])
async def test_an_admin_read_never_records_a_user_id_holding_percent_escapes(
    world: ApiWorld, client: httpx.AsyncClient, user: str
):
    """Attack (privacy): a user id holding ``%XX`` sent percent-encoded. The route template was
    rebuilt from the path by matching path parameter values after decoding the path a second
    time, so such an id no longer matched its parameter and went, decoded, into the chain
    (``/v1/users/alice@acme.example/footprint``), where no purge can erase it."""
    from urllib.parse import quote

    r = await client.get(
        f"/v1/users/{quote(user, safe='')}/footprint",
        params={"tenant": "acme"},
        headers=bearer(world.tokens.admin),
    )
    assert r.status_code == 200
    with Session(world.engine) as session:
        row = session.execute(
            select(LedgerEvent).where(LedgerEvent.kind == "api:access")
        ).scalar_one()
    assert row.attrs["route"] == "/v1/users/{user}/footprint"

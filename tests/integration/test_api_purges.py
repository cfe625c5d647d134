"""``GET /v1/purges``, ``/v1/purges/{id}`` and ``/v1/purges/{id}/receipt`` on a real Postgres
ledger with purges run by the real purge service (receipts signed with the ledger's key file).

The receipt downloaded from the API is checked by the real ``kvgov purge verify-receipt``;
a receipt altered in the database shows as not verified and the CLI refuses it. A job, its steps
and their details are one document: ``kvgov purge status ID --json`` prints what the API returns.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import update
from sqlalchemy.orm import Session
from typer.testing import CliRunner

from kvgov.cli.main import build_app
from kvgov.db import purge_jobs as jobs
from kvgov.db.engine import utcnow
from kvgov.db.models import PurgeReceipt, table
from kvgov.db.purge_views import PurgeRequest
from kvgov.ledger.verify import verify
from tests.integration.test_api_support import ApiWorld, api_world, bearer

pytestmark = pytest.mark.postgres


@pytest.fixture
def world(pg_url: str, tmp_path: Path) -> Iterator[ApiWorld]:
    with api_world(pg_url, tmp_path) as w:
        yield w


@pytest.fixture
async def client(world: ApiWorld) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=world.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://kvgov.test") as c:
        yield c


def verify_cli(world: ApiWorld, receipt_file: Path, monkeypatch: pytest.MonkeyPatch):
    """``kvgov purge verify-receipt FILE`` with this node's configuration (its ledger key)."""
    monkeypatch.setenv("KVGOV_DATA_DIR", str(world.settings.data_dir))
    return CliRunner().invoke(build_app(), ["purge", "verify-receipt", str(receipt_file), "--json"])


async def test_list_shows_state_counts_and_verified_receipts(
    world: ApiWorld, client: httpx.AsyncClient
) -> None:
    admin = bearer(world.tokens.admin)
    # alice has a user key to shred: rotate it into existence through the API
    r = await client.post(
        "/v1/keys/rotate", json={"tenant": "acme", "user": "alice@acme.example"}, headers=admin
    )
    assert r.status_code == 200, r.text
    done = await world.purge("acme", "alice@acme.example")
    pending = await world.purges.create(PurgeRequest(tenant="globex", requested_by="test"))

    r = await client.get("/v1/purges", headers=bearer(world.tokens.auditor))
    assert r.status_code == 200, r.text
    page = r.json()
    assert [p["id"] for p in page["items"]] == [pending.id, done.id]  # newest first
    assert page["next"] is None
    first, second = page["items"]
    assert first["state"] == "pending" and first["kind"] == "tenant"
    assert first["receipt"] == {
        "present": False,
        "signature_valid": None,
        "key_id": None,
        "reason": None,
        "url": None,
    }
    assert first["counts"]["entries_in_scope"] is None

    assert second["state"] == "completed" and second["kind"] == "user"
    assert second["subject"] == world.seeded.users["alice@acme.example"]
    # alice's a1, a2 (hers) and a3 (scoped to her)
    assert second["counts"]["entries_in_scope"] == 3
    assert second["counts"]["entries_purged"] == 3
    assert second["counts"]["keys_destroyed"] == 1
    assert second["receipt"]["present"] is True
    assert second["receipt"]["signature_valid"] is True
    assert second["receipt"]["url"] == f"/v1/purges/{done.id}/receipt"
    assert sum(second["steps_by_state"].values()) == len(done.steps)
    assert set(second["steps_by_state"]) == {"completed"}
    assert "alice" not in r.text  # only pseudonyms leave the server

    # the job view, readable by auditors, agrees
    job = (await client.get(f"/v1/purges/{done.id}", headers=bearer(world.tokens.auditor))).json()
    assert job["state"] == "completed"
    assert job["receipt"]["receipt"]["entries_purged"] == 3
    assert verify(world.engine).ok


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("state=completed", ["acme-alice"]),
        ("state=pending", ["globex"]),
        ("kind=tenant", ["globex"]),
        ("kind=user", ["acme-alice"]),
        ("tenant=acme", ["acme-alice"]),
        ("tenant=initech", []),
        ("since=2000-01-01T00:00:00Z", ["globex", "acme-alice"]),
        ("until=2000-01-01T00:00:00", []),
    ],
)
async def test_list_filters(
    world: ApiWorld, client: httpx.AsyncClient, query: str, expected: list[str]
) -> None:
    ids = {"acme-alice": (await world.purge("acme", "alice@acme.example")).id}
    ids["globex"] = (await world.purges.create(PurgeRequest(tenant="globex"))).id
    r = await client.get(f"/v1/purges?{query}", headers=bearer(world.tokens.auditor))
    assert r.status_code == 200, r.text
    assert [p["id"] for p in r.json()["items"]] == [ids[name] for name in expected]


async def test_list_pages_follow_next_until_null(
    world: ApiWorld, client: httpx.AsyncClient
) -> None:
    made = [(await world.purges.create(PurgeRequest(tenant=f"t{i}"))).id for i in range(5)]
    seen: list[str] = []
    url: str | None = "/v1/purges?limit=2"
    while url is not None:
        r = await client.get(url, headers=bearer(world.tokens.auditor))
        assert r.status_code == 200, r.text
        assert len(r.json()["items"]) <= 2
        seen += [p["id"] for p in r.json()["items"]]
        url = r.json()["next"]
    assert seen == made[::-1]
    bad = await client.get("/v1/purges?cursor=bm90LWEtY3Vyc29y", headers=bearer(world.tokens.admin))
    assert bad.status_code == 422


async def test_a_receipt_downloaded_from_the_api_verifies_with_the_cli(
    world: ApiWorld, client: httpx.AsyncClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    done = await world.purge("acme", "alice@acme.example")
    r = await client.get(f"/v1/purges/{done.id}/receipt", headers=bearer(world.tokens.auditor))
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/json"
    assert "attachment" in r.headers["content-disposition"]
    assert r.json() == done.receipt  # exactly the stored signed document
    saved = tmp_path / "receipt.json"
    saved.write_bytes(r.content)  # the body as downloaded, byte for byte

    result = verify_cli(world, saved, monkeypatch)
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["ok"] is True and out["purge_id"] == done.id and out["state"] == "completed"

    # one changed count and the signature no longer matches: the CLI refuses the file
    doc = r.json()
    doc["receipt"]["entries_purged"] = 0
    forged = tmp_path / "forged.json"
    forged.write_text(json.dumps(doc))
    assert verify_cli(world, forged, monkeypatch).exit_code == 1


async def test_a_receipt_altered_in_the_database_shows_as_not_verified(
    world: ApiWorld, client: httpx.AsyncClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    done = await world.purge("acme", "alice@acme.example")
    assert done.receipt is not None
    altered = json.loads(json.dumps(done.receipt))
    altered["receipt"]["state"] = "completed"
    altered["receipt"]["incomplete"] = ["nothing to see here"]
    t = table(PurgeReceipt)
    with world.engine.begin() as conn:
        conn.execute(update(t).where(t.c.job_id == done.id).values(receipt=altered))

    r = await client.get("/v1/purges", headers=bearer(world.tokens.auditor))
    status = r.json()["items"][0]["receipt"]
    assert status["present"] is True and status["signature_valid"] is False
    assert status["reason"] == "signature does not match the receipt"

    r = await client.get(f"/v1/purges/{done.id}/receipt", headers=bearer(world.tokens.auditor))
    saved = tmp_path / "altered.json"
    saved.write_bytes(r.content)
    assert verify_cli(world, saved, monkeypatch).exit_code == 1


async def test_missing_jobs_and_receipts_are_404_and_other_tenants_403(
    world: ApiWorld, client: httpx.AsyncClient
) -> None:
    pending = await world.purges.create(PurgeRequest(tenant="acme", user="bob@acme.example"))
    done = await world.purge("globex", "carol@globex.example")
    auditor = bearer(world.tokens.auditor)
    for path in (
        "/v1/purges/00000000-0000-0000-0000-000000000000",
        f"/v1/purges/{pending.id}/receipt",
    ):
        r = await client.get(path, headers=auditor)
        assert r.status_code == 404, r.text
        assert r.headers["content-type"] == "application/problem+json"
        assert r.json()["code"] == "not_found"
    scoped = bearer(world.tokens.auditor_acme)
    assert (await client.get(f"/v1/purges/{pending.id}", headers=scoped)).status_code == 200
    for path in (f"/v1/purges/{done.id}", f"/v1/purges/{done.id}/receipt"):
        assert (await client.get(path, headers=scoped)).status_code == 403
    listed = (await client.get("/v1/purges", headers=scoped)).json()["items"]
    assert [p["id"] for p in listed] == [pending.id]


async def test_a_job_and_its_step_details_are_one_document_in_the_api_and_the_cli(
    world: ApiWorld, client: httpx.AsyncClient
) -> None:
    auditor = bearer(world.tokens.auditor)
    r = await client.post(
        "/v1/keys/rotate",
        json={"tenant": "acme", "user": "alice@acme.example"},
        headers=bearer(world.tokens.admin),
    )
    assert r.status_code == 200, r.text
    done = await world.purge("acme", "alice@acme.example")
    pending = await world.purges.create(PurgeRequest(tenant="globex", requested_by="test"))
    # an attempt of one of its steps raised: the step is back to pending with the error
    step = pending.steps[0]
    with Session(world.engine) as s, s.begin():
        jobs.fail_step(s, step.id, "TierError: redis down", now=utcnow(), attempt=step.attempts)

    body = (await client.get(f"/v1/purges/{done.id}", headers=auditor)).json()
    details = {d["name"]: d["detail"] for d in body["steps"]}
    assert set(details) == {"keys", "tiers", "gpu", "ledger"}
    assert all(d["executed_by"] for d in details.values())
    assert [k["version"] for k in details["keys"]["destroyed"]] == [1]
    assert details["tiers"]["verified"] is True and "still_present" not in details["tiers"]
    assert details["ledger"]["erasure_event"]["seq"] > 0
    cli = await world.cli("purge", "status", done.id, "--json")
    assert cli.exit_code == 0, cli.output
    assert json.loads(cli.stdout) == body

    body = (await client.get(f"/v1/purges/{pending.id}", headers=auditor)).json()
    assert {s["name"]: s["detail"] for s in body["steps"]}[str(step.name)] == {
        "error": "TierError: redis down"
    }
    assert all(s["detail"] == {} for s in body["steps"] if s["name"] != str(step.name))
    cli = await world.cli("purge", "status", pending.id, "--json")
    assert cli.exit_code == 0, cli.output
    assert json.loads(cli.stdout) == body

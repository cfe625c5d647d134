"""Attack: a validly signed receipt shown for a purge it is not about.

Someone with the runtime role's database rights (the threat model lets it INSERT into
``purge_receipts`` and UPDATE ``purge_jobs``) copies the receipt of an earlier, finished purge
(bob's) onto a purge of alice that never ran and marks that job completed. The signature is
genuine, so a check of the signature alone showed alice's erasure as verified, with bob's
counts. A receipt verifies for a job only when it names that job: purge id, kind, tenant and
subject (``verify_receipt(..., job=ReceiptFor.of(job))``).
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from sqlalchemy import text

from kvgov.db.purge_views import PurgeRequest
from tests.integration.test_api_support import api_world, bearer

pytestmark = pytest.mark.postgres


async def test_a_receipt_of_another_purge_does_not_verify_for_this_one(
    pg_url: str, tmp_path: Path
) -> None:
    with api_world(pg_url, tmp_path) as w:
        transport = httpx.ASGITransport(app=w.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://kvgov.test") as c:
            done = await w.purge("acme", "bob@acme.example")  # a real, finished purge
            assert done.receipt is not None
            never_run = await w.purges.create(
                PurgeRequest(tenant="acme", user="alice@acme.example", requested_by="test")
            )
            with w.engine.begin() as conn:
                conn.execute(
                    text(
                        "INSERT INTO purge_receipts (job_id, receipt, signature, created_at) "
                        "SELECT :b, receipt, signature, created_at FROM purge_receipts "
                        "WHERE job_id = :a"
                    ),
                    {"a": done.id, "b": never_run.id},
                )
                conn.execute(
                    text("UPDATE purge_jobs SET state='completed', finished_at=now() WHERE id=:b"),
                    {"b": never_run.id},
                )
            auditor = bearer(w.tokens.auditor)
            stored = (await c.get(f"/v1/purges/{never_run.id}/receipt", headers=auditor)).json()
            assert stored["receipt"]["purge_id"] == done.id  # it is about another purge
            assert stored["receipt"]["subject"] != never_run.subject

            r = await c.get("/v1/purges?tenant=acme", headers=auditor)
            assert r.status_code == 200
            items = {i["id"]: i for i in r.json()["items"]}
            forged = items[never_run.id]["receipt"]
            assert forged["signature_valid"] is False, forged
            assert f"the receipt of purge {done.id}" in forged["reason"]
            assert items[done.id]["receipt"]["signature_valid"] is True  # its own still does
            # the dashboard reads the same summary: one verified receipt, bob's
            page = await c.get("/dashboard", headers=auditor)
            assert page.text.count('data-receipt="verified"') == 1

"""Migration 0004 keys ``requests`` by (request_id, tenant) and splits rows the global key had
folded together, from the chained events; its downgrade folds them back."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
import sqlalchemy as sa
from alembic import command

from kvgov.db.engine import alembic_config, make_engine, upgrade

pytestmark = pytest.mark.postgres

T0 = datetime(2026, 11, 20, 12, 0, tzinfo=UTC)


def _event(conn: sa.Connection, seq: int, tenant: str | None, request_id: str) -> None:
    conn.execute(
        sa.text(
            "INSERT INTO ledger_events (chain_id, seq, prev_hash, hash, encoding_version,"
            " occurred_at, kind, tenant, request_id, attrs)"
            " VALUES ('node-a', :seq, :h, :h, 1, :at, 'kv:get', :tenant, :rid, '{}')"
        ),
        {"seq": seq, "h": f"{seq:064x}", "at": T0, "tenant": tenant, "rid": request_id},
    )


def test_a_shared_request_id_becomes_one_request_per_tenant(db_url: str) -> None:
    upgrade(db_url, "0003")
    engine = make_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    "INSERT INTO chains (chain_id, public_key, created_at)"
                    " VALUES ('node-a', :pk, :at)"
                ),
                {"pk": b"\0" * 32, "at": T0},
            )
            _event(conn, 1, "acme", "R")
            _event(conn, 2, "globex", "R")
            _event(conn, 3, None, "S")
            # what the global key left: one row for R (the first tenant's), one tenantless
            for rid, tenant in (("R", "acme"), ("S", None)):
                conn.execute(
                    sa.text(
                        "INSERT INTO requests (request_id, tenant, first_seen_at, last_seen_at)"
                        " VALUES (:rid, :tenant, :at, :at)"
                    ),
                    {"rid": rid, "tenant": tenant, "at": T0},
                )
        upgrade(db_url)
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text("SELECT request_id, tenant FROM requests ORDER BY 1, 2")
            ).all()
        assert [tuple(r) for r in rows] == [("R", "acme"), ("R", "globex"), ("S", "")]
        command.downgrade(alembic_config(db_url), "0003")  # folds them back, one row per id
        with engine.connect() as conn:
            rows = conn.execute(sa.text("SELECT request_id, tenant FROM requests ORDER BY 1")).all()
        assert [tuple(r) for r in rows] == [("R", "acme"), ("S", None)]
    finally:
        engine.dispose()

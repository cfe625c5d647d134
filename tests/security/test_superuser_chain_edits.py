"""A database superuser edits the chain of a production sidecar's ledger: triggers off
(``session_replication_role = replica`` skips every trigger, the append-only guard
included), then a row updated, deleted, inserted (naively, or with the rows after it
renumbered and re-hashed, as someone who knows the unkeyed hash algorithm would) or two rows
swapped. ``kvgov audit verify`` (with the operator's signing key pinned), ``GET
/v1/audit/verify`` and ``/dashboard`` all report the chain broken.

Attack (issue 14, first paragraph: "superuser edits of the chain" held). The re-keyed rewrite
(events removed, the rest re-hashed, checkpoints re-signed with a fresh key and
``chains.public_key`` replaced: "what got through" 2) is its own test. The runtime role's
attempts are ``test_db_privileges.py``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from fastapi import FastAPI
from psycopg.rows import dict_row
from sqlalchemy.orm import Session
from typer.testing import CliRunner

from kvgov.cli.main import build_app
from kvgov.config import Settings
from kvgov.db.engine import make_engine
from kvgov.db.tokens import TokenRepository
from kvgov.ledger.chain import ChainedFields, link
from kvgov.ledger.events import InMemoryEventSink
from kvgov.proxy.api.compliance import include_sidecar_api
from kvgov.proxy.app import Sidecar
from kvgov.types import Role
from kvgov.wire import RequestContext
from tests.security import doors
from tests.security.doors import engine, key, run

pytestmark = pytest.mark.postgres

Conn = psycopg.Connection[dict[str, Any]]


def _rows(conn: Conn, chain: str) -> list[dict[str, Any]]:
    return conn.execute(
        "SELECT * FROM ledger_events WHERE chain_id = %s ORDER BY seq", (chain,)
    ).fetchall()


def _checkpointed(conn: Conn, chain: str) -> int:
    seq = conn.execute(
        "SELECT max(seq) AS s FROM checkpoints WHERE chain_id = %s", (chain,)
    ).fetchone()
    assert seq is not None
    assert seq["s"] is not None
    return int(seq["s"])


def _hash(row: dict[str, Any]) -> str:
    attrs = row["attrs"]
    fields = {k: v for k, v in row.items() if k != "hash"}
    fields["attrs"] = json.loads(attrs) if isinstance(attrs, str) else attrs
    return link(ChainedFields(**fields))


def _insert(conn: Conn, row: dict[str, Any]) -> None:
    cols = list(row)
    values = [
        json.dumps(v) if c == "attrs" and not isinstance(v, str) else v for c, v in row.items()
    ]
    conn.execute(
        f"INSERT INTO ledger_events ({', '.join(cols)}) VALUES ({', '.join(['%s'] * len(cols))})",
        values,
    )


def _renumber_from(conn: Conn, chain: str, seq: int, by: int) -> None:
    conn.execute(
        "UPDATE ledger_events SET seq = -seq - 1000000 WHERE chain_id = %s AND seq >= %s",
        (chain, seq),
    )
    conn.execute(
        "UPDATE ledger_events SET seq = -seq - 1000000 + %s WHERE chain_id = %s AND seq < 0",
        (by, chain),
    )


def update_a_row(conn: Conn, chain: str) -> None:
    """The evidence of a put is made to name another tenant."""
    mid = _checkpointed(conn, chain) // 2
    conn.execute(
        "UPDATE ledger_events SET tenant = 'globex', nbytes = 1 WHERE chain_id = %s AND seq = %s",
        (chain, mid),
    )


def delete_a_row(conn: Conn, chain: str) -> None:
    """A denial disappears."""
    rows = [r for r in _rows(conn, chain) if r["kind"] == "kv:entry:denied"]
    seq = rows[0]["seq"]
    conn.execute("DELETE FROM event_payloads WHERE chain_id = %s AND seq = %s", (chain, seq))
    conn.execute("DELETE FROM ledger_events WHERE chain_id = %s AND seq = %s", (chain, seq))


def insert_a_row_naively(conn: Conn, chain: str) -> None:
    """A forged row appended with a made-up hash."""
    head = _rows(conn, chain)[-1]
    forged = dict(head)
    forged.update(seq=head["seq"] + 1, prev_hash=head["hash"], hash="ab" * 32, kind="kv:delete")
    _insert(conn, forged)


def insert_a_row_and_rehash(conn: Conn, chain: str) -> None:
    """A forged ``kv:delete`` in the middle (before the last checkpoint), every later row
    renumbered and re-hashed so each link checks out."""
    mid = _checkpointed(conn, chain) // 2
    _renumber_from(conn, chain, mid + 1, 1)
    rows = {r["seq"]: r for r in _rows(conn, chain)}
    forged = dict(rows[mid])
    forged.update(
        seq=mid + 1,
        prev_hash=rows[mid]["hash"],
        kind="kv:delete",
        occurred_at=datetime.now(UTC),
        nbytes=0,
    )
    forged["hash"] = _hash(forged)
    _insert(conn, forged)
    prev = forged["hash"]
    for seq in sorted(s for s in rows if s > mid + 1):
        row = dict(rows[seq])
        row["prev_hash"] = prev
        row["hash"] = _hash(row)
        conn.execute(
            "UPDATE ledger_events SET prev_hash = %s, hash = %s WHERE chain_id = %s AND seq = %s",
            (row["prev_hash"], row["hash"], chain, seq),
        )
        prev = row["hash"]


def reorder_rows(conn: Conn, chain: str) -> None:
    """Two genuine rows swap places (their hashes untouched)."""
    a = _checkpointed(conn, chain) // 2
    b = a + 1
    for old, new in ((a, -1), (b, a), (-1, b)):
        conn.execute(
            "UPDATE ledger_events SET seq = %s WHERE chain_id = %s AND seq = %s", (new, chain, old)
        )


EDITS: dict[str, Callable[[Conn, str], None]] = {
    "update": update_a_row,
    "delete": delete_a_row,
    "insert-naive": insert_a_row_naively,
    "insert-rehashed": insert_a_row_and_rehash,
    "reorder": reorder_rows,
}


def tamper(dsn: str, chain: str, edit: Callable[[Conn, str], None]) -> None:
    with psycopg.connect(dsn, row_factory=dict_row) as conn:
        conn.execute("SET session_replication_role = replica")  # no trigger fires
        edit(conn, chain)
        conn.commit()


async def _traffic(sc: Sidecar) -> None:
    acme, globex = engine(sc, "tok-acme"), engine(sc, "tok-globex")
    try:
        for i in range(4):
            ctx = RequestContext(request_id=f"c-{i}", tenant="acme", user="alice")
            assert (await run(acme.put, key(i, "acme", user="alice"), os.urandom(2048), ctx)).ok
            assert await run(acme.get, key(i, "acme", user="alice"), ctx) is not None
            assert await run(globex.get, key(i, "acme", user="alice"), None) is None  # denied
    finally:
        acme.close()
        globex.close()


def cli_verify(settings: Settings) -> tuple[int, dict[str, Any]]:
    """``kvgov audit verify`` as an operator runs it, pinning the sidecar's signing key."""
    env = {
        "KVGOV_DATABASE__URL": settings.database_url,
        "KVGOV_DATA_DIR": str(settings.data_dir),
    }
    result = CliRunner().invoke(
        build_app(),
        ["audit", "verify", "--json", "--trust-key", str(settings.signing_key_path)],
        env=env,
    )
    return result.exit_code, json.loads(result.stdout)


@pytest.mark.parametrize("edit", list(EDITS.values()), ids=list(EDITS))
async def test_superuser_edits_of_the_chain_are_detected(
    tmp_path: Path, prod_db: doors.ProdDatabase, edit: Callable[[Conn, str], None]
) -> None:
    async with doors.sidecar(tmp_path, prod_db) as sc:
        await _traffic(sc)
        assert sc.writer is not None
        await sc.writer.flush()
        assert await sc.writer.write_checkpoint() is not None
        await _traffic(sc)  # and more after the checkpoint
        settings = sc.settings
    chain = settings.chain_id  # the sidecar stopped (its last checkpoint signed): at rest

    code, report = await run(cli_verify, settings)
    assert code == 0, report  # intact before the attack
    assert report["ok"] is True

    await run(tamper, prod_db.superuser_dsn, chain, edit)

    code, report = await run(cli_verify, settings)
    assert code == 1, report
    assert report["ok"] is False
    mine = next(c for c in report["chains"] if c["chain_id"] == chain)
    assert mine["findings"], mine

    # the control plane's view: the same API the sidecar mounts, over the tampered ledger
    db = make_engine(settings.database_url)
    try:
        with Session(db) as s:
            _, raw = TokenRepository(s).create(Role.AUDITOR)
            s.commit()
        app = FastAPI()
        include_sidecar_api(app, settings, db, InMemoryEventSink())
        headers = {"Authorization": f"Bearer {raw}"}
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://kvgov.test") as c:
            api = (await c.get("/v1/audit/verify", headers=headers)).json()
            assert api["ok"] is False, api
            assert any(ch["chain_id"] == chain and not ch["ok"] for ch in api["chains"])
            page = (await c.get("/dashboard", headers=headers)).text
            assert 'data-integrity="broken"' in page
            assert 'data-integrity="ok"' not in page
    finally:
        db.dispose()

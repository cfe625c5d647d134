"""A rewritten ledger re-signed with a fresh key is not "intact": trust comes from outside.

Attack (issue 14, "what got through" 2): with the append-only guard off, a database superuser
removed events, renumbered and re-hashed the rest, re-signed the checkpoints with a fresh
Ed25519 key and stored that key in ``chains.public_key``: ``kvgov audit verify`` exited 0,
``GET /v1/audit/verify`` said ok and ``/dashboard`` showed "Intact", because verification
trusted the key stored in the database it verified. Also: a chain signed by an unknown key, a
chain removed with its rows (the fleet registry still names it), and a ledger emptied while
the rest of the database shows it was used.

Each test runs a production sidecar (Postgres, runtime role) whose engines write real events,
attacks as the superuser, and asks all three doors: the CLI (as an operator runs it, with the
node's configuration), the API and the dashboard (an auditor's token).
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy.orm import Session
from typer.testing import CliRunner

from kvgov.cli.main import build_app
from kvgov.db.engine import make_engine, upgrade, utcnow
from kvgov.db.models import Checkpoint, LedgerEvent, table
from kvgov.db.tokens import TokenRepository
from kvgov.ledger.chain import (
    GENESIS_HASH,
    ChainedFields,
    link,
    public_key_bytes,
    sign_checkpoint,
)
from kvgov.ledger.events import Event
from kvgov.ledger.writer import LedgerWriter
from kvgov.proxy.api.app import create_control_app
from kvgov.proxy.app import Sidecar
from kvgov.types import EventKind, Outcome, Role
from kvgov.wire import RequestContext
from tests.pgroles import RoleDatabase, role_database
from tests.security import doors
from tests.security.doors import engine, key, run

pytestmark = pytest.mark.postgres

GUARDED = ("ledger_events", "checkpoints", "chains", "chain_seals", "event_payloads")
#: the tables holding a chain's rows by ``chain_id`` (its ``chains`` row aside): what an
#: attacker deletes to make a chain disappear
CHAIN_ROWS = (
    "event_payloads",
    "ledger_events",
    "checkpoints",
    "chain_seals",
    "ledger_journal_marks",
)


@dataclass
class Db:
    roles: RoleDatabase
    prod: doors.ProdDatabase

    @property
    def superuser_url(self) -> str:
        return self.roles.url("postgres")


@pytest.fixture
def db() -> Iterator[Db]:
    with role_database() as roles:
        upgrade(roles.owner_url, runtime_role=roles.runtime)
        yield Db(roles, doors.ProdDatabase(url=roles.runtime_url, runtime_role=roles.runtime))


@dataclass
class Doors:
    sc: Sidecar
    api: httpx.AsyncClient
    auditor: dict[str, str]
    env: dict[str, str]

    def cli(self, *args: str) -> Any:
        return CliRunner().invoke(build_app(), list(args), env=self.env)

    async def verdicts(self) -> tuple[int, dict[str, Any], dict[str, Any], str]:
        """CLI exit code and JSON report, the API's report, the dashboard's HTML."""
        result = await run(self.cli, "audit", "verify", "--json")
        api = await self.api.get("/v1/audit/verify", headers=self.auditor)
        page = await self.api.get("/dashboard", headers=self.auditor)
        assert api.status_code == 200 and page.status_code == 200, (api.text, page.text)
        return result.exit_code, json.loads(result.stdout), api.json(), page.text

    async def assert_intact(self) -> None:
        code, cli, api, page = await self.verdicts()
        assert code == 0, cli
        assert cli["ok"] and api["ok"], (cli, api)
        assert 'data-integrity="ok"' in page

    async def assert_broken(self, problem: str) -> tuple[dict[str, Any], dict[str, Any]]:
        code, cli, api, page = await self.verdicts()
        assert code == 1, cli
        assert cli["ok"] is False and api["ok"] is False
        assert 'data-integrity="ok"' not in page and "Intact" not in page
        assert 'data-integrity="broken"' in page
        found = {(c.get("first_bad") or {}).get("problem") for c in cli["chains"]}
        assert problem in found, cli
        return cli, api


@asynccontextmanager
async def served(tmp_path: Path, db: Db, **ledger: Any) -> AsyncIterator[Doors]:
    settings = doors.settings(tmp_path, db.prod)
    # each verdict must see the edit just made: no verification report is served again
    fresh = {"verify_cache_s": 0, "verify_scoped_refresh_s": 0}
    settings = settings.model_copy(update={"api": settings.api.model_copy(update=fresh)})
    if ledger:
        settings = settings.model_copy(update={"ledger": settings.ledger.model_copy(update=ledger)})
    from kvgov.proxy.app import build_sidecar

    sc = await build_sidecar(settings)
    await sc.start()
    try:
        with Session(sc.engine) as s:
            _, raw = TokenRepository(s).create(Role.AUDITOR)
            s.commit()
        env = {
            "KVGOV_DATABASE_URL": db.prod.url,
            "KVGOV_DATA_DIR": str(settings.data_dir),
        }
        for name, value in ledger.items():
            env[f"KVGOV_LEDGER__{name.upper()}"] = (
                json.dumps(value) if isinstance(value, list) else str(value)
            )
        transport = httpx.ASGITransport(app=create_control_app(sc.control_plane()))
        async with httpx.AsyncClient(transport=transport, base_url="http://kvgov.test") as api:
            yield Doors(sc, api, {"Authorization": f"Bearer {raw}"}, env)
    finally:
        await sc.stop()


async def traffic(sc: Sidecar, n: int = 6) -> None:
    """Real events on the sidecar's chain: an engine's puts and gets, then a checkpoint."""
    client = engine(sc, "tok-acme")
    try:
        for i in range(n):
            ctx = RequestContext(request_id=f"r-{i}", tenant="acme", user="alice")
            k = key(i, "acme", user="alice")
            assert (await run(client.put, k, os.urandom(2048), ctx)).ok
            assert await run(client.get, k, ctx) is not None
    finally:
        client.close()
    assert sc.writer is not None
    await sc.writer.flush()
    assert await sc.writer.write_checkpoint() is not None


@contextmanager
def superuser(url: str) -> Iterator[sa.Connection]:
    """The database superuser with the append-only guard switched off."""
    eng = sa.create_engine(url)
    try:
        with eng.begin() as conn:
            for t in GUARDED:
                conn.exec_driver_sql(f"ALTER TABLE {t} DISABLE TRIGGER ALL")
            yield conn
            for t in GUARDED:
                conn.exec_driver_sql(f"ALTER TABLE {t} ENABLE TRIGGER ALL")
    finally:
        eng.dispose()


def rekeyed_rewrite(conn: sa.Connection, chain_id: str, drop: set[int]) -> Ed25519PrivateKey:
    """Remove events ``drop``, renumber and re-hash the rest, replace every checkpoint by one
    signed with a fresh key, and store that key as the chain's: a self-consistent chain."""
    mallory = Ed25519PrivateKey.generate()
    events, cps = table(LedgerEvent), table(Checkpoint)
    rows = [
        dict(r._mapping)
        for r in conn.execute(
            sa.select(events).where(events.c.chain_id == chain_id).order_by(events.c.seq)
        )
    ]
    params = {"c": chain_id}
    conn.execute(sa.text("DELETE FROM event_payloads WHERE chain_id = :c"), params)
    conn.execute(sa.text("DELETE FROM ledger_events WHERE chain_id = :c"), params)
    conn.execute(sa.text("DELETE FROM checkpoints WHERE chain_id = :c"), params)
    prev, seq = GENESIS_HASH, 0
    chained = set(ChainedFields.__dataclass_fields__) - {"attrs_json"}
    for row in rows:
        if row["seq"] in drop:
            continue
        seq += 1
        values = {**row, "seq": seq, "prev_hash": prev, "payload_digest": None}
        values["attrs"] = values["attrs"] if values["attrs"] is not None else {}
        values["hash"] = prev = link(ChainedFields(**{k: values[k] for k in chained}))
        conn.execute(events.insert().values(**values))
    now = utcnow()
    conn.execute(
        cps.insert().values(
            chain_id=chain_id,
            seq=seq,
            head_hash=prev,
            signed_at=now,
            signature=sign_checkpoint(mallory, chain_id, seq, prev, now),
            public_key=public_key_bytes(mallory),
        )
    )
    conn.execute(
        sa.text("UPDATE chains SET public_key = :pk WHERE chain_id = :c"),
        {**params, "pk": public_key_bytes(mallory)},
    )
    return mallory


async def test_a_rekeyed_rewrite_is_not_intact(tmp_path: Path, db: Db) -> None:
    async with served(tmp_path, db) as d:
        await traffic(d.sc)
        await d.assert_intact()
        chain_id = d.sc.writer.chain_id if d.sc.writer else ""
        removed = {e.seq for e in doors.events(d.sc, EventKind.KV_PUT)[:2]}
        with superuser(db.superuser_url) as conn:
            rekeyed_rewrite(conn, chain_id, removed)
        _, api = await d.assert_broken("untrusted_key")
        chain = next(c for c in api["chains"] if c["chain_id"] == chain_id)
        assert chain["problem"] == "untrusted_key"
        text = await run(d.cli, "audit", "verify")
        assert text.exit_code == 1
        assert f"BROKEN {chain_id}: untrusted_key" in text.stdout


async def test_a_chain_of_an_unknown_key_fails_until_its_key_is_configured(
    tmp_path: Path, db: Db
) -> None:
    stranger = Ed25519PrivateKey.generate()
    async with served(tmp_path / "a", db) as d:
        await traffic(d.sc, 2)
        await _chain_of(db.prod.url, "other-node", stranger)
        await d.assert_broken("untrusted_key")
    # its operator prints the key (`kvgov audit public-key`) and it is distributed to the fleet
    other = tmp_path / "other"
    other.mkdir()
    (other / "ledger-signing.key").write_bytes(_pem(stranger))
    (other / "ledger-signing.key").chmod(0o600)
    printed = CliRunner().invoke(
        build_app(), ["audit", "public-key"], env={"KVGOV_DATA_DIR": str(other)}
    )
    assert printed.exit_code == 0, printed.output
    public = printed.stdout.strip()
    assert public.startswith("ed25519:")
    async with served(tmp_path / "a", db, trusted_keys=[public]) as d:  # node a restarted
        await d.assert_intact()


async def test_a_removed_chain_the_fleet_registry_names_is_missing(tmp_path: Path, db: Db) -> None:
    async with served(tmp_path, db) as d:
        await traffic(d.sc, 2)
        other = Ed25519PrivateKey.generate()
        pub = "ed25519:" + base64.b64encode(public_key_bytes(other)).decode()
        await _chain_of(db.prod.url, "node-b", other)
        with superuser(db.superuser_url) as conn:
            conn.execute(
                sa.text(
                    "INSERT INTO sidecars (id, chain_id, started_at, last_seen_at) "
                    "VALUES ('node-b', 'node-b', now(), now())"
                )
            )
        d.env["KVGOV_LEDGER__TRUSTED_KEYS"] = json.dumps([pub])
        code, cli, _, _ = await d.verdicts()
        assert code == 0, cli
        # the attacker removes node-b's chain: events, payloads, checkpoints, chain row
        with superuser(db.superuser_url) as conn:
            for t in CHAIN_ROWS:
                conn.execute(sa.text(f"DELETE FROM {t} WHERE chain_id = 'node-b'"))
            conn.execute(sa.text("DELETE FROM chains WHERE chain_id = 'node-b'"))
        _, api = await d.assert_broken("missing_chain")
        missing = next(c for c in api["chains"] if c["chain_id"] == "node-b")
        assert missing["problem"] == "missing_chain"
        assert "fleet registry" in (missing["detail"] or "")


async def test_the_serving_sidecars_own_chain_removed_is_missing(tmp_path: Path, db: Db) -> None:
    async with served(tmp_path, db) as d:
        await traffic(d.sc, 2)
        chain_id = d.sc.writer.chain_id if d.sc.writer else ""
        with superuser(db.superuser_url) as conn:
            for t in CHAIN_ROWS:
                conn.execute(sa.text(f"DELETE FROM {t} WHERE chain_id = :c"), {"c": chain_id})
            conn.execute(sa.text("UPDATE cache_entries SET chain_id = NULL"))
            conn.execute(sa.text("UPDATE policy_decisions SET chain_id = NULL"))
            conn.execute(sa.text("DELETE FROM sidecars"))
            conn.execute(sa.text("DELETE FROM chains WHERE chain_id = :c"), {"c": chain_id})
        api = (await d.api.get("/v1/audit/verify", headers=d.auditor)).json()
        assert api["ok"] is False
        mine = next(c for c in api["chains"] if c["chain_id"] == chain_id)
        assert mine["problem"] == "missing_chain"


async def test_an_emptied_ledger_is_not_intact(tmp_path: Path, db: Db) -> None:
    async with served(tmp_path, db) as d:
        await traffic(d.sc, 2)
        env = d.env
    # every chained row, and the fleet registry, removed; the cache index and keys remain
    with superuser(db.superuser_url) as conn:
        for t in (*CHAIN_ROWS, "sidecars", "chains"):
            conn.execute(sa.text(f"DELETE FROM {t}"))
        conn.execute(sa.text("UPDATE cache_entries SET chain_id = NULL"))
        conn.execute(sa.text("UPDATE policy_decisions SET chain_id = NULL"))
    result = CliRunner().invoke(build_app(), ["audit", "verify", "--json"], env=env)
    report = json.loads(result.stdout)
    assert result.exit_code == 1 and report["chains"] == [] and report["problems"], report
    assert "emptied" in report["problems"][0]
    text = CliRunner().invoke(build_app(), ["audit", "verify"], env=env)
    assert text.exit_code == 1 and "BROKEN ledger" in text.stdout


def test_a_fresh_ledger_is_empty_not_broken(db: Db, tmp_path: Path) -> None:
    env = {"KVGOV_DATABASE_URL": db.prod.url, "KVGOV_DATA_DIR": str(tmp_path)}
    result = CliRunner().invoke(build_app(), ["audit", "verify"], env=env)
    assert result.exit_code == 0, result.output
    assert "ledger is empty" in result.stdout


async def _chain_of(url: str, chain_id: str, key: Ed25519PrivateKey) -> None:
    """Another node's chain: a few events and a signed checkpoint."""
    eng = make_engine(url)
    writer = LedgerWriter(eng, chain_id=chain_id, signing_key=key)
    try:
        await writer.start()
        for i in range(3):
            await writer.append(
                Event(kind=EventKind.KV_GET, tenant="acme", request_id=f"o-{i}", outcome=Outcome.OK)
            )
        await writer.close(checkpoint=True)
    finally:
        eng.dispose()


def _pem(key: Ed25519PrivateKey) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )

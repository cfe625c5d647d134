"""API tokens stand on the ledger, and their rows are fixed once written (review r15, F3).

The runtime database role (every sidecar pod's) may INSERT and UPDATE ``api_tokens``; the API
trusted the row alone, so that role could un-revoke, escalate, widen or hijack a token.
Migration 0015's trigger (Postgres and SQLite) refuses any change of a row but its revocation
(once, NULL to a timestamp) and its last use, and the API weighs every row against its chained
``token:created`` / ``token:revoked`` events (:func:`kvgov.db.tokens.judge`), found through an
index of their own: a chained revocation is final whatever the row says, a row that differs
from its recorded creation is refused, and one with no recorded creation is served, logged and
counted. The runtime role's own attempts are in ``tests/security/test_db_privileges.py`` and
``tests/security/test_api_idor.py``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import psycopg
import pytest
import sqlalchemy as sa

from kvgov.db.engine import make_engine, make_sessionmaker, upgrade
from kvgov.db.models import Chain, LedgerEvent
from kvgov.db.tokens import (
    Creation,
    Standing,
    TokenRecord,
    TokenRepository,
    Trail,
    creation_digest,
    hash_token,
    judge,
    new_token,
    tokens_unrecorded,
    trail_query,
)
from kvgov.ledger.events import Event
from kvgov.types import EventKind, Role
from tests.integration.test_api_support import ApiWorld, api_world, bearer

pytestmark = pytest.mark.postgres

T0 = datetime(2026, 11, 30, 10, 0, tzinfo=UTC)
REFUSED = "revocation of an API token never change"

#: what the trigger refuses, in SQL both dialects speak
EDITS = {
    "un-revoke": ("UPDATE api_tokens SET revoked_at = NULL", {}),
    "move-revocation": ("UPDATE api_tokens SET revoked_at = :t", {"t": T0}),
    "escalate-role": ("UPDATE api_tokens SET role = 'admin'", {}),
    "widen-tenant": ("UPDATE api_tokens SET tenant = NULL", {}),
    "move-tenant": ("UPDATE api_tokens SET tenant = 'globex'", {}),
    "swap-hash": ("UPDATE api_tokens SET token_hash = 'ab' || token_hash", {}),
    "change-name": ("UPDATE api_tokens SET name = 'ci-bot'", {}),
    "change-id": ("UPDATE api_tokens SET id = 'f' || substr(id, 2)", {}),
    "backdate": ("UPDATE api_tokens SET created_at = :t", {"t": T0 - timedelta(days=365)}),
}


def _seed_tokens(engine: sa.Engine) -> tuple[TokenRecord, TokenRecord]:
    """An acme auditor (revoked) and a global admin (active)."""
    with make_sessionmaker(engine)() as s:
        repo = TokenRepository(s)
        auditor, _ = repo.create(Role.AUDITOR, tenant="acme")
        admin, _ = repo.create(Role.ADMIN)
        s.commit()
        repo.revoke(auditor.id)
        s.commit()
    return auditor, admin


def _rows(engine: sa.Engine) -> list[tuple[Any, ...]]:
    with engine.connect() as conn:
        return [
            tuple(r)
            for r in conn.exec_driver_sql(
                "SELECT id, name, token_hash, role, tenant, created_at, revoked_at"
                " FROM api_tokens ORDER BY id"
            )
        ]


@pytest.fixture
def seeded(db_url: str) -> Iterator[tuple[sa.Engine, TokenRecord, TokenRecord]]:
    upgrade(db_url)
    engine = make_engine(db_url)
    try:
        yield (engine, *_seed_tokens(engine))
    finally:
        engine.dispose()


@pytest.mark.parametrize("edit", list(EDITS), ids=list(EDITS))
def test_a_token_row_is_fixed_once_written(
    seeded: tuple[sa.Engine, TokenRecord, TokenRecord], edit: str
) -> None:
    engine, _, _ = seeded
    before = _rows(engine)
    statement, params = EDITS[edit]
    with pytest.raises(sa.exc.DatabaseError, match=REFUSED):
        with engine.begin() as conn:
            conn.execute(sa.text(statement), params)
    assert _rows(engine) == before


def test_what_the_api_writes_stays_allowed(
    seeded: tuple[sa.Engine, TokenRecord, TokenRecord],
) -> None:
    engine, auditor, admin = seeded
    with make_sessionmaker(engine)() as s:
        repo = TokenRepository(s)
        repo.touch(auditor.id, T0)
        repo.touch(admin.id, T0)
        s.commit()
        assert repo.revoke(auditor.id).revoked_at is not None  # idempotent: no write
        revoked = repo.revoke(admin.id)
        s.commit()
    assert revoked.revoked_at is not None
    rows = {r[0]: r for r in _rows(engine)}
    assert rows[admin.id][6] is not None
    with engine.begin() as conn:  # a statement naming every column, changing none
        same = conn.exec_driver_sql(
            "UPDATE api_tokens SET id = id, name = name, token_hash = token_hash, role = role,"
            " tenant = tenant, created_at = created_at, revoked_at = revoked_at"
        )
        assert same.rowcount == 2


def test_no_replace_or_upsert_over_a_token(
    seeded: tuple[sa.Engine, TokenRecord, TokenRecord],
) -> None:
    """SQLite's ``INSERT OR REPLACE`` deletes the row in its way without an UPDATE (or DELETE)
    trigger; Postgres' upsert is an UPDATE. Neither revives the revoked auditor as an admin."""
    engine, auditor, _ = seeded
    before = _rows(engine)
    values = {"id": auditor.id, "h": hash_token(new_token()), "t": T0}
    if engine.dialect.name == "sqlite":
        statement = (
            "INSERT OR REPLACE INTO api_tokens (id, name, token_hash, role, tenant, created_at,"
            " revoked_at, last_used_at) VALUES (:id, 'x', :h, 'admin', NULL, :t, NULL, NULL)"
        )
    else:
        statement = (
            "INSERT INTO api_tokens (id, name, token_hash, role, tenant, created_at, revoked_at,"
            " last_used_at) VALUES (:id, 'x', :h, 'admin', NULL, :t, NULL, NULL)"
            " ON CONFLICT (id) DO UPDATE SET role = EXCLUDED.role, tenant = NULL,"
            " revoked_at = NULL, token_hash = EXCLUDED.token_hash"
        )
    with pytest.raises(sa.exc.DatabaseError, match=REFUSED):
        with engine.begin() as conn:
            conn.execute(sa.text(statement), values)
    assert _rows(engine) == before


# -- the token's events, through their index -----------------------------------------------

INDEX = "ix_ledger_events_token_id"


def _event(seq: int, kind: str, attrs: dict[str, Any], tenant: str | None = None) -> dict[str, Any]:
    return {
        "chain_id": "node-a",
        "seq": seq,
        "prev_hash": f"{seq - 1:064x}",
        "hash": f"{seq:064x}",
        "encoding_version": 1,
        "occurred_at": T0 + timedelta(seconds=seq),
        "kind": kind,
        "tenant": tenant,
        "attrs": attrs,
    }


def _token_id(n: int) -> str:
    return f"5b0c8a8e-1f0e-4f55-9d73-{n:012d}"


def test_the_api_reads_a_tokens_events_through_their_index(db_url: str) -> None:
    upgrade(db_url)
    engine = make_engine(db_url)
    try:
        rows, seq = [], 1
        for n in range(400):
            for kind in ("token:created", "api:access", "kv:put", "api:access"):
                attrs = {"token_id": _token_id(n), "role": "auditor"}
                rows.append(_event(seq, kind, attrs if kind.startswith("token") else {}))
                seq += 1
        rows.append(_event(seq, "token:revoked", {"token_id": _token_id(7), "role": "auditor"}))
        # near misses: another kind naming the id, an id containing it
        rows.append(_event(seq + 1, "api:access", {"token_id": _token_id(8)}))
        rows.append(_event(seq + 2, "token:revoked", {"token_id": _token_id(8) + "0"}))
        with engine.begin() as conn:
            conn.execute(
                sa.insert(Chain.__table__).values(
                    chain_id="node-a", public_key=b"\0" * 32, created_at=T0, description=None
                )
            )
            conn.execute(sa.insert(LedgerEvent.__table__), rows)
            if conn.dialect.name == "postgresql":
                conn.exec_driver_sql("ANALYZE ledger_events")
        with engine.connect() as conn:
            compiled = trail_query(_token_id(7)).compile(dialect=conn.dialect)
            if conn.dialect.name == "sqlite":
                params = tuple(compiled.params[k] for k in compiled.positiontup or ())
                plan = "\n".join(
                    str(r[-1])
                    for r in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + str(compiled), params)
                )
                assert re.search(rf"\bUSING INDEX {INDEX}\b", plan), plan
            else:
                plan = "\n".join(
                    str(r[0])
                    for r in conn.exec_driver_sql("EXPLAIN " + str(compiled), compiled.params)
                )
                assert re.search(rf"\b(using|on) {INDEX}\b", plan), plan
        with make_sessionmaker(engine)() as s:
            repo = TokenRepository(s)
            seven, eight, nine = (repo.trail(_token_id(n)) for n in (7, 8, 9))
        assert seven.revoked and len(seven.created) == 1
        assert not eight.revoked and len(eight.created) == 1
        assert nine == Trail(revoked=False, created=(Creation("auditor", None, None),))
    finally:
        engine.dispose()


# -- judging a row against its events (no database) ----------------------------------------


def _record(role: Role = Role.AUDITOR, tenant: str | None = "acme") -> TokenRecord:
    return TokenRecord(
        id=_token_id(1),
        name="n",
        role=role,
        tenant=tenant,
        created_at=T0,
        revoked_at=None,
        last_used_at=None,
    )


HASH = hash_token(new_token())
MADE = Creation("auditor", "acme", creation_digest(HASH))


@pytest.mark.parametrize(
    ("record", "trail", "token_hash", "standing"),
    [
        (_record(), Trail(False, (MADE,)), HASH, Standing.RECORDED),
        (_record(), Trail(True, (MADE,)), HASH, Standing.REVOKED),
        (_record(), Trail(True, ()), HASH, Standing.REVOKED),
        (_record(), Trail(False, ()), HASH, Standing.UNRECORDED),
        # the row's role or tenant is not the recorded one: escalated or widened
        (_record(Role.ADMIN), Trail(False, (MADE,)), HASH, Standing.CONTRADICTED),
        (_record(tenant=None), Trail(False, (MADE,)), HASH, Standing.CONTRADICTED),
        # another hash on the row: swapped
        (_record(), Trail(False, (MADE,)), hash_token(new_token()), Standing.CONTRADICTED),
        # a dashboard session: the hash was checked at sign-in
        (_record(), Trail(False, (MADE,)), None, Standing.RECORDED),
        (_record(Role.ADMIN), Trail(False, (MADE,)), None, Standing.CONTRADICTED),
        # a creation of a release before 0015: no digest; role and tenant must still match
        (_record(), Trail(False, (Creation("auditor", "acme", None),)), HASH, "legacy"),
        (_record(Role.ADMIN), Trail(False, (Creation("auditor", "acme", None),)), HASH, "c"),
        # junk in a digest (someone inserting events) matches nothing
        (_record(), Trail(False, (Creation("auditor", "acme", "é"),)), HASH, "c"),
    ],
)
def test_judge(record: TokenRecord, trail: Trail, token_hash: str | None, standing: str) -> None:
    expected = {"legacy": Standing.RECORDED_LEGACY, "c": Standing.CONTRADICTED}.get(
        standing, standing
    )
    assert judge(record, trail, token_hash) == expected


# -- the API: rows edited behind its back (the trigger off: what a superuser could do) -------


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiWorld]:
    from tests.conftest import create_pg_database, drop_pg_database

    name, url = create_pg_database()
    try:
        with api_world(url, tmp_path_factory.mktemp("tokledger"), seed=False) as w:
            yield w
    finally:
        drop_pg_database(name)


@pytest.fixture
async def client(world: ApiWorld) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=world.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://kvgov.test") as c:
        yield c


def _as_superuser(world: ApiWorld, statement: str, *params: object) -> None:
    """``statement`` with the triggers off (a superuser's ``session_replication_role``)."""
    dsn = world.database_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(dsn) as conn:
        conn.execute("SET session_replication_role = replica")
        assert conn.execute(statement, params).rowcount == 1  # type: ignore[arg-type]


async def _create(client: httpx.AsyncClient, world: ApiWorld, **body: object) -> dict[str, Any]:
    r = await client.post("/v1/tokens", json=body, headers=bearer(world.tokens.admin))
    assert r.status_code == 201, r.text
    made: dict[str, Any] = r.json()
    return made


async def test_a_created_token_records_its_digest_and_works(
    world: ApiWorld, client: httpx.AsyncClient
) -> None:
    made = await _create(client, world, role="auditor", tenant="acme")
    with make_sessionmaker(world.engine)() as s:
        trail = TokenRepository(s).trail(made["id"])
    assert trail == Trail(
        revoked=False,
        created=(Creation("auditor", "acme", creation_digest(hash_token(made["token"]))),),
    )
    assert (await client.get("/v1/entries", headers=bearer(made["token"]))).status_code == 200


@pytest.mark.parametrize(
    "edit",
    [
        "UPDATE api_tokens SET role = 'admin', tenant = NULL WHERE id = %s",
        "UPDATE api_tokens SET tenant = NULL WHERE id = %s",
        "UPDATE api_tokens SET revoked_at = NULL WHERE id = %s",
    ],
    ids=["escalate", "widen", "un-revoke"],
)
async def test_a_row_edited_after_its_creation_is_refused(
    world: ApiWorld, client: httpx.AsyncClient, edit: str
) -> None:
    made = await _create(client, world, role="auditor", tenant="acme")
    token = bearer(made["token"])
    assert (await client.get("/v1/entries", headers=token)).status_code == 200
    if "revoked_at" in edit:
        r = await client.delete(f"/v1/tokens/{made['id']}", headers=bearer(world.tokens.admin))
        assert r.status_code == 204
    _as_superuser(world, edit, made["id"])
    r = await client.get("/v1/tokens", headers=token)  # what an escalated token would reach
    assert r.status_code == 401, r.text
    assert (await client.get("/v1/entries", headers=token)).status_code == 401


async def test_a_hash_put_on_another_admins_token_is_refused(
    world: ApiWorld, client: httpx.AsyncClient
) -> None:
    alice = await _create(client, world, role="admin")
    mine = new_token()
    _as_superuser(
        world, "UPDATE api_tokens SET token_hash = %s WHERE id = %s", hash_token(mine), alice["id"]
    )
    assert (await client.get("/v1/tokens", headers=bearer(mine))).status_code == 401


async def test_an_unrecorded_token_is_served_and_said(
    world: ApiWorld, client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    """A row no ``token:created`` explains (the world's own tokens are made that way, through
    the repository): served, logged once per token and counted."""
    with make_sessionmaker(world.engine)() as s:
        record, raw = TokenRepository(s).create(Role.AUDITOR, name="by hand")
        s.commit()
    before = tokens_unrecorded()
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert (await client.get("/v1/entries", headers=bearer(raw))).status_code == 200
    assert tokens_unrecorded() == before + 1
    said = [r for r in caplog.records if r.getMessage() == "api.token.unrecorded"]
    assert len(said) == 1 and getattr(said[0], "token_id", None) == record.id
    assert raw not in caplog.text


async def test_a_token_of_the_previous_release_is_served(
    world: ApiWorld, client: httpx.AsyncClient
) -> None:
    """Its ``token:created`` has no digest: its role and tenant must match, and it is not
    counted as unrecorded."""
    with make_sessionmaker(world.engine)() as s:
        record, raw = TokenRepository(s).create(Role.AUDITOR, tenant="globex")
        s.commit()
    await world.writer.sink.append(
        Event(
            kind=EventKind.TOKEN_CREATED,
            tenant="globex",
            principal="cli:old",
            attrs={"token_id": record.id, "role": "auditor"},
        )
    )
    before = tokens_unrecorded()
    assert (await client.get("/v1/entries", headers=bearer(raw))).status_code == 200
    assert tokens_unrecorded() == before

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
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
import sqlalchemy as sa

from kvgov.db.engine import make_engine, make_sessionmaker, upgrade
from kvgov.db.models import ApiToken, Chain, LedgerEvent
from kvgov.db.tokens import (
    DIGEST_KEY,
    Creation,
    Standing,
    TokenRecord,
    TokenRepository,
    Trail,
    creation_digest,
    hash_token,
    judge,
    new_token,
    token_events_forged,
    tokens_unrecorded,
    trail_query,
)
from kvgov.ledger.chain import GENESIS_HASH, ChainedFields, link, load_public_key
from kvgov.ledger.events import Event
from kvgov.ledger.token_trail import TokenEventProofs
from kvgov.ledger.verify import row_fields
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
    # always another id: a uuid that began with 'f' was left as it was (1 run in 256 refused
    # nothing: both seeded ids began with 'f')
    "change-id": (
        (
            "UPDATE api_tokens SET id ="
            " CASE WHEN substr(id, 1, 1) = 'f' THEN 'e' ELSE 'f' END || substr(id, 2)"
        ),
        {},
    ),
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
    before, forged = tokens_unrecorded(), token_events_forged()
    assert (await client.get("/v1/entries", headers=bearer(made["token"]))).status_code == 200
    # its creation is vouched for at its first use: POST /v1/tokens signed the head above it
    assert (tokens_unrecorded(), token_events_forged()) == (before, forged)


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
    counted as unrecorded (once its writer signed a head above it)."""
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
    # that pod's writer signs its head (at its next periodic checkpoint, or its close): the API
    # counts a creation only under a head its writer signed (review r17, F1)
    await world.writer.write_checkpoint()
    before = tokens_unrecorded()
    assert (await client.get("/v1/entries", headers=bearer(raw))).status_code == 200
    assert tokens_unrecorded() == before


# -- a creation the ledger does not vouch for (review r17, F1) --------------------------------


def _forged_creation(
    world: ApiWorld,
    chain_id: str,
    public_key: bytes,
    *,
    linked: bool,
    seq: int = 1,
    prev_hash: str = GENESIS_HASH,
) -> tuple[str, str]:
    """What the runtime role can write (INSERT on ``chains``, ``ledger_events`` and
    ``api_tokens``): a chain of its own (none registered with an empty ``public_key``: the
    event goes on an existing chain at ``seq`` after ``prev_hash``), a ``token:created`` event
    on it naming a global admin with the right digest, and the minted admin's row. ``linked``:
    the event's hash is the one its fields give (the chain hash is unkeyed), else junk.
    Returns the token and its id."""
    raw, tid, now = new_token(), str(uuid.uuid4()), datetime.now(UTC)
    attrs = {"token_id": tid, "role": "admin", DIGEST_KEY: creation_digest(hash_token(raw))}
    fields = ChainedFields(
        chain_id=chain_id,
        seq=seq,
        prev_hash=prev_hash,
        occurred_at=now,
        kind="token:created",
        tenant=None,
        actor=None,
        request_id=None,
        key_digest=None,
        tier=None,
        nbytes=None,
        outcome=None,
        reason=None,
        decision_id=None,
        policy_revision=None,
        principal="token:someone",
        attrs=attrs,
        payload_digest=None,
    )
    with world.engine.begin() as conn:
        if public_key:
            conn.execute(
                sa.insert(Chain.__table__).values(
                    chain_id=chain_id, public_key=public_key, created_at=now, description=None
                )
            )
        conn.execute(
            sa.insert(LedgerEvent.__table__).values(
                chain_id=chain_id,
                seq=seq,
                prev_hash=prev_hash,
                hash=link(fields) if linked else "1" * 64,
                encoding_version=fields.encoding_version,
                occurred_at=now,
                kind="token:created",
                tenant=None,
                principal="token:someone",
                attrs=attrs,
            )
        )
        conn.execute(
            sa.insert(ApiToken.__table__).values(
                id=tid,
                name="x",
                token_hash=hash_token(raw),
                role="admin",
                tenant=None,
                created_at=now,
                revoked_at=None,
                last_used_at=None,
            )
        )
    if linked:  # read back, its hash is the one its columns give: only the chain betrays it
        with world.engine.connect() as conn:
            (row,) = conn.execute(trail_query(tid)).all()
        assert link(row_fields(row)) == row.hash
    return raw, tid


@pytest.mark.parametrize(
    "forgery",
    ["untrusted-key", "untrusted-key-linked", "trusted-key-copied"],
)
async def test_a_forged_creation_does_not_record_a_minted_token(
    world: ApiWorld, client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture, forgery: str
) -> None:
    """Review r17, F1: a ``token:created`` row the runtime role inserted, on a chain of its own
    (an unknown key; or the node's own public key, copied: no genesis that key signed), made a
    minted global admin RECORDED: served, not logged, not counted. The event must count for
    nothing: the token is unrecorded (logged, counted), and the forged event is said."""
    key = b"\1" * 32
    if forgery == "trusted-key-copied":
        key = load_public_key(world.settings.signing_key_path)
    chain = f"attacker-{uuid.uuid4().hex[:8]}"
    raw, tid = _forged_creation(world, chain, key, linked=forgery != "untrusted-key")
    before, forged_before = tokens_unrecorded(), token_events_forged()
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            r = await client.get("/v1/tokens", headers=bearer(raw))
            assert r.status_code == 401 or tokens_unrecorded() == before + 1, (
                f"a token:created row the runtime role inserted (chain {chain!r}, no signature)"
                " made a minted global admin RECORDED: served, not logged, not counted"
            )
    said = [r for r in caplog.records if r.getMessage() == "api.token.unrecorded"]
    assert [getattr(r, "token_id", None) for r in said] == [tid]
    forged = [r for r in caplog.records if r.getMessage() == "api.token.forged_event"]
    assert [(getattr(r, "chain_id", None), getattr(r, "seq", None)) for r in forged] == [
        (chain, 1)
    ], "the forged event is said once"
    assert token_events_forged() == forged_before + 1
    assert raw not in caplog.text


async def test_a_creation_forged_on_a_live_trusted_chain_counts_for_nothing(
    pg_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The same forgery appended to the API's own chain (its trusted key, its signed genesis),
    right after the head and linked to it: the writer seals it as foreign at its next
    checkpoint, so no head its session signed covers it, and it is no creation."""
    with api_world(pg_url, tmp_path, seed=False) as world:
        transport = httpx.ASGITransport(app=world.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://kvgov.test") as client:
            made = await _create(client, world, role="auditor")  # the chain has a head
            chain = world.writer.chain_id
            with world.engine.connect() as conn:
                head = conn.execute(
                    sa.select(LedgerEvent.__table__)
                    .where(LedgerEvent.chain_id == chain)
                    .order_by(LedgerEvent.seq.desc())
                    .limit(1)
                ).one()
            raw, tid = _forged_creation(
                world, chain, b"", linked=True, seq=head.seq + 1, prev_hash=head.hash
            )
            await world.writer.write_checkpoint()  # seals what someone else appended
            before = tokens_unrecorded()
            with caplog.at_level(logging.WARNING):
                assert (await client.get("/v1/tokens", headers=bearer(raw))).status_code in (
                    200,
                    401,
                )
            assert tokens_unrecorded() == before + 1, (
                "a token:created appended to the API's own chain by someone else (sealed"
                " foreign by its writer) made a minted admin RECORDED"
            )
            forged = [r for r in caplog.records if r.getMessage() == "api.token.forged_event"]
            assert [getattr(r, "token_id", None) for r in forged] == [tid]
            # the honest token made before it is still recorded
            honest = await client.get("/v1/entries", headers=bearer(made["token"]))
            assert honest.status_code == 200
            assert tokens_unrecorded() == before + 1


async def test_an_unsigned_creation_counts_once_its_writer_signs(world: ApiWorld) -> None:
    """A creation its writer chained but has not signed over yet (a pod of the previous release,
    between two periodic checkpoints) is not vouched for, and is once the head above it is
    signed: an unproven event is asked again after the memo's retry time, a proven one never."""
    tid = str(uuid.uuid4())
    await world.writer.sink.append(
        Event(
            kind=EventKind.TOKEN_CREATED,
            tenant=None,
            principal="cli:old",
            attrs={"token_id": tid, "role": "auditor"},
        )
    )
    proofs = TokenEventProofs(retry_s=0)
    keys = world.ctx.ledger_keys
    with make_sessionmaker(world.engine)() as s:
        (row,) = s.execute(trail_query(tid)).all()
        assert not proofs.vouches(s, row, keys)
    await world.writer.write_checkpoint()
    with make_sessionmaker(world.engine)() as s:
        assert proofs.vouches(s, row, keys)
    # proven once: never asked again (no key lookup, no session use)
    assert proofs.vouches(None, row, lambda: pytest.fail("asked again"))  # type: ignore[arg-type]

"""``kvgov token create|list|revoke`` against a real Postgres ledger, end to end with the API."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import sqlalchemy as sa
import typer
from fastapi.testclient import TestClient
from sqlalchemy import select

from kvgov.cli import token as token_cli
from kvgov.config import Settings
from kvgov.db.engine import make_engine, upgrade
from kvgov.db.models import ApiToken, LedgerEvent
from kvgov.db.tokens import token_events_forged, tokens_unrecorded
from kvgov.ledger.chain import generate_signing_key_file
from kvgov.ledger.pseudonym import Pseudonymizer
from kvgov.proxy.api.auth import ApiContext
from tests.integration.test_api_support import WriterThread, bearer
from tests.integration.test_api_support import build_app as build_api

pytestmark = pytest.mark.postgres


@pytest.fixture
def env(pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    upgrade(pg_url)
    data = tmp_path / "kvgov"
    data.mkdir()
    generate_signing_key_file(data / "ledger-signing.key")
    monkeypatch.setenv("KVGOV_DATABASE_URL", pg_url)
    monkeypatch.setenv("KVGOV_DATA_DIR", str(data))
    monkeypatch.setenv("KVGOV_LEDGER__CHAIN_ID", "cli-test")
    yield pg_url


def _run(*args: str) -> tuple[int, str]:
    from typer.testing import CliRunner

    # the real command group on a root of its own (independent of the other groups' modules)
    app = typer.Typer()

    @app.callback()
    def _root() -> None: ...

    token_cli.register(app)
    result = CliRunner().invoke(app, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


@contextmanager
def _api(url: str, tmp_path: Path) -> Iterator[tuple[sa.Engine, ApiContext]]:
    """The API's context on the CLI's database, with a ledger writer of its own (``api-node``)."""
    engine = make_engine(url)
    writer = WriterThread(engine, "api-node")
    try:
        yield (
            engine,
            ApiContext(
                settings=Settings(data_dir=tmp_path / "kvgov"),
                engine=engine,
                sink=writer.sink,
                pseudonymizer=Pseudonymizer(secrets.token_bytes(32)),
                session_secret=secrets.token_bytes(32),
            ),
        )
    finally:
        writer.close()
        engine.dispose()


def test_create_list_revoke_and_use_the_token(env: str, tmp_path: Path):
    code, out = _run("token", "create", "--role", "auditor", "--tenant", "acme", "--name", "dash")
    assert code == 0, out
    token = next(line for line in out.splitlines() if line.startswith("kvgov_"))
    token_id = out.split("token id:")[1].split()[0]
    assert "not shown again" in out

    code, out = _run("token", "list", "--json")
    listed = json.loads(out)
    assert [(t["id"], t["role"], t["tenant"], t["active"]) for t in listed] == [
        (token_id, "auditor", "acme", True)
    ]
    assert token not in out

    with _api(env, tmp_path) as (engine, ctx):
        # the CLI runs its own event loop, so this test is synchronous: TestClient serves the
        # app from a thread of its own
        unrecorded, forged = tokens_unrecorded(), token_events_forged()
        with TestClient(build_api(ctx)) as client:
            assert client.get("/v1/stats", headers=bearer(token)).status_code == 200
            # the CLI's session closed with a signed head: its creation is vouched for
            assert (tokens_unrecorded(), token_events_forged()) == (unrecorded, forged)
            other = client.get("/v1/stats?tenant=globex", headers=bearer(token))
            assert other.status_code == 403

            code, out = _run("token", "revoke", token_id)
            assert code == 0 and f"revoked {token_id}" in out
            assert client.get("/v1/stats", headers=bearer(token)).status_code == 401

        with engine.connect() as conn:
            stored = conn.execute(select(ApiToken.token_hash)).scalars().all()
            kinds = conn.execute(
                select(LedgerEvent.kind, LedgerEvent.attrs).where(
                    LedgerEvent.chain_id == "cli-test"
                )
            ).all()
        assert token not in stored
        assert [k for k, _ in kinds] == ["token:created", "token:revoked"]
        assert all(a["token_id"] == token_id for _, a in kinds)

    code, out = _run("token", "list", "--active")
    assert code == 0 and "no tokens" in out


def test_bad_role_and_unknown_id_fail(env: str):
    code, out = _run("token", "create", "--role", "root")
    assert code == 2 and "unknown role" in out
    code, out = _run("token", "revoke", "00000000-0000-0000-0000-000000000000")
    assert code == 1 and "no token" in out


@pytest.mark.parametrize("tenant", ["", "bad tenant!", "acme\x1b[2K"])
def test_a_malformed_tenant_is_refused_not_widened(env: str, tenant: str):
    """r15 F4: ``--tenant "$TENANT"`` with an empty ``$TENANT`` made a token for every
    tenant (``"tenant": null``); a malformed one made a token scoped to a tenant that can
    never exist. Both exit 2 and create nothing, and the ledger records nothing."""
    code, out = _run("token", "create", "--role", "admin", "--tenant", tenant, "--json")
    assert code == 2, f"`--tenant {tenant!r}` made a token (exit {code}): {out}"
    assert "tenant" in out
    engine = make_engine(env)
    try:
        with engine.connect() as conn:
            assert conn.execute(select(ApiToken.id)).all() == []
            assert conn.execute(select(LedgerEvent.kind)).all() == []
    finally:
        engine.dispose()


def test_the_api_refuses_a_malformed_tenant(env: str, tmp_path: Path):
    code, out = _run("token", "create", "--role", "admin", "--json")
    assert code == 0, out
    admin = json.loads(out)["token"]
    with _api(env, tmp_path) as (engine, ctx):
        with TestClient(build_api(ctx)) as client:
            for tenant in ("", "bad tenant!", "acme\x1b[2K", "-acme"):
                body = {"role": "admin", "tenant": tenant}
                got = client.post("/v1/tokens", json=body, headers=bearer(admin))
                assert got.status_code == 422, f"POST /v1/tokens tenant {tenant!r}: {got.text}"
            ok = client.post(
                "/v1/tokens", json={"role": "auditor", "tenant": "acme"}, headers=bearer(admin)
            )
            assert ok.status_code == 201 and ok.json()["tenant"] == "acme", ok.text
        with engine.connect() as conn:
            tenants = conn.execute(select(ApiToken.tenant).order_by(ApiToken.created_at)).all()
        assert [t for (t,) in tenants] == [None, "acme"]


def test_the_repository_refuses_an_empty_tenant(env: str):
    from kvgov.db.engine import make_sessionmaker
    from kvgov.db.tokens import TokenRepository
    from kvgov.errors import InvalidInputError
    from kvgov.types import Role

    engine = make_engine(env)
    try:
        with make_sessionmaker(engine)() as session:
            with pytest.raises(InvalidInputError, match="tenant"):
                TokenRepository(session).create(Role.ADMIN, tenant="")
    finally:
        engine.dispose()

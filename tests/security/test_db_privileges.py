"""Attacks with the runtime database credentials: the ledger's guard cannot be switched off.

A sidecar (and the CLI) connect to Postgres as a runtime role. An attacker holding those
credentials (a compromised pod, a leaked Secret) tries to disable, drop or replace the
append-only triggers, truncate, update or delete the chained tables, or change the schema.
Each attempt must be refused by privileges (SQLSTATE 42501), not merely by a trigger that the
same role could switch off, and the evidence must be as it was afterwards.

Roles are cluster-wide and other test runs share the server: every role here has a unique name
and is dropped after its tests (``tests/pgroles.py``).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import psycopg
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from psycopg import errors as pg_errors

from kvgov.config import load_settings
from kvgov.db.engine import make_engine, migrate
from kvgov.ledger.events import EntryChange, Event
from kvgov.ledger.writer import LedgerWriter
from kvgov.types import EntryState, EventKind, Outcome
from kvgov.wire.client import WireClient
from kvgov.wire.messages import RequestContext
from tests.e2e.served import kvgov, serve, serve_env, stop
from tests.pgroles import RoleDatabase, role_database

pytestmark = pytest.mark.postgres

CHAINED = ("ledger_events", "checkpoints", "chains")


def _evidence(admin_dsn: str) -> dict[str, object]:
    """What an attack must not change: the chained rows and the guard's triggers."""
    with psycopg.connect(admin_dsn) as conn:
        events = conn.execute(
            "SELECT chain_id, seq, hash FROM ledger_events ORDER BY 1, 2"
        ).fetchall()
        checkpoints = conn.execute("SELECT chain_id, seq, head_hash FROM checkpoints").fetchall()
        chains = conn.execute("SELECT chain_id, public_key FROM chains ORDER BY 1").fetchall()
        triggers = conn.execute(
            "SELECT tgrelid::regclass::text, tgname, tgenabled FROM pg_trigger"
            " WHERE NOT tgisinternal ORDER BY 1, 2"
        ).fetchall()
        guard = conn.execute(
            "SELECT md5(prosrc) FROM pg_proc WHERE proname = 'kvgov_append_only'"
        ).fetchall()
    return {
        "events": events,
        "checkpoints": checkpoints,
        "chains": chains,
        "triggers": triggers,
        "guard": guard,
    }


async def _seed(url: str) -> None:
    """A chain with a few events (one with an erasable payload) and a signed checkpoint, written
    by the ledger writer as the runtime role: what a sidecar leaves behind."""
    engine = make_engine(url)
    writer = LedgerWriter(engine, chain_id="victim", signing_key=Ed25519PrivateKey.generate())
    try:
        await writer.start()
        for i in range(5):
            await writer.append(
                Event(
                    kind=EventKind.KV_PUT,
                    tenant="acme",
                    key_digest=f"{i:064x}",
                    outcome=Outcome.OK,
                    payload={"note": "erasable"} if i == 0 else None,
                    entry=EntryChange(key_digest=f"{i:064x}", state=EntryState.LIVE, tenant="acme"),
                )
            )
        assert await writer.write_checkpoint() is not None
    finally:
        await writer.close()
        engine.dispose()


@pytest.fixture(scope="module")
def deployment() -> Iterator[RoleDatabase]:
    """A ledger database deployed as documented (``kvgov db upgrade`` as the owner, granting
    the runtime role), then written to by the runtime role."""
    with role_database() as db:
        migrate(
            load_settings(
                database={
                    "url": db.runtime_url,
                    "migration_url": db.owner_url,
                    "runtime_role": db.runtime,
                }
            )
        )
        asyncio.run(_seed(db.runtime_url))
        yield db


ATTACKS = {
    "disable-all-triggers": "ALTER TABLE ledger_events DISABLE TRIGGER ALL",
    "disable-guard-then-rewrite": (
        "ALTER TABLE ledger_events DISABLE TRIGGER ledger_events_append_only;"
        " UPDATE ledger_events SET nbytes = 1"
    ),
    "disable-guard-on-checkpoints": "ALTER TABLE checkpoints DISABLE TRIGGER USER",
    "drop-trigger": "DROP TRIGGER ledger_events_append_only ON ledger_events",
    "drop-truncate-trigger": "DROP TRIGGER checkpoints_no_truncate ON checkpoints",
    "replace-guard-function": (
        "CREATE OR REPLACE FUNCTION kvgov_append_only() RETURNS trigger LANGUAGE plpgsql"
        " AS $$ BEGIN RETURN COALESCE(NEW, OLD); END; $$"
    ),
    "drop-guard-function": "DROP FUNCTION kvgov_append_only() CASCADE",
    "replication-role": "SET session_replication_role = replica",
    "truncate-events": "TRUNCATE ledger_events",
    "truncate-checkpoints": "TRUNCATE checkpoints CASCADE",
    "truncate-chains": "TRUNCATE chains CASCADE",
    "update-events": "UPDATE ledger_events SET nbytes = 1",
    "delete-events": "DELETE FROM ledger_events",
    "update-checkpoints": "UPDATE checkpoints SET head_hash = 'x'",
    "delete-checkpoints": "DELETE FROM checkpoints",
    "update-chains": "UPDATE chains SET public_key = public_key",
    "delete-chains": "DELETE FROM chains",
    "add-column": "ALTER TABLE ledger_events ADD COLUMN forged text",
    "drop-table": "DROP TABLE checkpoints CASCADE",
    "take-ownership": "ALTER TABLE ledger_events OWNER TO CURRENT_USER",
    "create-table": "CREATE TABLE kvgov_attack (i int)",
}


@pytest.mark.parametrize("statement", list(ATTACKS.values()), ids=list(ATTACKS))
def test_runtime_role_cannot_touch_the_evidence(deployment: RoleDatabase, statement: str) -> None:
    before = _evidence(deployment.admin_dsn)
    with psycopg.connect(deployment.dsn(deployment.runtime)) as conn:
        with pytest.raises(pg_errors.InsufficientPrivilege):
            conn.execute(statement)
        conn.rollback()
    assert _evidence(deployment.admin_dsn) == before


#: what would take an entry out of a purge that trusted its row (review r10, F4): moved to
#: another tenant, or re-keyed. Purge scope stands on the chained puts now; this is the
#: defence in depth (migration 0011's owner trigger, which the role cannot drop or disable)
ENTRY_EDITS = {
    "move-entry-to-another-tenant": "UPDATE cache_entries SET tenant = 'elsewhere'",
    "clear-entry-tenant": "UPDATE cache_entries SET tenant = NULL",
    "re-key-entry": "UPDATE cache_entries SET key_digest = md5(key_digest) || md5(key_digest)",
    "disable-entry-guard": "ALTER TABLE cache_entries DISABLE TRIGGER cache_entries_identity",
}


def _entries(admin_dsn: str) -> list[tuple[object, ...]]:
    with psycopg.connect(admin_dsn) as conn:
        return conn.execute("SELECT key_digest, tenant FROM cache_entries ORDER BY 1").fetchall()


@pytest.mark.parametrize("statement", list(ENTRY_EDITS.values()), ids=list(ENTRY_EDITS))
def test_runtime_role_cannot_move_or_re_key_a_cache_entry(
    deployment: RoleDatabase, statement: str
) -> None:
    before = _entries(deployment.admin_dsn)
    assert len(before) == 5 and {t for _, t in before} == {"acme"}
    with psycopg.connect(deployment.dsn(deployment.runtime)) as conn:
        with pytest.raises((pg_errors.InsufficientPrivilege, pg_errors.RaiseException)):
            conn.execute(statement)
        conn.rollback()
        # what the writer does to a row stays allowed (rolled back: the rows are shared)
        changed = conn.execute("UPDATE cache_entries SET tenant = tenant, state = 'expired'")
        assert changed.rowcount == 5
        conn.rollback()
    assert _entries(deployment.admin_dsn) == before


#: what would revive, widen or hijack a control-plane token whose row the API trusted (review
#: r15, F3): the row's identity, role, scope and revocation are fixed once written (migration
#: 0015's owner trigger); the chained ``token:revoked`` event stands behind the revocation anyway
TOKEN_EDITS = {
    "un-revoke": "UPDATE api_tokens SET revoked_at = NULL",
    "move-revocation": "UPDATE api_tokens SET revoked_at = revoked_at + interval '1 day'",
    "escalate-role": "UPDATE api_tokens SET role = 'admin'",
    "widen-tenant": "UPDATE api_tokens SET tenant = NULL",
    "move-tenant": "UPDATE api_tokens SET tenant = 'globex'",
    "swap-hash": "UPDATE api_tokens SET token_hash = md5(token_hash) || md5(token_hash)",
    "change-name": "UPDATE api_tokens SET name = 'ci-bot'",
    "change-id": "UPDATE api_tokens SET id = md5(id)",
    "backdate": "UPDATE api_tokens SET created_at = created_at - interval '1 year'",
    "disable-token-guard": "ALTER TABLE api_tokens DISABLE TRIGGER api_tokens_identity",
}


@pytest.fixture(scope="module")
def tokens(deployment: RoleDatabase) -> list[str]:
    """An acme auditor token (revoked) and a global admin token (active), made and revoked as
    the runtime role through the repository, as the sidecar's API does; their ids."""
    from sqlalchemy.orm import Session

    from kvgov.db.tokens import TokenRepository
    from kvgov.types import Role

    engine = make_engine(deployment.runtime_url)
    try:
        with Session(engine) as s:
            repo = TokenRepository(s)
            auditor, _ = repo.create(Role.AUDITOR, tenant="acme", name="acme-auditor")
            admin, _ = repo.create(Role.ADMIN, name="alice-admin")
            s.commit()
            repo.revoke(auditor.id)
            s.commit()
    finally:
        engine.dispose()
    return [auditor.id, admin.id]


def _token_rows(admin_dsn: str) -> list[tuple[object, ...]]:
    with psycopg.connect(admin_dsn) as conn:
        return conn.execute(
            "SELECT id, name, token_hash, role, tenant, created_at, revoked_at FROM api_tokens"
            " ORDER BY 1"
        ).fetchall()


@pytest.mark.parametrize("statement", list(TOKEN_EDITS.values()), ids=list(TOKEN_EDITS))
def test_runtime_role_cannot_revive_widen_or_swap_an_api_token(
    deployment: RoleDatabase, tokens: list[str], statement: str
) -> None:
    before = _token_rows(deployment.admin_dsn)
    assert len(before) == 2 and sum(r[6] is not None for r in before) == 1
    with psycopg.connect(deployment.dsn(deployment.runtime)) as conn:
        try:
            conn.execute(statement)
        except (pg_errors.InsufficientPrivilege, pg_errors.RaiseException):
            pass
        else:
            pytest.fail(f"the runtime role edited api_tokens: {statement!r} went through")
        conn.rollback()
        # what the API does to a row stays allowed (rolled back: the rows are shared): stamp
        # its last use, and revoke an active token
        assert conn.execute("UPDATE api_tokens SET last_used_at = now()").rowcount == 2
        revoked = conn.execute(
            "UPDATE api_tokens SET revoked_at = now() WHERE revoked_at IS NULL"
        ).rowcount
        assert revoked == 1
        # a statement naming every column with the values the row has changes nothing
        same = conn.execute(
            "UPDATE api_tokens SET id = id, name = name, token_hash = token_hash, role = role,"
            " tenant = tenant, created_at = created_at, revoked_at = revoked_at"
        ).rowcount
        assert same == 2
        conn.rollback()
    assert _token_rows(deployment.admin_dsn) == before


# -- the grants are sufficient: a production deployment that runs as the runtime role ----------

PASSWORD = "rt-pa55w0rd-never-logged"


def _ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stdout + result.stderr
    assert PASSWORD not in result.stdout + result.stderr
    return result.stdout


def _secret(path: Path, text: str) -> Path:
    path.write_text(text + "\n")
    path.chmod(0o600)
    return path


@pytest.mark.slow
def test_a_production_sidecar_and_the_cli_work_as_the_runtime_role() -> None:
    """The Kubernetes shape: a migration Job runs ``kvgov db upgrade`` with the owner's URL
    from a Secret file; the sidecar (production: it never migrates, and checks its role) and
    the operators' CLI use the runtime role's URL file. Puts, gets, an API token and its use,
    a key rotation, a purge, a user shred, a checkpoint and a full verify all work."""
    with role_database() as db:
        data_dir = Path(tempfile.mkdtemp(prefix="kvd-"))  # short: the Unix socket lives here
        try:
            _run_deployment(db, data_dir)
        finally:
            shutil.rmtree(data_dir, ignore_errors=True)


def _run_deployment(db: RoleDatabase, data_dir: Path) -> None:
    engine_token = f"engine-{uuid.uuid4().hex}"
    env = serve_env(
        "",
        data_dir,
        KVGOV_ENVIRONMENT="production",
        KVGOV_PURGE__NO_GPU_PREFIX_CACHE="true",  # no vLLM here
        KVGOV_DATABASE__URL_FILE=str(_secret(data_dir / "db-url", db.url(db.runtime, PASSWORD))),
        KVGOV_DATABASE__RUNTIME_ROLE=db.runtime,
        KVGOV_KEYS__KEK_PATH=str(data_dir / "kek.key"),
        KVGOV_DATAPLANE__ENGINE_TOKENS=json.dumps({engine_token: "engine-1"}),
        KVGOV_PURGE__POLL_INTERVAL_S="0.1",
        KVGOV_PURGE__JOB_TIMEOUT_S="60",
        KVGOV_KEYS__REVALIDATE_INTERVAL_S="0.5",
    )
    del env["KVGOV_DATABASE__URL"]
    job = env | {
        "KVGOV_DATABASE__MIGRATION_URL_FILE": str(
            _secret(data_dir / "migration-url", db.url(db.owner, PASSWORD))
        )
    }
    kek = base64.b64encode(os.urandom(32)).decode()  # provisioned on purpose, as production asks
    _secret(data_dir / "kek.key", f"# kvgov-kek 1 provisioned\nid: file:e2e\nkey: {kek}")
    out = _ok(kvgov(job, "db", "upgrade"))
    assert f"granted the runtime privileges to {db.runtime}" in out
    assert "(ready)" in _ok(kvgov(env, "init"))  # keys; the schema is current

    proc = serve(env)
    endpoint = f"unix://{env['KVGOV_DATAPLANE__UNIX_PATH']}"
    chunks = {(user, i): os.urandom(4096 + i) for user in ("alice", "bob") for i in range(4)}

    def key(user: str, i: int) -> str:
        return f"m@1@0@{i:x}@bfloat16@tenant%acme@user%{user}"

    try:
        with WireClient(endpoint, engine_id="engine-1", token=engine_token) as client:
            for (user, i), data in chunks.items():
                ctx = RequestContext(request_id=f"req-{user}", user=user, tenant="acme")
                assert client.put(key(user, i), data, ctx).ok
            for (user, i), data in chunks.items():
                ctx = RequestContext(request_id=f"read-{user}", user=user, tenant="acme")
                got = client.get(key(user, i), ctx)
                assert got is not None and got[0] == data

            # an API token made by the CLI, used against the sidecar's control plane
            made = json.loads(_ok(kvgov(env, "token", "create", "--role", "auditor", "--json")))
            api = f"http://127.0.0.1:{env['KVGOV_API__PORT']}"
            reply = httpx.get(
                f"{api}/v1/requests/req-alice/provenance",
                headers={"Authorization": f"Bearer {made['token']}"},
                timeout=30,
            )
            assert reply.status_code == 200, reply.text

            _ok(kvgov(env, "keys", "rotate", "--tenant", "acme"))
            # the engine's control channel is up for the purge (a holder without one is named
            # unreachable and the purge is incomplete)
            channel = client.control(lambda request: sorted(request.digests))
            try:
                assert channel.connected.wait(10)
                purged = json.loads(
                    _ok(
                        kvgov(
                            env, "purge", "--user", "alice", "--tenant", "acme", "--yes", "--json"
                        )
                    )
                )
            finally:
                channel.close()
            assert purged["state"] == "completed", purged
            assert purged["receipt"]["receipt"]["entries_purged"] == 4
            assert not any(client.exists(key("alice", i)) for i in range(4))

            _ok(kvgov(env, "keys", "shred", "--tenant", "acme", "--user", "bob", "--yes"))
            ctx = RequestContext(request_id="after-shred", user="bob", tenant="acme")
            deadline = time.monotonic() + 60
            while client.get(key("bob", 0), ctx) is not None:  # the sidecar revalidates its keys
                assert time.monotonic() < deadline, "a shredded key still opened data"
                time.sleep(0.2)
            _ok(kvgov(env, "audit", "checkpoint"))
    finally:
        code = stop(proc, grace_s=60)
    assert code == 0
    log = (data_dir / "serve.log").read_text()
    assert PASSWORD not in log
    _ok(kvgov(env, "audit", "verify"))
    with psycopg.connect(db.admin_dsn) as conn:
        signed = conn.execute("SELECT count(DISTINCT chain_id) FROM checkpoints").fetchone()
        owners = conn.execute(
            "SELECT DISTINCT tableowner FROM pg_tables WHERE schemaname = 'public'"
        ).fetchall()
    assert signed is not None and signed[0] >= 2  # the CLI's checkpoint and the sidecar's last
    assert owners == [(db.owner,)]

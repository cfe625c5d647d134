"""The runtime role's grants (``kvgov db upgrade``, ``kvgov db grants``) and the production
sidecar's check of its own database role, on the local Postgres with real roles."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from kvgov.config import Settings, load_settings
from kvgov.db.engine import head_revision, make_engine, migrate, upgrade
from kvgov.db.grants import RUNTIME_PRIVILEGES, RUNTIME_SEQUENCES, grant_statements
from kvgov.db.models import Base
from kvgov.db.roles import check_schema
from kvgov.errors import ConfigError, LedgerError, StartupError
from tests.e2e.served import kvgov
from tests.pgroles import RoleDatabase, role_database

pytestmark = pytest.mark.postgres


@pytest.fixture
def db() -> Iterator[RoleDatabase]:
    with role_database() as made:
        yield made


def _settings(db: RoleDatabase, url: str, **database: str) -> Settings:
    return load_settings(
        database={"url": url, "migration_url": db.owner_url, "runtime_role": db.runtime} | database
    )


def _privileges(db: RoleDatabase, table: str) -> set[str]:
    with psycopg.connect(db.admin_dsn) as conn:
        rows = conn.execute(
            "SELECT p FROM unnest(ARRAY['SELECT','INSERT','UPDATE','DELETE','TRUNCATE',"
            "'REFERENCES','TRIGGER']) AS p WHERE has_table_privilege(%s, %s, p)",
            (db.runtime, table),
        ).fetchall()
    return {r[0] for r in rows}


def test_the_grants_cover_every_table_and_sequence_and_nothing_else(db: RoleDatabase) -> None:
    migrate(_settings(db, db.runtime_url))
    assert set(RUNTIME_PRIVILEGES) == set(Base.metadata.tables) | {"alembic_version"}
    with psycopg.connect(db.admin_dsn) as conn:
        tables = {
            r[0]
            for r in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        }
        sequences = {
            r[0] for r in conn.execute("SELECT sequence_name FROM information_schema.sequences")
        }
    assert tables == set(RUNTIME_PRIVILEGES)
    assert sequences == set(RUNTIME_SEQUENCES)
    for table, privileges in RUNTIME_PRIVILEGES.items():
        assert _privileges(db, table) == set(privileges), table
    for chained in ("ledger_events", "checkpoints", "chains", "chain_seals"):
        assert _privileges(db, chained) == {"SELECT", "INSERT"}


def test_upgrade_again_narrows_a_wider_grant_back(db: RoleDatabase) -> None:
    settings = _settings(db, db.runtime_url)
    migrate(settings)
    with psycopg.connect(db.dsn(db.owner)) as conn:
        conn.execute(f'GRANT ALL ON ledger_events, data_keys TO "{db.runtime}"')
    assert _privileges(db, "ledger_events") >= {"UPDATE", "DELETE", "TRUNCATE"}
    assert migrate(settings) == []  # nothing to migrate; the grants are applied all the same
    assert _privileges(db, "ledger_events") == {"SELECT", "INSERT"}
    assert _privileges(db, "data_keys") == {"SELECT", "INSERT", "UPDATE"}


def test_grants_for_a_role_that_does_not_exist_change_nothing(db: RoleDatabase) -> None:
    settings = _settings(db, db.runtime_url, runtime_role="kvgov_no_such_role_x")
    with pytest.raises(ConfigError, match="does not exist"):
        migrate(settings)
    with psycopg.connect(db.admin_dsn) as conn:
        assert conn.execute("SELECT to_regclass('ledger_events')").fetchone() == (None,)


def test_kvgov_db_grants_prints_what_upgrade_applies(db: RoleDatabase, tmp_path: Path) -> None:
    upgrade(db.owner_url)  # migrated, no grants yet
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGOV_")}
    env |= {"KVGOV_DATA_DIR": str(tmp_path), "KVGOV_DATABASE__URL": db.runtime_url}
    printed = kvgov(env, "db", "grants", "--role", db.runtime)
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout.splitlines() == grant_statements(db.runtime)
    assert f'GRANT SELECT, INSERT ON TABLE "public"."ledger_events" TO "{db.runtime}";' in (
        printed.stdout
    )
    assert _privileges(db, "ledger_events") == set()  # printing changes nothing
    # a DBA runs it
    with psycopg.connect(db.admin_dsn, autocommit=True) as conn:
        conn.execute(printed.stdout)  # type: ignore[call-overload]
    for table, privileges in RUNTIME_PRIVILEGES.items():
        assert _privileges(db, table) == set(privileges), table
    # --apply as the migration role gives the same
    with psycopg.connect(db.admin_dsn, autocommit=True) as conn:
        conn.execute(f'REVOKE ALL ON ALL TABLES IN SCHEMA public FROM "{db.runtime}"')
    env |= {"KVGOV_DATABASE__MIGRATION_URL": db.owner_url}
    applied = kvgov(env, "db", "grants", "--role", db.runtime, "--apply")
    assert applied.returncode == 0, applied.stderr
    for table, privileges in RUNTIME_PRIVILEGES.items():
        assert _privileges(db, table) == set(privileges), table


def test_a_production_sidecar_accepts_only_a_runtime_role(
    db: RoleDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    def production(url: str, role: str = db.runtime) -> Settings:
        return load_settings(
            environment="production",
            database={"url": url, "runtime_role": role},
            keys={"kek_path": "/nonexistent/kek.key"},
            dataplane={"engine_tokens": {"t0ken": "engine-a"}},
            purge={"no_gpu_prefix_cache": True},
            tiers={"filesystem_max_bytes": 2 << 30},
        )

    upgrade(db.owner_url)  # migrated without grants: the runtime role can do nothing yet
    with pytest.raises(StartupError, match=r"lacks ledger_events SELECT, ledger_events INSERT"):
        check_schema(production(db.runtime_url))
    migrate(_settings(db, db.runtime_url))
    assert check_schema(production(db.runtime_url)) == head_revision()

    with pytest.raises(StartupError, match=r"owns .*ledger_events") as err:
        check_schema(production(db.owner_url))  # the sidecar given the owner's credentials
    assert "append-only guard" in err.value.message
    assert "kvgov db grants" in err.value.diagnostics()
    with pytest.raises(StartupError, match="is a superuser"):
        check_schema(production(db.url("postgres")))
    with pytest.raises(StartupError, match=r"is not database\.runtime_role 'kvgov_other'"):
        check_schema(production(db.runtime_url, role="kvgov_other"))

    # a login role that is a member of the runtime role (e.g. one made per lease by Vault)
    # inherits its privileges, and passes
    login = f"{db.runtime}_login"
    with psycopg.connect(db.admin_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE ROLE "{login}" LOGIN IN ROLE "{db.runtime}"')
    try:
        assert check_schema(production(db.url(login))) == head_revision()
        # a schema a later release migrated: the sidecar starts, and says so
        with psycopg.connect(db.admin_dsn, autocommit=True) as conn:
            conn.execute("UPDATE alembic_version SET version_num = '9999'")
        with caplog.at_level(logging.WARNING, logger="kvgov.db.roles"):
            assert check_schema(production(db.url(login))) == "9999"
        assert any(r.getMessage() == "ledger.schema.newer" for r in caplog.records)
    finally:
        with psycopg.connect(db.admin_dsn, autocommit=True) as conn:
            conn.execute(f'DROP ROLE "{login}"')


def test_a_runtime_role_cannot_migrate(db: RoleDatabase) -> None:
    """``kvgov db upgrade`` run with only the runtime credentials fails and changes nothing:
    the runtime role cannot create the schema (PostgreSQL 15+ gives PUBLIC no CREATE)."""
    settings = load_settings(database={"url": db.runtime_url})
    with pytest.raises(LedgerError, match="permission denied"):
        migrate(settings)
    engine = make_engine(db.owner_url)
    try:
        with engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT to_regclass('chains')").scalar() is None
    finally:
        engine.dispose()

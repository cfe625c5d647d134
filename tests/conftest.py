"""Shared fixtures: real PostgreSQL and Redis on loopback, fresh state per test.

Every Postgres test gets a database of its own, created from scratch and dropped afterwards,
so no test depends on what another run left behind.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

PG_ADMIN_DSN = os.environ.get("KVGOV_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("KVGOV_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def _pg_admin_execute(sql: str) -> None:
    """Run one statement on the admin database, closing the connection whatever happens."""
    import psycopg

    conn = psycopg.connect(PG_ADMIN_DSN, autocommit=True)
    try:
        conn.execute(sql)
    finally:
        conn.close()


def create_pg_database() -> tuple[str, str]:
    """Create an empty database; return (name, SQLAlchemy URL)."""
    name = f"kvgov_test_{uuid.uuid4().hex[:12]}"
    _pg_admin_execute(f'CREATE DATABASE "{name}"')
    base = PG_ADMIN_DSN.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://", 1)
    return name, f"{base}/{name}"


def drop_pg_database(name: str) -> None:
    _pg_admin_execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A fresh, empty Postgres database for this test (SQLAlchemy URL, psycopg 3 driver)."""
    name, url = create_pg_database()
    try:
        yield url
    finally:
        drop_pg_database(name)


@pytest.fixture
def private_umask() -> Iterator[None]:
    """Files the test writes are its user's alone (umask 077), as a mounted Secret's are
    others' to read: kvgov refuses an engine-tokens, URL or OPA-token file others may read
    (:func:`kvgov.privatefs.read_guarded_file`). A module of tests that write such files with
    ``write_text`` uses it (``pytest.mark.usefixtures("private_umask")``)."""
    old = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(old)


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """A fresh SQLite database file for this test."""
    return f"sqlite:///{(tmp_path / 'ledger.db').as_posix()}"


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """Runs the test once on SQLite and once on a fresh Postgres database."""
    if request.param == "sqlite":
        yield f"sqlite:///{(tmp_path / 'ledger.db').as_posix()}"
        return
    name, url = create_pg_database()
    try:
        yield url
    finally:
        drop_pg_database(name)


@pytest.fixture
def redis_url() -> Iterator[str]:
    """A Redis URL plus a unique key prefix is what tests should use: see ``redis_prefix``."""
    yield REDIS_URL


@pytest.fixture
def redis_prefix() -> Iterator[str]:
    """A unique key prefix; every key under it is deleted after the test."""
    prefix = f"kvgov-test:{uuid.uuid4().hex[:10]}:"
    yield prefix
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    try:
        keys = list(client.scan_iter(match=prefix + "*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()

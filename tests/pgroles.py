"""A ledger database with its two roles, for tests: an owner (migrations) and a runtime role
(sidecars, CLI), as ``docs/database.md`` sets them up.

Roles are cluster-wide and other runs share the server: each name carries a random suffix, and
the database and both roles are dropped afterwards, whatever happened.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from tests.conftest import PG_ADMIN_DSN, _pg_admin_execute

_HOST = PG_ADMIN_DSN.split("@", 1)[1].rsplit("/", 1)[0]


@dataclass(frozen=True)
class RoleDatabase:
    database: str
    owner: str
    runtime: str

    def url(self, role: str, password: str = "") -> str:
        """A SQLAlchemy URL for ``role`` (the local server trusts loopback: any password)."""
        auth = f"{role}:{password}" if password else role
        return f"postgresql+psycopg://{auth}@{_HOST}/{self.database}"

    def dsn(self, role: str) -> str:
        """A libpq connection string for ``role`` (psycopg)."""
        return f"postgresql://{role}@{_HOST}/{self.database}"

    @property
    def owner_url(self) -> str:
        return self.url(self.owner)

    @property
    def runtime_url(self) -> str:
        return self.url(self.runtime)

    @property
    def admin_dsn(self) -> str:
        return self.dsn("postgres")


@contextmanager
def role_database() -> Iterator[RoleDatabase]:
    """An empty database owned by a new owner role, and a new runtime role with no privilege."""
    suffix = uuid.uuid4().hex[:12]
    db = RoleDatabase(f"kvgov_test_{suffix}", f"kvgov_own_{suffix}", f"kvgov_rt_{suffix}")
    try:
        _pg_admin_execute(f'CREATE ROLE "{db.owner}" LOGIN')
        _pg_admin_execute(f'CREATE ROLE "{db.runtime}" LOGIN')
        _pg_admin_execute(f'CREATE DATABASE "{db.database}" OWNER "{db.owner}"')
        yield db
    finally:
        _pg_admin_execute(f'DROP DATABASE IF EXISTS "{db.database}" WITH (FORCE)')
        _pg_admin_execute(f'DROP ROLE IF EXISTS "{db.runtime}"')
        _pg_admin_execute(f'DROP ROLE IF EXISTS "{db.owner}"')

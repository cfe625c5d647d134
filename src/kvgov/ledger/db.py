"""Database plumbing for the ledger: engines, sessions, column types and migrations.

``make_engine`` tunes each backend (SQLite: WAL, foreign keys, busy timeout; Postgres through
psycopg 3). ``upgrade`` runs the Alembic migrations under ``migrations/`` programmatically (the
checkout's, or the copy a wheel installs under ``<prefix>/share/kvgov``); it is what ``kvgov db
upgrade``, ``kvgov init``, ``kvgov serve`` and the tests call.

Column types shared by the models live here too: :class:`UTCDateTime` stores UTC and always
returns timezone-aware datetimes (SQLite has no time zones), :class:`StrEnumType` stores a
``StrEnum`` as its string value, and :data:`JSONType` is JSONB on Postgres and JSON elsewhere.
"""

from __future__ import annotations

import os
import sysconfig
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Any

from sqlalchemy import JSON, DateTime, Engine, String, create_engine, event
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.engine import Dialect, make_url
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import NullPool
from sqlalchemy.types import TypeDecorator

from kvgov.errors import ConfigError, LedgerError, StartupError

#: SQLite waits this long for a lock before failing with "database is locked"
SQLITE_BUSY_TIMEOUT_MS = 10_000

#: JSONB on Postgres (indexable, compact), JSON text elsewhere; Python None is SQL NULL
JSONType = JSON(none_as_null=True).with_variant(JSONB(none_as_null=True), "postgresql")
#: JSON kept as written (also on Postgres): for values that are hashed and re-verified
ExactJSON = JSON(none_as_null=True)


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware timestamp stored in UTC; naive datetimes are refused on write."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None or value.utcoffset() is None:
            raise ValueError("naive datetime given to the ledger; use an aware UTC datetime")
        value = value.astimezone(UTC)
        if dialect.name == "sqlite":
            return value.replace(tzinfo=None)
        return value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


class StrEnumType(TypeDecorator[StrEnum]):
    """A ``StrEnum`` stored as its value in a VARCHAR; unknown values are refused on write.

    No CHECK constraint: later releases may add members without a migration.
    """

    impl = String
    cache_ok = True

    def __init__(self, enum_cls: type[StrEnum], length: int = 32) -> None:
        super().__init__(length=length)
        self.enum_cls = enum_cls

    def process_bind_param(self, value: Any, dialect: Dialect) -> str | None:
        if value is None:
            return None
        return self.enum_cls(value).value

    def process_result_value(self, value: Any, dialect: Dialect) -> StrEnum | None:
        if value is None:
            return None
        return self.enum_cls(value)


def is_sqlite(url: str) -> bool:
    return url.startswith("sqlite")


def make_engine(url: str, *, pool_size: int = 5, echo: bool = False) -> Engine:
    """An Engine tuned for the ledger. Creates the SQLite file (0600) and its directory (0700)
    if needed."""
    if is_sqlite(url):
        _ensure_sqlite_dir(url)
        engine = create_engine(
            url,
            echo=echo,
            connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000},
            poolclass=NullPool if ":memory:" not in url else None,
        )
        event.listen(engine, "connect", _sqlite_on_connect)
        event.listen(engine, "begin", _sqlite_on_begin)
        return engine
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url[len("postgresql://") :]
    if not url.startswith("postgresql+psycopg"):
        raise ConfigError(
            f"unsupported database URL scheme: {url.split(':', 1)[0]}",
            hint="use sqlite:///path/ledger.db or postgresql+psycopg://user@host/db",
        )
    return create_engine(
        url,
        echo=echo,
        pool_size=pool_size,
        max_overflow=pool_size,
        pool_pre_ping=True,
    )


def _ensure_sqlite_dir(url: str) -> None:
    """Create the database file's directory (0700) and the file itself (0600) if missing.

    SQLite creates ``-wal`` and ``-shm`` with the database file's permissions, so they are
    private too. An existing directory or file is left as the operator made it."""
    database = make_url(url).database
    if not database or database == ":memory:" or database.startswith("file:"):
        return
    path = Path(database)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    os.close(fd)  # an empty file is an empty SQLite database


def _sqlite_on_connect(dbapi_conn: Any, _record: Any) -> None:
    # pysqlite's own transaction handling is switched off; "begin" below issues BEGIN itself so
    # that SAVEPOINTs and the writer's batches behave as on Postgres.
    dbapi_conn.isolation_level = None
    cur = dbapi_conn.cursor()
    try:
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cur.execute("PRAGMA synchronous=FULL")
    finally:
        cur.close()


#: execution option asking SQLite for a write lock at BEGIN (the ledger writer's batches), so a
#: writer waits on the busy timeout instead of failing when it later upgrades a read lock
SQLITE_BEGIN_IMMEDIATE = "kvgov_sqlite_begin_immediate"


def _sqlite_on_begin(conn: Any) -> None:
    immediate = conn.get_execution_options().get(SQLITE_BEGIN_IMMEDIATE, False)
    conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    """Sessions that never expire loaded objects on commit (the edge commits, then reads)."""
    return sessionmaker(bind=engine, expire_on_commit=False)


def utcnow() -> datetime:
    return datetime.now(UTC)


# -- migrations -------------------------------------------------------------------------------


def migrations_dir() -> Path:
    """The ``migrations/`` folder: the source checkout's (beside ``alembic.ini`` at the project
    root), else the one an installed wheel put under ``<prefix>/share/kvgov`` (its data files,
    see ``pyproject.toml``)."""
    candidates = [Path(__file__).resolve().parents[3] / "migrations"]
    schemes = [sysconfig.get_default_scheme(), sysconfig.get_preferred_scheme("user")]
    for scheme in dict.fromkeys(schemes):
        candidates.append(
            Path(sysconfig.get_path("data", scheme)) / "share" / "kvgov" / "migrations"
        )
    for path in candidates:
        if (path / "env.py").is_file() and (path / "versions").is_dir():
            return path
    raise StartupError(
        f"ledger migrations not found (looked in {', '.join(str(p) for p in candidates)})",
        hint="run kvgov from a source checkout or install its wheel (it ships share/kvgov)",
    )


def alembic_config(url: str) -> Any:
    """An Alembic ``Config`` for ``url`` that does not need ``alembic.ini`` to be found."""
    import sys

    from alembic.config import Config

    # Alembic's own default is the sys.stdout of the moment alembic.config was first imported
    # (a default argument): whatever replaced it then (a test's capture, a redirect) may be
    # closed by now. Today's stdout it is.
    cfg = Config(stdout=sys.stdout)
    cfg.set_main_option("script_location", migrations_dir().as_posix())
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    cfg.attributes["kvgov_configure_logging"] = False
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    """Bring the database at ``url`` to ``revision`` (creating every table on an empty one)."""
    from alembic import command

    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            cfg = alembic_config(url)
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, revision)
    except LedgerError:
        raise
    except Exception as exc:
        raise LedgerError(f"database migration failed: {type(exc).__name__}: {exc}") from exc
    finally:
        engine.dispose()


def current_revision(url: str) -> str | None:
    """The Alembic revision the database is at (None when never migrated)."""
    from alembic.runtime.migration import MigrationContext

    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()

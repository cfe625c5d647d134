"""Database plumbing for the ledger: engines, sessions, column types and migrations.

``make_engine`` tunes each backend (SQLite: WAL, foreign keys, busy timeout; Postgres through
psycopg 3). ``upgrade`` runs the Alembic migrations under ``migrations/`` programmatically (the
checkout's, or the copy a wheel installs under ``<prefix>/share/kvgov``) under a migration lock,
so that many processes may run it at once; ``migrate`` is ``kvgov db upgrade`` (the owner
role's URL, then the runtime role's grants), which a development sidecar and ``kvgov init`` also
run. A production sidecar never migrates (``kvgov.db.roles.check_schema``).

Column types shared by the models live here too: :class:`UTCDateTime` stores UTC and always
returns timezone-aware datetimes (SQLite has no time zones), :class:`StrEnumType` stores a
``StrEnum`` as its string value, and :data:`JSONType` is JSONB on Postgres and JSON elsewhere.
Every engine reads and writes JSON through :mod:`kvgov.boundedjson`: a stored value nested
too deep or too large (which the runtime role can insert) decodes to a fixed marker, never to a
``RecursionError`` (review r14, F1/F2).
"""

from __future__ import annotations

import contextlib
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import JSON, Connection, DateTime, Engine, String, create_engine, event
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.engine import Dialect, make_url
from sqlalchemy.exc import ArgumentError, OperationalError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import NullPool
from sqlalchemy.types import TypeDecorator

from kvgov.boundedjson import bounded_dumps, bounded_loads
from kvgov.config import Settings, mask_url
from kvgov.errors import ConfigError, KvgovError, LedgerError, StartupError
from kvgov.logging import get_logger

if TYPE_CHECKING:
    from alembic.config import Config as AlembicConfig
    from alembic.script import ScriptDirectory
    from sqlalchemy.engine.interfaces import DBAPIConnection

log = get_logger(__name__)

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

    def process_bind_param(self, value: str | None, dialect: Dialect) -> str | None:
        if value is None:
            return None
        return self.enum_cls(value).value

    def process_result_value(self, value: str | None, dialect: Dialect) -> StrEnum | None:
        if value is None:
            return None
        return self.enum_cls(value)


def is_sqlite(url: str) -> bool:
    return url.startswith("sqlite")


def make_engine(
    url: str,
    *,
    pool_size: int = 5,
    max_overflow: int | None = None,
    pool_timeout: float = 30.0,
    echo: bool = False,
) -> Engine:
    """An Engine tuned for the ledger. Creates the SQLite file (0600) and its directory (0700)
    if needed. PostgreSQL: ``pool_size`` connections kept, ``max_overflow`` more on demand
    (None: as many again), a checkout waiting ``pool_timeout`` seconds at most."""
    if is_sqlite(url):
        _ensure_sqlite_dir(url)
        engine = create_engine(
            url,
            echo=echo,
            connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000},
            poolclass=NullPool if ":memory:" not in url else None,
            json_serializer=bounded_dumps,
            json_deserializer=bounded_loads,
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
    engine = create_engine(
        url,
        echo=echo,
        pool_size=pool_size,
        max_overflow=pool_size if max_overflow is None else max_overflow,
        pool_timeout=pool_timeout,
        pool_pre_ping=True,
        # psycopg decodes json/jsonb itself: SQLAlchemy sets these on the engine's own
        # adapters map (set_json_loads/dumps), which every connection of it, text() queries
        # and the ledger's raw-connection fast path included, decodes with
        json_serializer=bounded_dumps,
        json_deserializer=bounded_loads,
    )
    # and timestamps past Python's range (``infinity``, year 10000) read as its edges
    event.listen(engine, "connect", _postgres_on_connect)
    return engine


def _postgres_on_connect(dbapi_conn: DBAPIConnection, _record: object) -> None:
    from kvgov.db import boundedtime  # psycopg: only where Postgres is used

    boundedtime.install(dbapi_conn)  # type: ignore[arg-type]


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


def _sqlite_on_connect(dbapi_conn: DBAPIConnection, _record: object) -> None:
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


def _sqlite_on_begin(conn: Connection) -> None:
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


def alembic_config(url: str) -> AlembicConfig:
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


#: the ``pg_advisory_lock`` key (session level, one 64-bit key) every :func:`upgrade` holds
#: while it reads the schema's revision, migrates and grants: the bytes ``kvgovmig``
MIGRATION_LOCK_KEY = int.from_bytes(b"kvgovmig", "big")


@dataclass(frozen=True, slots=True)
class MigrationLimits:
    """Postgres timeouts of an upgrade, in seconds; 0 means no limit."""

    #: how long a migration statement waits for a table lock (``lock_timeout``)
    lock_timeout_s: float = 10.0
    #: how long one migration statement may run (``statement_timeout``)
    statement_timeout_s: float = 600.0
    #: how long to wait for the migration lock another process holds
    wait_s: float = 900.0

    @classmethod
    def of(cls, settings: Settings) -> MigrationLimits:
        db = settings.database
        return cls(
            db.migration_lock_timeout_s, db.migration_statement_timeout_s, db.migration_wait_s
        )


def upgrade(
    url: str,
    revision: str = "head",
    *,
    limits: MigrationLimits | None = None,
    runtime_role: str = "",
) -> list[str]:
    """Bring the database at ``url`` to ``revision`` (creating every table on an empty one);
    return the revisions this call applied, oldest first (empty: nothing to do).

    Safe to run from many processes at once: the revision is read only once the migration lock
    is held (:func:`migration_connection`), so one process applies each revision and the others
    wait, then find nothing to do. Migrations run in one transaction; then, in it and still
    under the lock, ``runtime_role`` (if any, Postgres) gets the runtime privileges
    (:func:`kvgov.db.grants.apply_grants`)."""
    from alembic import command

    try:
        with migration_connection(url, limits) as conn:
            before = revision_of(conn)
            cfg = alembic_config(url)
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, revision)
            after = revision_of(conn)
            if runtime_role and conn.dialect.name == "postgresql":
                from kvgov.db.grants import apply_grants

                apply_grants(conn, runtime_role)
    except KvgovError:
        raise
    except Exception as exc:
        raise _migration_error(exc, url) from exc
    applied = _revisions_between(before, after)
    for script in applied:
        log.info("ledger.migration.applied", extra={"revision": script.revision, "doc": script.doc})
    return [script.revision for script in applied]


@contextlib.contextmanager
def migration_connection(url: str, limits: MigrationLimits | None = None) -> Iterator[Connection]:
    """A connection to ``url`` in a transaction (committed when the block ends) that holds the
    migration lock: on Postgres the session-level advisory lock :data:`MIGRATION_LOCK_KEY`,
    waited for up to ``limits.wait_s``, with ``lock_timeout`` and ``statement_timeout`` set
    from ``limits`` once it is held; on SQLite the database's write lock (BEGIN IMMEDIATE)."""
    limits = limits or MigrationLimits()
    engine = make_engine(url, pool_size=1)
    try:
        with engine.connect() as conn:
            postgres = conn.dialect.name == "postgresql"
            if postgres:
                _take_migration_lock(conn, limits)
            else:
                _wait_for_sqlite_write_lock(conn, limits)
            try:
                with _begin(conn, limits):
                    yield conn
            finally:
                if postgres:
                    _release_migration_lock(conn)
    finally:
        engine.dispose()


#: SQLite's largest busy timeout (a C int of milliseconds, ~24 days): "no limit"
_SQLITE_FOREVER_MS = 2**31 - 1


def _wait_for_sqlite_write_lock(conn: Connection, limits: MigrationLimits) -> None:
    """SQLite: the migration's BEGIN IMMEDIATE waits for another upgrade's write lock up to
    ``limits.wait_s`` (0: no limit), as Postgres waits for the advisory lock; the runtime busy
    timeout (:data:`SQLITE_BUSY_TIMEOUT_MS`) is a writer's, far shorter than one upgrade."""
    wait_ms = round(limits.wait_s * 1000) if limits.wait_s > 0 else _SQLITE_FOREVER_MS
    raw = conn.connection.dbapi_connection  # outside any transaction: no autobegin
    assert raw is not None
    cur = raw.cursor()
    try:
        cur.execute(f"PRAGMA busy_timeout={min(wait_ms, _SQLITE_FOREVER_MS)}")
    finally:
        cur.close()
    conn.execution_options(**{SQLITE_BEGIN_IMMEDIATE: True})


@contextlib.contextmanager
def _begin(conn: Connection, limits: MigrationLimits) -> Iterator[None]:
    """The migration's transaction; on SQLite, a write lock still held by another after
    ``limits.wait_s`` fails as Postgres's advisory wait does."""
    try:
        transaction = conn.begin()
    except OperationalError as exc:
        if conn.dialect.name != "sqlite" or "locked" not in str(exc.orig):
            raise
        raise LedgerError(
            f"another kvgov db upgrade (or a writer) held the database's write lock for over"
            f" {limits.wait_s:g} s",
            hint="it may still be running; retry, or raise database.migration_wait_s",
        ) from exc
    with transaction:
        yield


_SET_TIMEOUTS = (
    "SELECT set_config('lock_timeout', %s, false), set_config('statement_timeout', %s, false)"
)


def _take_migration_lock(conn: Connection, limits: MigrationLimits) -> None:
    """Wait for the migration lock (``lock_timeout`` bounds the wait), then set the session's
    timeouts for the migration itself."""
    conn.exec_driver_sql(_SET_TIMEOUTS, (f"{limits.wait_s * 1000:.0f}", "0"))
    try:
        conn.exec_driver_sql(f"SELECT pg_advisory_lock({MIGRATION_LOCK_KEY})")
    except OperationalError as exc:
        raise LedgerError(
            f"another kvgov db upgrade held the migration lock for over {limits.wait_s:g} s",
            hint="it may still be running; retry, or raise database.migration_wait_s",
        ) from exc
    timeouts = (limits.lock_timeout_s, limits.statement_timeout_s)
    conn.exec_driver_sql(_SET_TIMEOUTS, tuple(f"{t * 1000:.0f}" for t in timeouts))
    conn.commit()  # the session lock outlives the transaction; the migrations get their own


def _release_migration_lock(conn: Connection) -> None:
    # closing the connection (engine.dispose) releases it too: a failure here changes nothing
    with contextlib.suppress(SQLAlchemyError):
        conn.rollback()
        conn.exec_driver_sql(f"SELECT pg_advisory_unlock({MIGRATION_LOCK_KEY})")
        conn.commit()


def error_reason(exc: Exception, url: str) -> str:
    """The first line of the driver's message, with the URL's password (if any) masked."""
    text = str(getattr(exc, "orig", None) or exc)
    reason = text.splitlines()[0] if text else ""
    with contextlib.suppress(ArgumentError, ValueError):
        password = make_url(url).password
        if password:
            reason = reason.replace(str(password), "***")
    return reason


def _migration_error(exc: Exception, url: str) -> LedgerError:
    reason = error_reason(exc, url)
    hint = None
    if "lock timeout" in reason or "statement timeout" in reason:
        hint = (
            "nothing was changed: a sidecar's transaction held a table past"
            " database.migration_lock_timeout_s, or a statement ran past"
            " database.migration_statement_timeout_s; run it again (or raise the limit)"
        )
    return LedgerError(
        f"database migration of {redact_url(url)} failed: {type(exc).__name__}: {reason}",
        hint=hint,
    )


def redact_url(url: str) -> str:
    """A database URL fit for a message: the password masked, and so is a query parameter
    that is one (``?password=...``, which libpq and SQLAlchemy accept too)."""
    try:
        return mask_url(make_url(url).render_as_string(hide_password=True))
    except (ArgumentError, ValueError):  # not a URL SQLAlchemy reads: say nothing of it
        return "<database URL>"


def revision_of(conn: Connection) -> str | None:
    """The revision the connection's database is at (None when never migrated)."""
    from alembic.runtime.migration import MigrationContext

    return MigrationContext.configure(conn).get_current_revision()


def _script_directory() -> ScriptDirectory:
    from alembic.script import ScriptDirectory

    return ScriptDirectory(migrations_dir().as_posix())


def _revisions_between(before: str | None, after: str | None) -> list[Any]:
    """The scripts after ``before`` up to ``after``, oldest first."""
    if after is None or after == before:
        return []
    scripts = _script_directory().iterate_revisions(after, before or "base")
    return list(reversed(list(scripts)))


def head_revision() -> str:
    """The newest revision of the migrations this kvgov ships."""
    return str(_script_directory().get_current_head())


def known_revisions() -> set[str]:
    """Every revision of the migrations this kvgov ships."""
    return {script.revision for script in _script_directory().walk_revisions()}


def migrate(settings: Settings, revision: str = "head") -> list[str]:
    """``kvgov db upgrade``: migrate as the owner role (``database.migration_url``), then grant
    ``database.runtime_role`` its privileges; the revisions applied (see :func:`upgrade`).
    A production owner's URL that a mesh opt-out admits without verified TLS is logged at
    WARNING first (``database.tls.unverified``)."""
    for found in settings.unverified_transports("migration"):
        log.warning(
            "database.tls.unverified",
            extra={"setting": found.setting, "hosts": found.hosts, "opt_out": found.opt_out},
        )
    return upgrade(
        settings.migration_database_url,
        revision,
        limits=MigrationLimits.of(settings),
        runtime_role=settings.database.runtime_role,
    )


def current_revision(url: str) -> str | None:
    """The Alembic revision the database is at (None when never migrated)."""
    engine = make_engine(url, pool_size=1)
    try:
        with engine.connect() as conn:
            return revision_of(conn)
    finally:
        engine.dispose()

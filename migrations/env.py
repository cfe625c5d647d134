"""Alembic environment for the kvgov ledger.

The database URL comes from, in order: a connection handed in by ``kvgov.db.engine.upgrade``
(``config.attributes["connection"]``), ``sqlalchemy.url`` set on the Config, then kvgov's
Settings (``KVGOV_DATABASE_URL``, the embedded SQLite default). SQLite runs in batch mode so
later migrations can alter tables there.
"""

from __future__ import annotations

from logging.config import fileConfig

from alembic import context
from sqlalchemy import Connection

from kvgov.db.engine import make_engine
from kvgov.db.models import Base

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    url = config.get_main_option("sqlalchemy.url")
    if url:
        return url
    from kvgov.config import load_settings

    return load_settings().database_url


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
        compare_server_default=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_offline() -> None:
    context.configure(
        url=_url(),
        target_metadata=target_metadata,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
    )
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = make_engine(_url())
    try:
        with engine.connect() as conn:
            _run(conn)
            conn.commit()
    finally:
        engine.dispose()


if config.config_file_name is not None and config.attributes.get("kvgov_configure_logging", True):
    fileConfig(config.config_file_name, disable_existing_loggers=False)

if context.is_offline_mode():
    run_offline()
else:
    run_online()

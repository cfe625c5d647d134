"""Alembic environment for the kvgov ledger.

The database URL comes from, in order: a connection handed in by ``kvgov.db.engine.upgrade``
(``config.attributes["connection"]``), ``sqlalchemy.url`` set on the Config, then kvgov's
Settings (``KVGOV_DATABASE_URL``, the embedded SQLite default). SQLite runs in batch mode so
later migrations can alter tables there (batch mode recreates a table from its reflection, which
leaves out expression indexes and triggers: such a migration of ``ledger_events`` must create
``ix_ledger_events_purge_id`` again, one of ``data_keys`` the tombstone triggers of 0010, one
of ``cache_entries`` the identity trigger of 0011, and one of ``checkpoints`` 0002's append-only
guard, as 0013 does; and one of ``ledger_events``, ``checkpoints`` or ``chain_seals`` the hash
format trigger of 0014; and one of ``ledger_events`` ``ix_ledger_events_token_id``, one of
``api_tokens`` the identity triggers of 0015).
"""

from __future__ import annotations

import warnings
from logging.config import fileConfig

from alembic import context
from sqlalchemy import Connection

from kvgov.db.engine import make_engine
from kvgov.db.models import Base
from kvgov.db.purge_index import PURGE_ID_INDEX
from kvgov.db.token_index import TOKEN_ID_INDEX

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
    with context.begin_transaction(), warnings.catch_warnings():
        if connection.dialect.name == "sqlite":
            _unreflectable_on_sqlite()
        context.run_migrations()


def _unreflectable_on_sqlite() -> None:
    """SQLite cannot reflect an expression index (SQLAlchemy skips it, and `alembic check`
    then skips the model's, each with a warning): the purge id index (migration 0009) and the
    token id index (0015) are not compared there. Their tests read them back through the query
    plan instead."""
    for index in (PURGE_ID_INDEX, TOKEN_ID_INDEX):
        for message in (
            rf"Skipped unsupported reflection of expression-based index {index}$",
            rf"autogenerate skipping metadata-specified expression-based index '{index}'",
        ):
            warnings.filterwarnings("ignore", message=message)


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

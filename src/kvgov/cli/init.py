"""``kvgov init``: create the data directory, key files and the ledger schema.

Idempotent: existing key files are never overwritten (every pseudonym, checkpoint and wrapped
data key depends on them); running it again only fills in what is missing. In development it
migrates the ledger (as ``kvgov db upgrade`` does); in production migrations are a step of their
own, so it only says whether a sidecar could start on the database.
"""

from __future__ import annotations

import typer

from kvgov.cli._common import echo, settings
from kvgov.config import Settings
from kvgov.types import Environment


def register(app: typer.Typer) -> None:
    @app.command("init")
    def init_cmd(
        ctx: typer.Context,
        skip_db: bool = typer.Option(False, "--skip-db", help="Leave the database alone."),
    ) -> None:
        """Create the data dir, signing key, pseudonym key, KEK file and the ledger schema."""
        from kvgov.db.engine import current_revision, migrate
        from kvgov.keys.kek import generate_kek_file
        from kvgov.ledger.chain import generate_signing_key_file
        from kvgov.ledger.pseudonym import generate_pseudonym_key_file

        s = settings(ctx)
        s.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        created = generate_signing_key_file(s.signing_key_path)
        echo(f"signing key    {s.signing_key_path} ({'created' if created else 'kept'})")
        if s.environment is not Environment.DEVELOPMENT and not skip_db:
            _refuse_second_pseudonym_key(s)
        created = generate_pseudonym_key_file(s.pseudonym_key_path)
        echo(f"pseudonym key  {s.pseudonym_key_path} ({'created' if created else 'kept'})")
        existed = s.kek_path.exists()
        generate_kek_file(s.kek_path, exist_ok=True)
        echo(f"KEK            {s.kek_path} ({'kept' if existed else 'created'})")
        if skip_db:
            return
        if s.environment is Environment.DEVELOPMENT:
            migrate(s)
            echo(f"database       revision {current_revision(s.database_url)}")
            return
        # production: migrations are their own step (kvgov db upgrade as the owner role); say
        # whether a sidecar could start on this database
        from kvgov.db.roles import check_schema
        from kvgov.errors import StartupError

        try:
            echo(f"database       revision {check_schema(s)} (ready)")
        except StartupError as exc:
            echo(f"database       not ready: {exc.diagnostics()}")


def _refuse_second_pseudonym_key(s: Settings) -> None:
    """Production: a ledger that already pins the fleet's pseudonym key gets no new one from
    this host (a pod using it would record pseudonyms no purge can name); a key file already
    here must be the pinned one. A ledger that cannot be read is left to the sidecar's start,
    which compares the key with the pin before it records anyone."""
    from sqlalchemy.exc import SQLAlchemyError

    from kvgov.db.engine import make_engine
    from kvgov.errors import ConfigError
    from kvgov.ledger.keypin import MISMATCH_HINT, key_file_id, pinned_key_id

    engine = make_engine(s.database_url, pool_size=1)
    try:
        pinned = pinned_key_id(engine)
    except SQLAlchemyError:
        return
    finally:
        engine.dispose()
    if pinned is None:
        return
    if not s.pseudonym_key_path.exists():
        raise ConfigError(
            "ledger.pseudonym_key_path: no pseudonym key here, and the ledger database is"
            " already pinned to the fleet's: kvgov init will not create another one",
            hint="mount the fleet's pseudonym key at ledger.pseudonym_key_path (docs/ledger.md,"
            " 'Pseudonym key pin')",
        )
    if key_file_id(s.pseudonym_key_path) != pinned:
        raise ConfigError(
            "ledger.pseudonym_key_path holds a different pseudonym key than the one this ledger"
            " database is pinned to",
            hint=MISMATCH_HINT,
        )

"""``kvgov init``: create the data directory, key files and the ledger schema.

Idempotent: existing key files are never overwritten (every pseudonym, checkpoint and wrapped
data key depends on them); running it again only fills in what is missing.
"""

from __future__ import annotations

import typer

from kvgov.cli._common import echo, settings


def register(app: typer.Typer) -> None:
    @app.command("init")
    def init_cmd(
        ctx: typer.Context,
        skip_db: bool = typer.Option(False, "--skip-db", help="Do not migrate the database."),
    ) -> None:
        """Create the data dir, signing key, pseudonym key, KEK file and the ledger schema."""
        from kvgov.keys.kek import generate_kek_file
        from kvgov.ledger.chain import generate_signing_key_file
        from kvgov.ledger.db import current_revision, upgrade
        from kvgov.ledger.pseudonym import generate_pseudonym_key_file

        s = settings(ctx)
        s.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        created = generate_signing_key_file(s.signing_key_path)
        echo(f"signing key    {s.signing_key_path} ({'created' if created else 'kept'})")
        created = generate_pseudonym_key_file(s.pseudonym_key_path)
        echo(f"pseudonym key  {s.pseudonym_key_path} ({'created' if created else 'kept'})")
        existed = s.kek_path.exists()
        generate_kek_file(s.kek_path, exist_ok=True)
        echo(f"KEK            {s.kek_path} ({'kept' if existed else 'created'})")
        if not skip_db:
            upgrade(s.database_url)
            echo(f"database       revision {current_revision(s.database_url)}")

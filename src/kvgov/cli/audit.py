"""``kvgov audit``: sign chain heads and re-verify the whole ledger.

``audit verify`` exits 0 when every chain and checkpoint verifies and 1 otherwise, printing
the first bad position of each broken chain (``--json`` for the full report).
"""

from __future__ import annotations

from pathlib import Path

import typer

from kvgov.cli._common import EXIT_FAILED, echo, emit_json, settings


def register(app: typer.Typer) -> None:
    group = typer.Typer(help="Ledger integrity.", no_args_is_help=True)

    @group.command("checkpoint")
    def checkpoint_cmd(
        ctx: typer.Context,
        chain: list[str] | None = typer.Option(
            None, "--chain", help="Chain to sign (default: every chain of this signing key)."
        ),
        note: bool = typer.Option(False, "--note", help="Print each checkpoint's signed note."),
    ) -> None:
        """Sign the current head of this node's chains."""
        from kvgov.ledger.chain import load_signing_key
        from kvgov.ledger.checkpoint import chains_of_key, write_checkpoint
        from kvgov.ledger.db import make_engine

        s = settings(ctx)
        key = load_signing_key(s.signing_key_path)
        engine = make_engine(s.database_url)
        try:
            chains = chain or chains_of_key(engine, key)
            if not chains:
                echo("no chain belongs to this signing key yet")
            for chain_id in chains:
                info = write_checkpoint(engine, chain_id, key)
                if info is None:
                    echo(f"{chain_id}: head already signed (or chain empty)")
                    continue
                echo(f"{chain_id}: signed seq {info.seq} head {info.head_hash}")
                if note:
                    echo(info.note())
        finally:
            engine.dispose()

    @group.command("verify")
    def verify_cmd(
        ctx: typer.Context,
        as_json: bool = typer.Option(False, "--json", help="Print the full report as JSON."),
        trust_key: list[Path] | None = typer.Option(
            None,
            "--trust-key",
            help="PEM key (public or private) chains must be signed with; repeatable.",
        ),
    ) -> None:
        """Recompute every chain and check every checkpoint. Exit 1 on any problem."""
        from kvgov.ledger.chain import load_public_key
        from kvgov.ledger.db import make_engine
        from kvgov.ledger.verify import verify

        s = settings(ctx)
        trusted = {load_public_key(p) for p in trust_key} if trust_key else None
        engine = make_engine(s.database_url)
        try:
            report = verify(engine, trusted_keys=trusted)
        finally:
            engine.dispose()
        if as_json:
            emit_json(report.to_dict())
        else:
            for c in report.chains:
                first = c.first_bad
                if first is None:
                    echo(
                        f"ok     {c.chain_id}: {c.events} events, head {c.head_seq}, "
                        f"{c.checkpoints} checkpoints (key {c.key_fingerprint})"
                    )
                else:
                    echo(f"BROKEN {c.chain_id}: {first.problem} at seq {first.seq}: {first.detail}")
            if not report.chains:
                echo("ledger is empty")
        if not report.ok:
            raise typer.Exit(EXIT_FAILED)

    app.add_typer(group, name="audit")

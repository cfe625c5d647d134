"""``kvgov audit``: sign chain heads, re-verify the whole ledger, read the local journal.

``audit verify`` exits 0 when every chain, checkpoint and chain seal verifies against the
trusted keys (:mod:`kvgov.ledger.trust`, :mod:`kvgov.ledger.seals`) and 1 otherwise, printing
the first bad position of each broken chain (``--json`` for the full report). ``audit
public-key`` prints the key to distribute.
"""

from __future__ import annotations

from pathlib import Path

import typer

from kvgov.cli._common import EXIT_FAILED, EXIT_USAGE, echo, emit_json, fail, settings, shown

#: ``kvgov.ledger.seals.DEFAULT_MAX_UNSIGNED_AGE`` in seconds (not imported: the CLI loads the
#: ledger lazily)
DEFAULT_MAX_UNSIGNED_AGE_S = 3600.0


def register(app: typer.Typer) -> None:
    group = typer.Typer(help="Ledger integrity.", no_args_is_help=True)

    @group.command("checkpoint")
    def checkpoint_cmd(
        ctx: typer.Context,
        chain: list[str] | None = typer.Option(
            None, "--chain", help="Chain to sign (default: every chain of this signing key)."
        ),
        note: bool = typer.Option(False, "--note", help="Print each checkpoint's signed note."),
        adopt: bool = typer.Option(
            False,
            "--adopt",
            help="First sign the genesis of each --chain that has none (a chain registered "
            "before chain seals, its writer gone): only after inspecting its events, since "
            "anyone with the runtime database role can register a chain under this key.",
        ),
    ) -> None:
        """Sign the current head of this node's chains (never a chain without a signed genesis
        or with events appended after its writer closed it: exit 1)."""
        from kvgov.db.engine import make_engine
        from kvgov.errors import LedgerError
        from kvgov.ledger.chain import load_signing_key
        from kvgov.ledger.checkpoint import chains_of_key, write_checkpoint
        from kvgov.ledger.seals import sign_genesis

        if adopt and not chain:
            raise fail("kvgov: --adopt needs the --chain to vouch for", EXIT_USAGE)
        s = settings(ctx)
        key = load_signing_key(s.signing_key_path)
        engine = make_engine(s.database_url)
        refused = False
        try:
            chains = chain or chains_of_key(engine, key)
            if not chains:
                echo("no chain belongs to this signing key yet")
            for chain_id in chains:
                try:
                    if adopt and sign_genesis(engine, chain_id, key):
                        echo(f"{shown(chain_id)}: genesis signed")
                    info = write_checkpoint(engine, chain_id, key)
                except LedgerError as exc:
                    echo(f"{shown(chain_id)}: NOT signed: {shown(exc.diagnostics())}")
                    refused = True
                    continue
                if info is None:
                    echo(f"{shown(chain_id)}: head already signed (or chain empty)")
                    continue
                echo(f"{shown(chain_id)}: signed seq {info.seq} head {shown(info.head_hash)}")
                if note:
                    echo(info.note())
        finally:
            engine.dispose()
        if refused:
            raise typer.Exit(EXIT_FAILED)

    @group.command("verify")
    def verify_cmd(
        ctx: typer.Context,
        as_json: bool = typer.Option(False, "--json", help="Print the full report as JSON."),
        trust_key: list[Path] | None = typer.Option(
            None,
            "--trust-key",
            help="PEM key (public or private) chains may also be signed with; repeatable "
            "(added to this node's own key and ledger.trusted_keys).",
        ),
        require_signed: bool = typer.Option(
            False,
            "--require-signed",
            help="Also fail when a chain has events no signed head covers yet.",
        ),
        max_unsigned_age: float = typer.Option(
            DEFAULT_MAX_UNSIGNED_AGE_S,
            "--max-unsigned-age",
            min=0.0,
            help="Fail a chain whose events have been unsigned (after its last checkpoint or "
            "writer seal) for longer than this many seconds; 0: no bound.",
        ),
    ) -> None:
        """Recompute every chain and check every checkpoint and seal against the trusted keys
        (never the keys stored in the database). Exit 1 on any problem: also a chain no key
        holder vouched for, events appended after a writer closed its chain, or an unsigned
        tail older than --max-unsigned-age."""
        from datetime import timedelta

        from kvgov.db.engine import make_engine
        from kvgov.ledger.chain import load_public_key
        from kvgov.ledger.trust import trusted_keys, verify_trusted
        from kvgov.ledger.verify import Finding, Problem

        s = settings(ctx)
        keys = trusted_keys(s, extra=[load_public_key(p) for p in trust_key or []])
        engine = make_engine(s.database_url)
        bound = timedelta(seconds=max_unsigned_age) if max_unsigned_age > 0 else None
        try:
            report = verify_trusted(engine, keys, max_unsigned_age=bound)
        finally:
            engine.dispose()
        if require_signed:
            for c in report.chains:
                if c.unsigned_events and c.ok:
                    c.findings.append(
                        Finding(
                            Problem.UNSIGNED,
                            c.head_seq - c.unsigned_events + 1,
                            f"{c.unsigned_events} events after the last signed head are unsigned",
                        )
                    )
        if as_json:
            emit_json(report.to_dict())
        else:
            for c in report.chains:
                first = c.first_bad
                if first is None:
                    unsigned = f", {c.unsigned_events} unsigned" if c.unsigned_events else ""
                    state = ", closed" if c.closed else ""
                    legacy = ", legacy genesis" if c.genesis == "legacy" else ""
                    echo(
                        f"ok     {shown(c.chain_id)}: {c.events} events, head {c.head_seq}, "
                        f"{c.checkpoints} checkpoints{unsigned}{state}{legacy} "
                        f"(key {shown(c.key_fingerprint)})"
                    )
                else:
                    echo(
                        f"BROKEN {shown(c.chain_id)}: {first.problem} at seq {first.seq}: "
                        f"{shown(first.detail)}"
                    )
                    # every other finding too: a junk row first must not hide tampering after it
                    for other in sorted(c.findings, key=lambda f: f.seq):
                        if other is not first:
                            echo(
                                f"       {shown(c.chain_id)}: also {other.problem} at seq "
                                f"{other.seq}: {shown(other.detail)}"
                            )
            for problem in report.problems:
                echo(f"BROKEN ledger: {shown(problem)}")
            if not report.chains and not report.problems:
                echo("ledger is empty")
            echo(f"trusted keys: {shown(', '.join(report.trusted or []) or 'none')}")
        if not report.ok:
            raise typer.Exit(EXIT_FAILED)

    @group.command("public-key")
    def public_key_cmd(
        ctx: typer.Context,
        pem: bool = typer.Option(False, "--pem", help="Print a PEM public key instead."),
    ) -> None:
        """Print this node's checkpoint verification key, for the other nodes'
        ``ledger.trusted_keys`` (it is public: share it, never the signing key)."""
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        from kvgov.ledger.chain import load_public_key
        from kvgov.ledger.trust import format_public_key

        s = settings(ctx)
        if not s.signing_key_path.exists():
            raise fail(
                f"no signing key at {s.signing_key_path}: run `kvgov init` (or start the "
                "sidecar) first, or set ledger.signing_key_path",
                EXIT_USAGE,
            )
        raw = load_public_key(s.signing_key_path)
        if pem:
            text = (
                Ed25519PublicKey.from_public_bytes(raw)
                .public_bytes(
                    serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
                )
                .decode("ascii")
            )
            typer.echo(text, nl=False)
        else:
            echo(format_public_key(raw))

    @group.command("journal")
    def journal_cmd(
        ctx: typer.Context,
        directory: Path | None = typer.Option(
            None, "--dir", help="Journal directory (default: ledger.journal_dir)."
        ),
        as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    ) -> None:
        """Show the local ledger journal (read-only): its chain, segments, damage, and how
        many records the database does not hold yet. Exit 1 if a start would refuse it."""
        from sqlalchemy import select

        from kvgov.db.engine import make_engine
        from kvgov.db.models import JournalMark
        from kvgov.ledger.journal import inspect_journal

        s = settings(ctx)
        where = directory or s.journal_path
        if not where.is_dir():
            echo(f"no ledger journal at {where}")
            return
        report = inspect_journal(where)
        mark: int | None = None
        if report.chain_id is not None:
            engine = make_engine(s.database_url)
            try:
                with engine.connect() as conn:
                    mark = conn.execute(
                        select(JournalMark.applied_upto).where(
                            JournalMark.chain_id == report.chain_id
                        )
                    ).scalar()
            finally:
                engine.dispose()
        unapplied = [p for p in report.records if mark is None or p > mark]
        if as_json:
            emit_json({**report.to_dict(), "mark": mark, "unapplied": len(unapplied)})
        else:
            state = "in use by a running sidecar" if report.in_use else "not in use"
            # repr: quoted, controls escaped
            echo(f"journal {report.directory}: chain {report.chain_id!r}, {state}")
            for seg in report.segments:
                span = f"records {seg.first}-{seg.last}" if seg.records else "no records"
                line = f"  {seg.name}: {span} ({seg.records}), {seg.nbytes} bytes"
                echo(line + (f"; DAMAGED: {seg.damage}" if seg.damage else ""))
            if not report.segments:
                echo("  empty: the database holds every journaled event")
            echo(f"database mark: {mark}; records after it: {len(unapplied)}")
            if report.blocks_start:
                echo("a sidecar start would refuse this journal: see docs/ledger.md")
        if report.blocks_start:
            raise typer.Exit(EXIT_FAILED)

    app.add_typer(group, name="audit")

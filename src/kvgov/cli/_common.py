"""What every CLI command shares: the settings from ``--config``, output helpers, exit codes.

Exit codes: 0 success; 1 the command ran and found a failure (integrity broken, purge
incomplete, tests failed); 2 bad usage or configuration; 3 an unexpected kvgov error.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from kvgov.config import Settings, load_settings

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from kvgov.ledger.events import Event

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_ERROR = 3


@dataclass
class CliState:
    config_file: Path | None = None
    _settings: Settings | None = None

    @property
    def settings(self) -> Settings:
        if self._settings is None:
            self._settings = load_settings(self.config_file)
        return self._settings


def state(ctx: typer.Context) -> CliState:
    obj = ctx.find_root().obj
    if not isinstance(obj, CliState):
        obj = CliState()
        ctx.find_root().obj = obj
    return obj


def settings(ctx: typer.Context) -> Settings:
    return state(ctx).settings


def emit_json(data: object) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def echo(message: str) -> None:
    typer.echo(message)


def fail(message: str, code: int = EXIT_FAILED) -> typer.Exit:
    typer.echo(message, err=True)
    return typer.Exit(code)


async def append_events(s: Settings, engine: Engine, *events: Event) -> None:
    """Append ``events`` to this node's chain and wait until they are durable."""
    from kvgov.ledger.chain import load_signing_key
    from kvgov.ledger.writer import LedgerWriter

    # the node's own chain, beside its sidecar: a sidecar starting meanwhile ends this
    # session, which then re-opens in the very transaction that writes (never sealed foreign);
    # a neighbour session: killed before its close, it explains rows for its lease at most
    writer = LedgerWriter(
        engine,
        chain_id=s.chain_id,
        signing_key=load_signing_key(s.signing_key_path),
        every_transaction=True,
        lease_s=s.ledger.neighbour_session_max_s,
    )
    await writer.start()
    try:
        for event in events:
            await writer.append(event)
    finally:
        await writer.close(checkpoint=True)  # sign the head: `audit verify` trusts it

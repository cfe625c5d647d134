"""What every CLI command shares: the settings from ``--config``, output helpers, exit codes.

Exit codes: 0 success; 1 the command ran and found a failure (integrity broken, purge
incomplete, tests failed); 2 bad usage or configuration; 3 an unexpected kvgov error.

Text from the database is the runtime role's to write (``chains``, ``api_tokens``, ``tenants``,
``purge_steps`` ...: :data:`kvgov.db.grants.RUNTIME_PRIVILEGES`), so a human-readable line
never carries it raw: :func:`shown` escapes every control character, DEL and the bidi
controls in such a field, and :func:`echo` and :func:`fail` escape whatever control
characters other than newline and tab reach them anyway. Otherwise a chain id holding
``\r\x1b[1A\x1b[2K`` erases ``kvgov audit verify``'s ``BROKEN`` line on an operator's
terminal (click strips CSI only when the output is not a TTY). ``--json`` output is safe as
it is: :func:`json.dumps` escapes every non-ASCII and control character.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
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


def _escapes(codes: Iterable[int]) -> dict[int, str]:
    named = {0x09: "\\t", 0x0A: "\\n", 0x0D: "\\r"}
    return {c: named.get(c) or (f"\\x{c:02x}" if c <= 0xFF else f"\\u{c:04x}") for c in codes}


#: what a terminal acts on rather than shows: C0, DEL, C1, the bidi embeddings, overrides,
#: isolates and marks (they reorder what follows: "Trojan Source"), line/paragraph separators
_CONTROLS = _escapes(
    [
        *range(0x20),
        *range(0x7F, 0xA0),
        0x061C,
        0x200E,
        0x200F,
        *range(0x202A, 0x202F),
        *range(0x2066, 0x206A),
        0x2028,
        0x2029,
    ]
)
#: :func:`shown`: also the backslash, so an escape is never confused with text that looks
#: like one
_FIELD = str.maketrans({**_CONTROLS, ord("\\"): "\\\\"})
#: :func:`echo`'s backstop: the lines it is given may be several (newline, tab kept)
_LINES = str.maketrans({c: e for c, e in _CONTROLS.items() if chr(c) not in "\n\t"})


def shown(value: object) -> str:
    """``value`` as text safe to print on a terminal: control characters (newline and tab
    included), DEL and bidi controls as visible escapes (``\\r``, ``\\x1b``, ``\\u202e``). For every
    string from the database, a ledger row, a file or a peer that a human-readable line
    shows."""
    return str(value).translate(_FIELD)


def emit_json(data: object) -> None:
    # ensure_ascii (the default): every control and non-ASCII character is a \uNNNN escape
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def echo(message: str, *, err: bool = False) -> None:
    """Print a line; control characters other than newline and tab are escaped (a field that
    missed :func:`shown` still cannot drive the terminal)."""
    typer.echo(message.translate(_LINES), err=err)


def fail(message: str, code: int = EXIT_FAILED) -> typer.Exit:
    echo(message, err=True)
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

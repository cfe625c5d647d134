"""Attack: terminal control sequences in database strings the CLI prints (r15 F5).

The runtime role may INSERT into ``chains``, ``api_tokens`` and ``tenants``
(:data:`kvgov.db.grants.RUNTIME_PRIVILEGES`). A row whose text holds ``\\r``, CSI sequences
(cursor up, erase line, conceal) or bidi overrides, printed as it is, redraws an operator's
terminal: ``kvgov audit verify``'s ``BROKEN`` line for a tampered chain is erased and an
``ok`` line drawn in its place. The CLI must print such strings escaped, visibly.

``CliRunner(...).invoke(..., color=True)`` matters: without it click strips ANSI CSI from
output that is not a TTY, so the test would pass on the unfixed code.
"""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from kvgov.cli.main import build_app
from kvgov.db.engine import utcnow
from kvgov.db.models import ApiToken, Chain, Tenant, table
from kvgov.types import Role
from tests.security import test_chain_forgery as forgery
from tests.security.doors import ProdDatabase
from tests.security.test_chain_forgery import _cli_env, _write

pytestmark = pytest.mark.postgres

# the node's writer, the runtime role's engine and the CLI's settings of the chain-forgery
# attacks (its fixture, imported so pytest finds it here)
runtime = forgery.runtime


#: moves up over the line before, erases it, draws a fake "ok" line, conceals the rest
REDRAW = (
    "zz\r\x1b[1A\x1b[2K\x1b[1A\x1b[2Kok     node-a: 2 events, head 2, 1 checkpoints"
    "\n\x1b[8m\u202e\x9b"
)
#: what each of those control characters must look like instead
VISIBLE = ("\\r", "\\x1b[1A", "\\x1b[2K", "\\n", "\\x1b[8m", "\\u202e", "\\x9b")
CONTROLS = {"\x1b", "\r", "\x9b", "\u202e", "\x07"}


def _cli(env: dict[str, str], *args: str) -> tuple[int, str]:
    # color=True: the operator's terminal (click passes CSI through to a TTY)
    result = CliRunner().invoke(build_app(), list(args), env=env, color=True)
    return result.exit_code, result.output


def _assert_escaped(out: str, command: str) -> None:
    found = sorted(repr(c) for c in CONTROLS if c in out)
    assert not found, (
        f"kvgov {command} wrote a database string with terminal control characters {found}: {out!r}"
    )
    # no line is the attacker's fake one: the "\n" inside the string is escaped too
    assert not any(line.endswith("1 checkpoints") for line in out.splitlines()), out
    for mark in VISIBLE:
        assert mark in out, f"kvgov {command} hid the control sequence {mark}: {out!r}"


def test_audit_verify_escapes_a_chain_id_that_redraws_the_terminal(
    prod_db: ProdDatabase, runtime: sa.Engine, tmp_path: Path
) -> None:
    asyncio.run(_write(prod_db.url, "node-a", 2))
    with runtime.begin() as conn:
        pub = conn.execute(sa.select(table(Chain).c.public_key)).scalar_one()
        conn.execute(
            table(Chain).insert().values(chain_id=REDRAW, public_key=pub, created_at=utcnow())
        )
    code, out = _cli(_cli_env(prod_db, tmp_path), "audit", "verify")
    assert code == 1, out
    _assert_escaped(out, "audit verify")
    assert "BROKEN zz\\r\\x1b[1A" in out


def test_token_and_tenant_lists_escape_rows_the_runtime_role_wrote(
    prod_db: ProdDatabase, runtime: sa.Engine, tmp_path: Path
) -> None:
    with runtime.begin() as conn:
        conn.execute(
            table(ApiToken)
            .insert()
            .values(
                id=str(uuid.uuid4()),
                name=REDRAW[:128],
                token_hash=hashlib.sha256(b"x").hexdigest(),
                role=Role.ADMIN,
                tenant="acme\x1b[2K\x07",
                created_at=utcnow(),
            )
        )
        conn.execute(table(Tenant).insert().values(id=REDRAW, created_at=utcnow()))
    env = _cli_env(prod_db, tmp_path)
    code, out = _cli(env, "token", "list")
    assert code == 0, out
    _assert_escaped(out, "token list")
    assert "acme\\x1b[2K\\x07" in out
    code, out = _cli(env, "tenant", "list")
    assert code == 0, out
    _assert_escaped(out, "tenant list")


def test_shown_and_the_json_output_leave_no_control_character(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from kvgov.cli._common import emit_json, shown

    nasty = "".join(map(chr, [*range(0x20), *range(0x7F, 0xA0)])) + "\u061c\u200e\u200f"
    nasty += "".join(map(chr, [*range(0x202A, 0x202F), *range(0x2066, 0x206A), 0x2028, 0x2029]))
    for text in (shown(nasty), shown(REDRAW)):
        assert text.isprintable(), repr(text)
    assert shown("a\\x1b") == "a\\\\x1b"  # a backslash in the data never reads as an escape
    assert shown("acme é ü") == "acme é ü"  # printable text stays as it is
    emit_json({"chain_id": nasty + REDRAW})
    out = capsys.readouterr().out
    assert out.isascii() and out.replace("\n", "").isprintable(), repr(out)

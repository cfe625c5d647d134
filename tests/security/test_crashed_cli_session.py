"""A ``kvgov token``/``kvgov tenant`` command killed beside a live sidecar explained forged rows
for ever.

Attack (``/work`` review of b23ae01, "Crashed CLI session"): a CLI command writing to the
serving sidecar's chain opens a non-exclusive signed session of the chain's key, appends and
closes it. Killed before its close (OOM, ``kill -9``, a lost SSH session), its open stayed
open-ended: the live writer's foreign watch took EVERY later row it did not write as that
session's, so rows the runtime role appended afterwards (a ``kv:get`` naming any request, a
``user:data:purged``, a ``purge:step`` that completes a purge receipt) were never sealed
foreign; the writer's next checkpoint signed over them, ``audit verify`` passed them and the
purge receipt counted them. The attacker needs only the runtime database role and a crashed
command (no key): ``tests/security/test_fleet_signing_key.py`` is the other door, with a key.

Now the command's session is a *neighbour* session: its id signs a lease (``n<seconds>-<hex>``,
``ledger.neighbour_session_max_s``, default 300 s), and an open with no close of its own holds
open-ended only until that lease ends; from then on it holds only what a seal signed within the
lease proves was on the chain (:func:`kvgov.ledger.seals.span_of`, the one rule the writer's
watch, ``audit verify``, ``kvgov audit checkpoint`` and the purge receipt all use). Rows
appended after the lease are sealed foreign by the live writer. A running command renews its
session (close and re-open) once half its lease has passed, so honest commands still verify.

Time is moved with :class:`Clock` (the ledger's signing, judging and verifying clocks), never by
sleeping. Postgres tests connect as the runtime role a production sidecar uses; SQLite as
whoever can write the file.
"""

from __future__ import annotations

import asyncio
import secrets
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kvgov.config import Settings
from kvgov.db.engine import make_engine
from kvgov.errors import LedgerError
from kvgov.ledger.chain import public_key_bytes
from kvgov.ledger.checkpoint import write_checkpoint
from kvgov.ledger.events import Event
from kvgov.ledger.seals import read_seals
from kvgov.ledger.trust import verify_trusted
from kvgov.ledger.verify import ChainReport
from kvgov.ledger.writer import LedgerWriter
from kvgov.ledger.writing.replay import register_chain
from kvgov.types import EventKind
from tests.integration.test_purge_service import CHAIN, Env
from tests.security import test_foreign_append as foreign
from tests.security.test_chain_forgery import FRAMED, NODE_KEY, PEM, TRUSTED, _put
from tests.security.test_foreign_append import (
    Ledger,
    _append_forged,
    _forged_receipt,
    _seals,
    _writer,
)

# the fixtures: the ledger (Postgres as the runtime role, and SQLite), the purge worlds
ledger = foreign.ledger
env = foreign.env
sqlite_env = foreign.sqlite_env
runtime_role = foreign.runtime_role

#: the chain's key, which the seals read back are checked against
NODE_PUBLIC = public_key_bytes(NODE_KEY)
#: the default lease of a CLI command's session (``ledger.neighbour_session_max_s``)
LEASE_S = 300
#: how long after the command was killed the attacker strikes: well past its lease
LATER = timedelta(minutes=10)


class Clock:
    """The ledger's clocks (seals and checkpoints signed, the writer's watch, ``read_standing``,
    ``audit verify``) at real time plus :attr:`offset`: a test moves time on instead of
    sleeping."""

    MODULES = (
        "kvgov.ledger.seals.store",
        "kvgov.ledger.seals.sessions",
        "kvgov.ledger.writing.foreign",
        "kvgov.ledger.checkpoint",
        "kvgov.ledger.verify",
    )

    def __init__(self) -> None:
        self.offset = timedelta(0)

    def now(self) -> datetime:
        return datetime.now(UTC) + self.offset

    def advance(self, by: timedelta) -> None:
        self.offset += by


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    found = Clock()
    for module in Clock.MODULES:
        monkeypatch.setattr(f"{module}.utcnow", found.now, raising=False)
    return found


def _cli_session(lease_s: int = LEASE_S) -> str:
    """A CLI command's session id: what ``new_session(lease_s)`` makes (``n<lease>-<hex>``)."""
    return f"n{lease_s}-{secrets.token_hex(12)}"


def _killed_cli_command(engine: sa.Engine, chain_id: str, key: Ed25519PrivateKey = NODE_KEY) -> str:
    """A ``kvgov token`` command beside the live sidecar: its signed non-exclusive open on the
    chain, then ``kill -9`` before its close (no row of its own, no close, ever). The key is
    not used again: the attacker holds only the runtime role."""
    session = _cli_session()
    register_chain(
        engine,
        chain_id,
        public_key_bytes(key),
        description=None,
        journaled=False,
        signing_key=key,
        session=session,
        exclusive=False,
    )
    return session


def _verify_at(engine: sa.Engine, clock: Clock, chain_id: str) -> ChainReport:
    report = verify_trusted(engine, TRUSTED, now=clock.now())
    return next(c for c in report.chains if c.chain_id == chain_id)


# -- the attack: a live sidecar, a killed command, rows forged after its lease ---------------


def test_rows_forged_after_a_killed_cli_commands_lease_are_sealed_foreign(
    ledger: Ledger, clock: Clock
) -> None:
    chain_id = "node-killed-cli"
    forged: list[int] = []

    async def run() -> None:
        sidecar, engine = await _writer(ledger.url, chain_id)
        try:
            await sidecar.append(_put(0))
            _killed_cli_command(ledger.attacker, chain_id)
            await sidecar.append(_put(1))  # the sidecar serves on beside the dead session
            assert await sidecar.write_checkpoint() is not None
            clock.advance(LATER)
            forged.extend(_append_forged(ledger.attacker, chain_id, FRAMED))
            await sidecar.append(_put(2))  # re-chained on the forged rows
            assert await sidecar.write_checkpoint() is not None  # signs a head past them
        finally:
            await sidecar.close(checkpoint=True)
            engine.dispose()

    asyncio.run(run())
    seals = _seals(ledger.attacker, chain_id, "foreign")
    chain = _verify_at(ledger.attacker, clock, chain_id)
    assert [(s.seq, s.session.split("@")[1]) for s in seals] == [(forged[-1], str(forged[0]))], (
        f"no foreign seal over rows {forged} the runtime role appended {LATER} after a CLI "
        f"command was killed beside the live sidecar: its open-ended session explained them "
        f"(verify: {'ok' if chain.first_bad is None else chain.first_bad.problem})"
    )
    assert chain.first_bad is not None, chain.to_dict()
    assert (chain.first_bad.problem, chain.first_bad.seq) == ("foreign_append", forged[0])
    assert {f.problem for f in chain.findings} == {"foreign_append"}  # the sidecar's rows pass
    # nor does an operator's `kvgov audit checkpoint` sign a row forged after the sidecar's
    # close, which only the dead session held
    _append_forged(ledger.attacker, chain_id, FRAMED[1:])
    with pytest.raises(LedgerError, match="appended after its writer closed"):
        write_checkpoint(ledger.attacker, chain_id, NODE_KEY)


def test_a_killed_cli_commands_session_no_longer_explains_rows_to_verify(
    ledger: Ledger, clock: Clock
) -> None:
    """The readers' side: no live writer judges rows appended after the sidecar's clean close,
    and a restarted sidecar's open signs over them. The killed command's session covered them,
    so ``audit verify`` passed them for ever; now they are ``after_close``."""
    chain_id = "node-killed-cli-closed"
    forged: list[int] = []

    async def run() -> None:
        sidecar, engine = await _writer(ledger.url, chain_id)
        try:
            await sidecar.append(_put(0))
            _killed_cli_command(ledger.attacker, chain_id)
            await sidecar.append(_put(1))
        finally:
            await sidecar.close(checkpoint=True)  # a clean stop (a rollout)
            engine.dispose()
        clock.advance(LATER)
        forged.extend(_append_forged(ledger.attacker, chain_id, FRAMED))
        # the sidecar back on the same chain (journaled: exclusive): its open signs the head
        restarted, engine = await _writer(ledger.url, chain_id, exclusive=True)
        try:
            await restarted.append(_put(2))
        finally:
            await restarted.close(checkpoint=True)
            engine.dispose()

    asyncio.run(run())
    chain = _verify_at(ledger.attacker, clock, chain_id)
    assert chain.first_bad is not None, (
        f"audit verify: ok over rows {forged} appended after the sidecar's clean close, "
        f"{LATER} after a CLI command was killed beside it ({chain.to_dict()})"
    )
    assert (chain.first_bad.problem, chain.first_bad.seq) == ("after_close", forged[0])
    assert f"{forged[0]}..{forged[-1]}" in chain.first_bad.detail


@pytest.mark.postgres
async def test_a_step_forged_after_a_killed_cli_commands_lease_is_not_in_the_receipt(
    env: Env, runtime_role: str, clock: Clock
) -> None:
    _killed_cli_command(env.engine, CHAIN, env.key)
    clock.advance(LATER)
    r, seq = await _forged_receipt(env, runtime_role)
    assert not (r["state"] == "completed" and r["entries_purged"] == 120), (
        f"signed {r['state']!r} with entries_purged={r['entries_purged']}: the purge:step the "
        f"runtime role appended at {seq}, {LATER} after a CLI command was killed beside the "
        f"live writer, was taken as the writer's"
    )
    assert any(line.startswith("tiers") for line in r["incomplete"]), r["incomplete"]
    report = verify_trusted(env.engine, [public_key_bytes(env.key)], now=clock.now())
    chain = next(c for c in report.chains if c.chain_id == CHAIN)
    assert chain.first_bad is not None and chain.first_bad.problem == "foreign_append"
    assert chain.first_bad.seq == seq


async def test_sqlite_a_step_forged_after_a_killed_cli_commands_lease_is_not_in_the_receipt(
    sqlite_env: Env, clock: Clock
) -> None:
    _killed_cli_command(sqlite_env.engine, CHAIN, sqlite_env.key)
    clock.advance(LATER)
    r, seq = await _forged_receipt(sqlite_env, None)
    assert r["state"] != "completed", f"signed completed with the step forged at {seq}"
    assert r["entries_purged"] != 120
    assert any(line.startswith("tiers") for line in r["incomplete"]), r["incomplete"]


# -- no false alarm ---------------------------------------------------------------------------


def _node_settings(ledger: Ledger, data_dir: Path, chain_id: str, **ledger_kw: Any) -> Settings:
    """The node's CLI settings: the ledger, the node's signing key, its chain."""
    key_path = data_dir / "ledger-signing.key"
    key_path.write_text(PEM)
    key_path.chmod(0o600)
    return Settings(
        data_dir=data_dir,
        database={"url": ledger.url},
        ledger={"chain_id": chain_id, "signing_key_path": key_path, **ledger_kw},
    )


def _clean(ledger: Ledger, clock: Clock, chain_id: str) -> ChainReport:
    chain = _verify_at(ledger.attacker, clock, chain_id)
    assert chain.first_bad is None, chain.to_dict()
    assert _seals(ledger.attacker, chain_id, "foreign") == []
    return chain


def test_an_honest_cli_command_beside_the_sidecar_verifies_long_after_its_lease(
    ledger: Ledger, clock: Clock, tmp_path: Path
) -> None:
    """``kvgov token create`` (``append_events``: open, rows, checkpoint, close) beside the
    serving sidecar; then the sidecar serves on, well past the command's lease."""
    from kvgov.cli._common import append_events

    chain_id = "node-honest-cli"
    settings = _node_settings(ledger, tmp_path, chain_id)

    async def run() -> None:
        sidecar, engine = await _writer(ledger.url, chain_id)
        cli_engine = make_engine(ledger.url)
        try:
            await sidecar.append(_put(0))
            events = [Event(kind=EventKind.TOKEN_CREATED, principal=f"cli-{i}") for i in range(3)]
            await append_events(settings, cli_engine, *events)
            await sidecar.append(_put(1))
            clock.advance(LATER)
            await sidecar.append(_put(2))
            assert await sidecar.write_checkpoint() is not None
            assert sidecar.stats.foreign_appends == 0  # type: ignore[attr-defined]
        finally:
            await sidecar.close(checkpoint=True)
            engine.dispose()
            cli_engine.dispose()

    asyncio.run(run())
    chain = _clean(ledger, clock, chain_id)
    assert chain.events == 6 and chain.sessions == 2 and chain.closed
    with ledger.attacker.connect() as conn:
        opens = [
            s for s in read_seals(conn, chain_id, NODE_PUBLIC, reader="test") if s.kind == "open"
        ]
    assert [s.lease for s in opens] == [None, timedelta(seconds=LEASE_S)]  # the CLI's, signed


def test_a_killed_cli_commands_own_rows_stay_its_own(
    ledger: Ledger, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A command killed after its rows, before its close: the sidecar's next transaction
    (within the lease) takes them as the command's, and they verify long after."""
    chain_id = "node-killed-after-rows"

    def killed(*_: object, **__: object) -> None:
        raise OSError("kill -9")  # its signed close never happens (logged, as after a crash)

    async def run() -> None:
        sidecar, engine = await _writer(ledger.url, chain_id)
        cli, cli_engine = await _writer(
            ledger.url, chain_id, every_transaction=True, lease_s=LEASE_S
        )
        try:
            await sidecar.append(_put(0))
            await cli.append(Event(kind=EventKind.TOKEN_CREATED, principal="cli"))
            with monkeypatch.context() as patched:
                patched.setattr("kvgov.ledger.writer.close_session", killed)
                await cli.close()  # no checkpoint, no close seal: its session stays open
            await sidecar.append(_put(1))
            clock.advance(LATER)
            await sidecar.append(_put(2))
            assert await sidecar.write_checkpoint() is not None
        finally:
            await sidecar.close(checkpoint=True)
            engine.dispose()
            cli_engine.dispose()

    asyncio.run(run())
    assert _clean(ledger, clock, chain_id).events == 4
    with ledger.attacker.connect() as conn:
        closes = [
            s for s in read_seals(conn, chain_id, NODE_PUBLIC, reader="test") if s.kind == "close"
        ]
    assert len(closes) == 1  # the sidecar's alone


def test_a_cli_command_outliving_its_lease_renews_its_session(ledger: Ledger, clock: Clock) -> None:
    """A long command (its writes minutes apart): once half its lease has passed it closes its
    session and opens a fresh one in the transaction that writes, so the sidecar, judging
    after the first open's lease, takes none of its rows for foreign."""
    chain_id = "node-long-cli"

    async def run() -> None:
        sidecar, engine = await _writer(ledger.url, chain_id)
        cli, cli_engine = await _writer(
            ledger.url, chain_id, every_transaction=True, lease_s=LEASE_S
        )
        try:
            for i in range(4):
                await cli.append(Event(kind=EventKind.TOKEN_CREATED, principal=f"cli-{i}"))
                clock.advance(timedelta(seconds=LEASE_S * 0.6))
            await sidecar.append(_put(0))  # judges the command's rows, 240 s after its lease
            assert sidecar.stats.foreign_appends == 0  # type: ignore[attr-defined]
            await cli.close(checkpoint=True)
        finally:
            await sidecar.close(checkpoint=True)
            engine.dispose()
            cli_engine.dispose()

    asyncio.run(run())
    chain = _clean(ledger, clock, chain_id)
    assert chain.events == 5 and chain.closed
    with ledger.attacker.connect() as conn:
        seals = read_seals(conn, chain_id, NODE_PUBLIC, reader="test")
    leased = [s for s in seals if s.kind == "open" and s.lease is not None]
    assert len(leased) >= 4  # its first open, and a renewal at each write after the first
    closes = {s.writer_session for s in seals if s.kind == "close"}
    assert {s.session for s in leased} <= closes  # each renewed one closed, the last at its end


def test_a_neighbour_writer_needs_every_transaction() -> None:
    engine = make_engine("sqlite://")
    try:
        with pytest.raises(LedgerError, match="every_transaction"):
            LedgerWriter(engine, chain_id="c", signing_key=NODE_KEY, lease_s=LEASE_S)
        with pytest.raises(LedgerError, match="lease"):
            LedgerWriter(
                engine, chain_id="c", signing_key=NODE_KEY, every_transaction=True, lease_s=0
            )
    finally:
        engine.dispose()


def test_the_lease_setting_is_validated() -> None:
    assert Settings().ledger.neighbour_session_max_s == LEASE_S
    for bad in (0, -1, 3601):
        with pytest.raises(ValueError, match="neighbour_session_max_s"):
            Settings(ledger={"neighbour_session_max_s": bad})

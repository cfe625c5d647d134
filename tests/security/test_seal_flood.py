"""Attack: junk ``chain_seals`` rows cost every receipt, job document, restore, writer start and
writer transaction one Ed25519 signature check each.

The runtime database role (every sidecar pod holds it) may INSERT into ``chain_seals``. It can
read the chain's public key and its hashes, so its rows pass the cheap comparisons: the chain's
key, a kind, a position at or below the head, the chain's hash there, a garbage or replayed
signature (a copy of the chain's valid genesis under another key even verifies: its note does
not name its key). Every reader of a chain's seals (``read_standing``: the purge cross-check
behind each receipt, job documents, the purge list, a restart's owed EVICTs, the writer's
start, each of its checkpoints and the transactions that find its head moved; the writer's
foreign watch; ``audit verify``) read EVERY row of the chain and checked each one's signature,
again on each read, holding them all in memory.

Now every reader but ``audit verify`` goes through :func:`kvgov.ledger.seals.scan.read_valid`:
rows that can never verify, or matter, are not read (another key, a genesis not at 0, an
unknown kind, a signature that is not 64 bytes, an open or close past the chain's head once a
valid genesis vouches for it), the first valid genesis ends the genesis rows (copies are never
read), signature results are remembered process-wide (a row read again costs no check), and a
read that meets more than ``MAX_INVALID`` rows that do not verify stops there and fails closed,
loudly (``ledger.seal.scan_capped``, the ``kvgov_ledger_seal_scans_capped`` gauge): the chain
proves nothing to a receipt (``incomplete``), the writer's transaction is retried and alerted
on (``kvgov_ledger_seal_failures``, its events wait, never refused), its checkpoints fail
(logged), and a starting writer still opens its session. ``audit verify`` reads every row
(linear, each checked once) and reports the junk, the first ones by name and the rest counted.

Postgres, as the runtime role a sidecar has (what a read leaves out: SQLite).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Connection, select, text
from sqlalchemy.orm import Session

import kvgov.ledger.purge_trail as trail
import kvgov.ledger.seals.notes as notes
import kvgov.ledger.seals.scan as scan
from kvgov.db.engine import make_engine, upgrade, utcnow
from kvgov.db.models import Chain, table
from kvgov.errors import LedgerError
from kvgov.ledger.chain import GENESIS_HASH, public_key_bytes
from kvgov.ledger.events import Appended
from kvgov.ledger.seals import (
    SealKind,
    read_standing,
    read_valid,
    write_foreign_seal,
    write_genesis,
    write_session_seal,
)
from kvgov.ledger.trust import verify_trusted
from kvgov.ledger.verify import REPORTED_INVALID as REPORTED
from kvgov.ledger.verify import Problem
from kvgov.proxy.app import Sidecar
from tests.security import doors
from tests.security.test_chain_forgery import FRAMED, NODE_KEY, TRUSTED, _put
from tests.security.test_foreign_append import _append_forged, _writer
from tests.security.test_purge_late_evict import _sidecar

#: junk rows the attacker inserts (a real one would insert millions)
JUNK = 600
#: Ed25519 checks an honest read may cost: each honest seal of the chain once (its genesis, the
#: sidecars' opens and closes), whatever the junk beside them
HONEST = 16


def _counting(monkeypatch: pytest.MonkeyPatch) -> Callable[[], int]:
    """Count the Ed25519 seal signature checks from now on (the memo of earlier results
    cleared): every one goes through ``notes.Ed25519PublicKey``."""
    checked = 0
    real = notes.Ed25519PublicKey

    class Counted:
        def __init__(self, key: Any) -> None:
            self._key = key

        def verify(self, signature: bytes, data: bytes) -> None:
            nonlocal checked
            checked += 1
            self._key.verify(signature, data)

    class Counting:
        @staticmethod
        def from_public_bytes(data: bytes) -> Counted:
            return Counted(real.from_public_bytes(data))

    notes._verifies.cache_clear()
    monkeypatch.setattr(notes, "Ed25519PublicKey", Counting)
    return lambda: checked


def _insert(conn: Connection, chain: str, rows: list[dict[str, Any]]) -> None:
    """Insert junk seals as the runtime role (``session`` random unless given)."""
    conn.execute(
        text(
            "INSERT INTO chain_seals (chain_id, kind, session, seq, head_hash, exclusive, "
            "signed_at, signature, public_key) VALUES (:c, :kind, :session, :seq, :hash, "
            ":exclusive, :at, :sig, :key)"
        ),
        [
            {
                "c": chain,
                "session": secrets.token_hex(16),
                "exclusive": False,
                "at": utcnow(),
                **row,
            }
            for row in rows
        ],
    )


def _chain_key(conn: Connection, chain: str) -> bytes:
    return bytes(
        conn.execute(
            text("SELECT public_key FROM chains WHERE chain_id = :c"), {"c": chain}
        ).scalar_one()
    )


def _junk_on_chain(conn: Connection, chain: str, n: int) -> None:
    """``n`` junk opens, closes and foreign seals at positions of the chain, each naming the
    chain's own hash there and its key: garbage signatures, or the signature of the chain's
    honest open replayed (the role reads both)."""
    key = _chain_key(conn, chain)
    hashes = conn.execute(
        text("SELECT seq, hash FROM ledger_events WHERE chain_id = :c ORDER BY seq"), {"c": chain}
    ).all()
    assert hashes, "the chain has events"
    honest = conn.execute(
        text("SELECT signature FROM chain_seals WHERE chain_id = :c AND kind = 'open' LIMIT 1"),
        {"c": chain},
    ).scalar_one()
    rows: list[dict[str, Any]] = []
    for i in range(n):
        seq, digest = hashes[i % len(hashes)]
        kind = ("open", "close", "foreign")[i % 3]
        session = secrets.token_hex(16)
        if kind == "foreign":
            session = f"{session}.{secrets.token_hex(4)}@{seq}"
        rows.append(
            {
                "kind": kind,
                "session": session,
                "seq": seq,
                "hash": digest,
                "sig": bytes(honest) if i % 2 else secrets.token_bytes(64),
                "key": key,
            }
        )
    _insert(conn, chain, rows)


def _junk_that_cannot_matter(conn: Connection, chain: str, n: int) -> None:
    """``n`` junk rows a reader need not check: opens and closes far past the head, the chain's
    valid genesis replayed under other keys, rows under another public key, a genesis at a
    position, an unknown kind."""
    key = _chain_key(conn, chain)
    genesis = conn.execute(
        text(
            "SELECT signed_at, signature FROM chain_seals WHERE chain_id = :c AND kind = 'genesis'"
        ),
        {"c": chain},
    ).one()
    rows: list[dict[str, Any]] = []
    for i in range(n):
        junk: dict[str, Any] = {
            "kind": ("open", "close")[i % 2],
            "seq": 10**12 + i,
            "hash": "0" * 64,
            "sig": secrets.token_bytes(64),
            "key": key,
        }
        if i % 6 == 2:  # a valid genesis, replayed (it verifies: its note names no key)
            junk = {
                "kind": "genesis",
                "seq": 0,
                "hash": GENESIS_HASH,
                "at": genesis.signed_at,
                "sig": bytes(genesis.signature),
                "key": key,
            }
        elif i % 6 == 3:
            junk = {**junk, "kind": "foreign", "seq": 1, "key": secrets.token_bytes(32)}
            junk["session"] = f"{secrets.token_hex(16)}@1"
        elif i % 6 == 4:
            junk = {**junk, "kind": "genesis", "seq": 1}
        elif i % 6 == 5:
            junk = {**junk, "kind": "rewind", "seq": 1}
        rows.append(junk)
    _insert(conn, chain, rows)


def _capped(sc: Sidecar) -> float:
    value = sc.metrics.registry.get_sample_value("kvgov_ledger_seal_scans_capped")
    return value or 0.0


def _standing_reads(sc: Sidecar, chain: str) -> None:
    """What a job document, a purge list and a writer's transaction read of the chain."""
    assert sc.engine is not None
    with sc.engine.begin() as conn:
        assert read_standing(conn, chain, _chain_key(conn, chain)).vouched


@pytest.mark.postgres
async def test_junk_seals_that_cannot_matter_cost_no_signature_check(
    tmp_path: Path, prod_db: doors.ProdDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with _sidecar(tmp_path, prod_db) as sc:
        assert sc.purge is not None and sc.engine is not None and sc.writer is not None
        job = await doors.purge(sc, "acme", "alice")
        assert doors.receipt(job)["state"] == "completed"
        chain = sc.writer.chain_id
        with sc.engine.begin() as conn:  # the runtime role
            _junk_that_cannot_matter(conn, chain, JUNK)
        checked = _counting(monkeypatch)
        trusted = {public_key_bytes(sc.purge.service._signing_key)}
        with Session(sc.engine) as s:
            assert trail.chained_steps(s, job.id, job.tenant, trusted)
        assert checked() <= HONEST, (
            f"{JUNK} junk chain_seals rows (past the head, replayed genesis, another key) of "
            f"chain {chain} cost one purge cross-check {checked()} Ed25519 signature checks"
        )
        _standing_reads(sc, chain)
        assert await sc.writer.write_checkpoint() is None  # signed already: reads its seals
        after = await doors.purge(sc, "acme", "bob")
        assert doors.receipt(after)["state"] == "completed", doors.receipt(after)
        assert checked() <= HONEST, (
            f"the junk cost the job views, a checkpoint and an honest purge {checked()} checks"
        )
    # a writer restart (its open judges the chain) and its restores
    async with _sidecar(tmp_path, prod_db) as sc:
        assert sc.writer is not None and sc.writer.chain_id == chain
        assert checked() <= 2 * HONEST, f"a sidecar restart cost {checked()} signature checks"


@pytest.mark.postgres
async def test_junk_seals_below_the_cap_are_checked_once(
    tmp_path: Path, prod_db: doors.ProdDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    junk = scan.MAX_INVALID // 2
    async with _sidecar(tmp_path, prod_db) as sc:
        assert sc.purge is not None and sc.engine is not None and sc.writer is not None
        job = await doors.purge(sc, "acme", "alice")
        chain = sc.writer.chain_id
        with sc.engine.begin() as conn:
            _junk_on_chain(conn, chain, junk)
        checked = _counting(monkeypatch)
        trusted = {public_key_bytes(sc.purge.service._signing_key)}
        with Session(sc.engine) as s:
            assert trail.chained_steps(s, job.id, job.tenant, trusted)
        first = checked()
        assert first <= junk + HONEST, f"one cross-check cost {first} signature checks"
        # read again: the job view, a writer's checkpoint, an honest purge's whole receipt
        with Session(sc.engine) as s:
            assert trail.chained_steps(s, job.id, job.tenant, trusted)
        _standing_reads(sc, chain)
        await sc.writer.append(_put(1))
        assert await sc.writer.write_checkpoint() is not None
        after = await doors.purge(sc, "acme", "bob")
        assert doors.receipt(after)["state"] == "completed", doors.receipt(after)
        again = checked() - first
        assert again == 0, (
            f"{junk} junk chain_seals rows on chain {chain}, checked once already, cost the "
            f"next reads (a job view, a checkpoint, an honest purge) {again} more Ed25519 "
            "signature checks"
        )


@pytest.mark.postgres
async def test_junk_seals_past_the_cap_fail_closed(
    tmp_path: Path,
    prod_db: doors.ProdDatabase,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with _sidecar(tmp_path, prod_db) as sc:
        assert sc.purge is not None and sc.engine is not None and sc.writer is not None
        job = await doors.purge(sc, "acme", "alice")
        assert doors.receipt(job)["state"] == "completed"
        chain = sc.writer.chain_id
        with sc.engine.begin() as conn:
            _junk_on_chain(conn, chain, JUNK)
        checked = _counting(monkeypatch)
        trusted = {public_key_bytes(sc.purge.service._signing_key)}
        before = _capped(sc)
        with caplog.at_level(logging.WARNING), Session(sc.engine) as s:
            steps = trail.chained_steps(s, job.id, job.tenant, trusted)
        assert checked() <= scan.MAX_INVALID + 1 + HONEST, (
            f"{JUNK} junk chain_seals rows on chain {chain} (its key, its hashes, garbage or "
            f"replayed signatures) cost one purge cross-check {checked()} Ed25519 signature "
            "checks"
        )
        # fail closed, and loud: the chain proves nothing while its seals cannot be read
        assert not steps, "a capped read must not vouch for the chain"
        assert any(r.message == "ledger.seal.scan_capped" for r in caplog.records)
        assert _capped(sc) == before + 1
        # the writer's checkpoint refuses to sign a head it cannot judge (logged, retried)
        with pytest.raises(LedgerError):
            await sc.writer.write_checkpoint()
        assert _capped(sc) >= before + 2
    # a restarted sidecar still starts (its open is written; the chain is judged later)
    caplog.clear()
    async with _sidecar(tmp_path, prod_db) as sc:
        assert sc.writer is not None and sc.writer.chain_id == chain
        assert any(r.message == "ledger.seal.scan_capped" for r in caplog.records)


@pytest.mark.postgres
async def test_the_writers_watch_fails_closed_past_the_cap(
    prod_db: doors.ProdDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A live writer whose head moved reads its chain's seals (its foreign watch, its session
    kept open): past the cap its transaction is retried and alerted on, its events wait; and
    ``audit verify`` reports the junk, summarized."""
    writer, engine = await _writer(prod_db.url, "node-flood", exclusive=True)
    attacker = make_engine(prod_db.url)
    pending: asyncio.Future[Appended] | None = None
    try:
        await writer.append(_put(0))
        with attacker.begin() as conn:
            _junk_on_chain(conn, "node-flood", JUNK)
        _append_forged(attacker, "node-flood", FRAMED[:1])  # the head moves
        checked = _counting(monkeypatch)
        pending = asyncio.ensure_future(writer.append(_put(1)))
        for _ in range(200):
            if writer.stats.seal_failures or pending.done():
                break
            await asyncio.sleep(0.05)
        assert checked() <= scan.MAX_INVALID + 1 + HONEST, (
            f"{JUNK} junk chain_seals rows on chain node-flood cost the live writer's "
            f"transaction {checked()} Ed25519 signature checks"
        )
        assert writer.stats.seal_failures >= 1, "past the cap the transaction is retried"
        assert not pending.done(), "its events wait, never refused"
    finally:
        await writer.close(grace_s=0.2)
        if pending is not None:
            with contextlib.suppress(LedgerError):
                await pending
        engine.dispose()
    try:
        report = next(
            c for c in verify_trusted(attacker, TRUSTED).chains if c.chain_id == "node-flood"
        )
    finally:
        attacker.dispose()
    junk = [f for f in report.findings if f.problem == Problem.BAD_SIGNATURE]
    assert junk, "audit verify reports the junk"
    assert len(report.findings) <= 2 * REPORTED, "the junk is summarized, not a finding a row"
    assert any(str(JUNK - REPORTED) in f.detail for f in junk), [f.detail for f in junk][-1]


@pytest.mark.parametrize("vouched", [True, False])
def test_what_the_bounded_read_leaves_out(tmp_path: Path, vouched: bool) -> None:
    """Valid seals past the chain's head (signed before events were deleted past the
    append-only guard): an open or close there cannot change what covers a position at or
    below the head, so a vouched chain's read leaves them out; a foreign seal there still
    disclaims positions below it, and a chain without a valid genesis (the legacy rule takes
    its earliest valid seal) keeps everything. Copies of the valid genesis are never read."""
    url = f"sqlite:///{(tmp_path / 'ledger.db').as_posix()}"
    upgrade(url)
    engine = make_engine(url)
    public = public_key_bytes(NODE_KEY)
    try:
        with engine.begin() as conn:
            chains = table(Chain)
            conn.execute(
                chains.insert().values(chain_id="c", public_key=public, created_at=utcnow())
            )
            created = conn.execute(select(chains.c.created_at)).scalar_one()
            if vouched:
                genesis = write_genesis(conn, "c", NODE_KEY, created)
                _insert(
                    conn,
                    "c",
                    [
                        {
                            "kind": "genesis",
                            "seq": 0,
                            "hash": GENESIS_HASH,
                            "at": genesis.signed_at,
                            "sig": genesis.signature,
                            "key": public,
                        }
                    ],
                )
            past = (10, "a" * 64)  # the chain holds no event: its head is 0
            write_session_seal(
                conn, "c", NODE_KEY, SealKind.OPEN, session="s0", head=(0, GENESIS_HASH)
            )
            write_session_seal(conn, "c", NODE_KEY, SealKind.CLOSE, session="s0", head=past)
            write_foreign_seal(conn, "c", NODE_KEY, session="s0", first=1, head=past)
        with engine.connect() as conn:
            found = read_valid(conn, "c", public, created, reader="test")
    finally:
        engine.dispose()
    kinds = sorted(seal.kind for seal in found.valid)
    assert not found.invalid
    if vouched:
        assert kinds == ["foreign", "genesis", "open"], kinds  # one genesis, no close past 0
    else:
        assert kinds == ["close", "foreign", "open"], kinds

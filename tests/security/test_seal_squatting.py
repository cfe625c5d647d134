"""The runtime database role takes the key of a live writer's next seal first (review r11, F1).

Attack: whoever holds the runtime database role (every sidecar pod's Secret) may INSERT into
``chain_seals``, whose primary key is ``(chain_id, kind, session)``. Keys the writer computed
from what that role can read were taken first by a junk row, and the writer's own INSERT then
failed for good (the role cannot DELETE the row, and neither can the sidecar):

* a foreign seal's key was ``<writer session>@<first>``: the session is in the writer's signed
  open, ``first`` is the head it last left plus one. The writer's next transaction failed on
  the key and the committer took that for a refusal of the events themselves: every honest
  event, checkpoint and close after it failed, for ever;
* a close's key is ``(chain, 'close', <session>)``, public since the open: the writer's clean
  close failed, its session stayed open-ended like a crashed one, and rows appended after it
  passed verification instead of failing ``after_close``;
* the genesis' key is ``(chain, 'genesis', '')``: with the chain's row registered under the
  node's (public) key and a junk genesis beside it, the node's first start failed for good.

Now every seal is inserted with ``ON CONFLICT DO NOTHING``; a foreign seal's key carries a
random part (signed in its note), a close or genesis whose plain key is taken goes under one
with a random part, and a seal of the writer's own that still cannot be written is retried and
alerted on, never a refusal of the events (``docs/ledger.md``, "Seal keys").

Postgres tests connect as the runtime role a production sidecar uses (``prod_db``); the SQLite
ones as whoever can write the file. Each test FAILS while its squat works.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
from collections.abc import Callable

import pytest
import sqlalchemy as sa

from kvgov.db.engine import utcnow
from kvgov.db.models import Chain, ChainSeal, table
from kvgov.errors import LedgerError
from kvgov.ledger.chain import public_key_bytes
from kvgov.ledger.seals import Seal, Standing, read_standing
from kvgov.ledger.seals import store as seal_store
from kvgov.ledger.writer import LedgerWriter
from tests.security import test_foreign_append as foreign
from tests.security.test_chain_forgery import FRAMED, NODE_KEY, _head, _put
from tests.security.test_foreign_append import Ledger, _append_forged, _chain, _seals, _writer

# the ledger databases of the foreign-append tests (Postgres as the runtime role, SQLite)
ledger = foreign.ledger


def _newest_open(conn: sa.Connection, chain_id: str) -> str:
    seals = table(ChainSeal)
    return str(
        conn.execute(
            sa.select(seals.c.session)
            .where(seals.c.chain_id == chain_id, seals.c.kind == "open")
            .order_by(seals.c.signed_at.desc())
            .limit(1)
        ).scalar_one()
    )


def _junk_seal(conn: sa.Connection, chain_id: str, kind: str, session: str, seq: int) -> None:
    """As the runtime role: a garbage ``chain_seals`` row under the key ``(chain, kind,
    session)``."""
    conn.execute(
        table(ChainSeal)
        .insert()
        .values(
            chain_id=chain_id,
            kind=kind,
            session=session,
            seq=seq,
            head_hash="0" * 64,
            exclusive=False,
            signed_at=utcnow(),
            signature=b"\0" * 64,
            public_key=b"\0" * 32,
        )
    )


def _squat_next_foreign_seal(engine: sa.Engine, chain_id: str, key_part: str = "") -> None:
    """As the runtime role: the live writer's session (its open, newest) and head, then a
    garbage ``foreign`` row under the key its next foreign seal will have (``key_part``: the
    random part the attacker bets on; none: the key before the fix)."""
    with engine.begin() as conn:
        session = _newest_open(conn, chain_id)
        seq, _ = _head(conn, chain_id)
        token = f"{session}.{key_part}" if key_part else session
        _junk_seal(conn, chain_id, "foreign", f"{token}@{seq + 1}", seq + 1)


def _standing(ledger: Ledger, chain_id: str) -> Standing:
    """What the chain's valid seals say (what the writers' watches, the purge receipt's
    cross-check and ``audit verify``'s coverage rules read). ``audit verify`` itself also
    reports the junk row, a seal no key of the chain signed (``key_mismatch``), and goes on
    (``tests/security/test_checkpoint_squatting.py``)."""
    with ledger.attacker.connect() as conn:
        return read_standing(conn, chain_id, public_key_bytes(NODE_KEY))


def _first_finding(ledger: Ledger, chain_id: str) -> tuple[str, int] | None:
    bad = _chain(ledger.attacker, chain_id).first_bad
    return None if bad is None else (str(bad.problem), bad.seq)


def _valid_foreign(engine: sa.Engine, chain_id: str) -> list[Seal]:
    rows = [Seal.from_row(r) for r in _seals(engine, chain_id, "foreign")]
    return [s for s in rows if s.signature_ok(public_key_bytes(NODE_KEY), None)]


def test_a_squatted_foreign_seal_key_does_not_wedge_the_writer(ledger: Ledger) -> None:
    """Review r11's demonstration (its assertions kept)."""
    chain_id = "node-r11-squat"
    outcome: list[str] = []

    async def run() -> None:
        writer, engine = await _writer(ledger.url, chain_id)
        try:
            await writer.append(_put(0))
            _squat_next_foreign_seal(ledger.attacker, chain_id)
            _append_forged(ledger.attacker, chain_id, FRAMED[:1])
            for i in (1, 2, 3):  # the next honest events, each its own batch
                try:
                    await asyncio.wait_for(writer.append(_put(i)), 15)
                    outcome.append("committed")
                except TimeoutError:
                    outcome.append("wedged")
                except LedgerError as exc:
                    outcome.append(f"refused ({exc})")
        finally:
            try:
                await asyncio.wait_for(writer.close(grace_s=1.0), 20)
            except Exception as exc:
                outcome.append(f"close: {type(exc).__name__}")
            engine.dispose()

    asyncio.run(run())
    valid = [
        s for s in _seals(ledger.attacker, chain_id, "foreign") if bytes(s.signature) != b"\0" * 64
    ]
    assert outcome[:3] == ["committed"] * 3 and valid, (
        f"{outcome}: the writer could not seal the appended row (the runtime role had squatted"
        " its foreign seal's primary key), so it refused every honest event after it"
    )
    # the forged row is named by a valid foreign seal, and verification fails it (and the junk
    # row, a seal no key signed)
    assert [(s.first, s.seq) for s in _valid_foreign(ledger.attacker, chain_id)] == [(2, 2)]
    found = _standing(ledger, chain_id)
    assert not found.covers(2) and found.foreign_at(2) is not None
    assert _first_finding(ledger, chain_id) == ("key_mismatch", 2)  # the junk row
    # and the forged row after it: the junk row does not hide it
    findings = {(str(f.problem), f.seq) for f in _chain(ledger.attacker, chain_id).findings}
    assert findings == {("key_mismatch", 2), ("foreign_append", 2)}


def _key_parts(monkeypatch: pytest.MonkeyPatch, guessed: int) -> Callable[[], str]:
    """The writer's seal keys' random parts: the first ``guessed`` are ``deadbeef`` (the bet of
    an attacker who guessed 32 random bits, or a broken random source), then random."""
    parts = itertools.chain(["deadbeef"] * guessed, iter(lambda: secrets.token_hex(4), None))
    monkeypatch.setattr(seal_store, "key_part", lambda: next(parts))
    return seal_store.key_part


def _squat_then_write(ledger: Ledger, chain_id: str) -> tuple[LedgerWriter, list[int]]:
    """A live writer, a foreign seal key squatted with the random part ``deadbeef``, a forged
    row, then three honest events; the writer and their positions."""
    seqs: list[int] = []

    async def run() -> LedgerWriter:
        writer, engine = await _writer(ledger.url, chain_id)
        try:
            await writer.append(_put(0))
            _squat_next_foreign_seal(ledger.attacker, chain_id, key_part="deadbeef")
            _append_forged(ledger.attacker, chain_id, FRAMED[:1])
            for i in (1, 2, 3):
                seqs.append((await asyncio.wait_for(writer.append(_put(i)), 15)).seq)
        finally:
            await writer.close(checkpoint=True)
            engine.dispose()
        return writer

    return asyncio.run(run()), seqs


def test_a_taken_foreign_seal_key_is_retried_under_a_fresh_one_logged_and_counted(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Even a squat on the right random part costs one retry in the same transaction: the
    events commit, the seal goes under a fresh key, and the take is logged and counted."""
    _key_parts(monkeypatch, guessed=1)
    with caplog.at_level(logging.WARNING):
        writer, seqs = _squat_then_write(ledger, "node-squat-guess")
    assert seqs == [3, 4, 5]  # every honest event committed, after the forged row (2)
    assert writer.stats.seal_keys_taken == 1
    assert writer.stats.seal_failures == 0 and writer.stats.events_failed == 0
    taken = [r for r in caplog.records if r.getMessage() == "ledger.seal.key_taken"]
    assert len(taken) == 1 and taken[0].levelno == logging.ERROR
    assert {k: getattr(taken[0], k, None) for k in ("chain_id", "kind")} == {
        "chain_id": "node-squat-guess",
        "kind": "foreign",
    }
    valid = _valid_foreign(ledger.attacker, "node-squat-guess")
    assert [(s.first, s.seq) for s in valid] == [(2, 2)]
    assert "deadbeef" not in valid[0].session
    found = _standing(ledger, "node-squat-guess")
    assert not found.covers(2) and found.foreign_at(2) is not None


def test_a_seal_the_writer_cannot_write_delays_its_events_never_refuses_them(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Every key of the first transaction taken: the writer's own seal fails, and the batch is
    retried (alerted, counted), not refused; its events commit on the retry."""
    _key_parts(monkeypatch, guessed=seal_store.KEY_TRIES)
    with caplog.at_level(logging.WARNING):
        writer, seqs = _squat_then_write(ledger, "node-squat-fail")
    assert seqs == [3, 4, 5]
    assert writer.stats.events_failed == 0
    assert writer.stats.seal_failures == 1
    # the first try's one taken key; its other tries went to keys nobody held (only one squat)
    assert writer.stats.seal_keys_taken >= 1
    failed = [r for r in caplog.records if r.getMessage() == "ledger.chain.seal_failed"]
    assert len(failed) == 1 and failed[0].levelno == logging.ERROR
    refused = [r for r in caplog.records if r.getMessage() == "ledger.event.refused"]
    assert refused == []
    assert len(_valid_foreign(ledger.attacker, "node-squat-fail")) == 1


def test_a_squatted_close_key_still_closes_the_session(ledger: Ledger) -> None:
    """The close's plain key (the session id, public since its open) taken by a junk row: the
    writer closes under a key with a random part, so rows appended after its close still fail
    ``after_close`` (before: the close failed, and the session, open-ended like a crashed one,
    covered them)."""
    chain_id = "node-squat-close"

    async def run() -> None:
        writer, engine = await _writer(ledger.url, chain_id)
        try:
            await writer.append(_put(0))
            with ledger.attacker.begin() as conn:
                _junk_seal(conn, chain_id, "close", _newest_open(conn, chain_id), 1)
        finally:
            await writer.close(checkpoint=True)
            engine.dispose()

    asyncio.run(run())
    forged = _append_forged(ledger.attacker, chain_id, FRAMED[:1])
    found = _standing(ledger, chain_id)
    assert not found.covers(forged[0]), (
        f"rows {forged} appended after the writer's close are covered by its session (the "
        "purge receipt's cross-check and other writers' watches take them as a key holder's):"
        " its close key was squatted, so its session never closed"
    )
    gap = found.gap(forged[0])
    assert gap is not None and (gap.first, gap.closed_at) == (2, 1)
    closes = [Seal.from_row(r) for r in _seals(ledger.attacker, chain_id, "close")]
    assert [s.seq for s in closes if s.signature_ok(public_key_bytes(NODE_KEY), None)] == [1]


def test_a_squatted_genesis_key_does_not_stop_the_first_start(ledger: Ledger) -> None:
    """The runtime role registers the node's chain first, under the node's public key, with a
    junk genesis beside it: the node's first start still signs the genesis (under another key)
    and writes."""
    chain_id = "node-squat-genesis"
    with ledger.attacker.begin() as conn:
        conn.execute(
            table(Chain)
            .insert()
            .values(
                chain_id=chain_id,
                public_key=public_key_bytes(NODE_KEY),
                created_at=utcnow(),
                description=None,
            )
        )
        _junk_seal(conn, chain_id, "genesis", "", 0)

    async def run() -> None:
        writer, engine = await _writer(ledger.url, chain_id)
        try:
            await writer.append(_put(0))
        finally:
            await writer.close(checkpoint=True)
            engine.dispose()

    asyncio.run(run())
    chain = _chain(ledger.attacker, chain_id)
    assert chain.events == 1 and chain.closed and chain.genesis == "signed", chain.to_dict()
    # only the junk row itself is reported (a seal no key signed)
    assert {(str(f.problem), f.seq) for f in chain.findings} == {("key_mismatch", 0)}
    assert _standing(ledger, chain_id).covers(1)

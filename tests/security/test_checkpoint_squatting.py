"""The runtime database role squats the key of a writer's next checkpoint, and one junk seal row
hides later tampering from ``audit verify``.

Attack 1: whoever holds the runtime database role (every sidecar pod's Secret) may INSERT into
``checkpoints``, whose primary key was ``(chain_id, seq)``: computable from the head that role
reads. A junk row at the head took the honest checkpoint's place: the writer (and ``kvgov audit
checkpoint``) saw "already checkpointed" and signed nothing, so the head stayed unsigned by a
real checkpoint; the purge receipt named the newest row, junk or not. Now a checkpoint goes
under ``(chain_id, seq, nonce)`` (migration 0013), inserted ``ON CONFLICT DO NOTHING`` with a
random nonce when the plain one is taken, and only a checkpoint that verifies under the chain's
key counts as "already checkpointed" or goes into a receipt (``docs/ledger.md``, "Seal keys").

Attack 2: a row no key of the chain signed (a junk seal or checkpoint, which that role can
always insert) made ``audit verify`` skip the checks that follow a chain's first finding:
events appended after the writer's close, events removed after a signed head, a stale unsigned
tail. Now such rows are reported and verification goes on, so one junk row cannot hide later
tampering; the CLI prints every finding.

Postgres tests connect as the runtime role a production sidecar uses (``prod_db``); the SQLite
ones as whoever can write the file. Each test FAILS while its attack works.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
from pathlib import Path

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session
from typer.testing import CliRunner

from kvgov.cli.main import build_app
from kvgov.db.engine import utcnow
from kvgov.db.models import Checkpoint, table
from kvgov.ledger.chain import checkpoint_signature_ok, public_key_bytes
from kvgov.ledger.queries_api import list_checkpoints
from kvgov.ledger.seals import store as seal_store
from kvgov.ledger.verify import ChainReport
from kvgov.proxy.api.pagination import checkpoint_key, encode_cursor
from kvgov.services.purge.build import writer_checkpointer
from tests.security import test_foreign_append as foreign
from tests.security.doors import ProdDatabase
from tests.security.test_chain_forgery import FRAMED, NODE_KEY, _head, _put
from tests.security.test_foreign_append import (
    Ledger,
    _append_forged,
    _chain,
    _cli_env,
    _writer,
)
from tests.security.test_seal_squatting import _junk_seal

# the ledger databases of the foreign-append tests (Postgres as the runtime role, SQLite)
ledger = foreign.ledger

#: a junk row's key: another key than the chain's, or the chain's own with a signature of zeros
JUNK_KEYS = {"another-key": b"\0" * 32, "chain-key": public_key_bytes(NODE_KEY)}


def _junk_checkpoint(engine: sa.Engine, chain_id: str, seq: int, public_key: bytes) -> None:
    """As the runtime role: a garbage checkpoint of ``seq`` under the key every checkpoint of
    that head had before the fix (``(chain, seq)``, the plain nonce after it)."""
    with engine.begin() as conn:
        conn.execute(
            table(Checkpoint)
            .insert()
            .values(
                chain_id=chain_id,
                seq=seq,
                head_hash="0" * 64,
                signed_at=utcnow(),
                signature=b"\0" * 64,
                public_key=public_key,
            )
        )


def _valid_checkpoints(engine: sa.Engine, chain_id: str) -> list[tuple[int, str]]:
    """``(seq, head_hash)`` of the chain's checkpoints that verify under the node's key."""
    cps = table(Checkpoint)
    with engine.connect() as conn:
        rows = conn.execute(sa.select(cps).where(cps.c.chain_id == chain_id)).all()
    public = public_key_bytes(NODE_KEY)
    return sorted(
        (r.seq, r.head_hash)
        for r in rows
        if bytes(r.public_key) == public
        and checkpoint_signature_ok(
            public,
            bytes(r.signature),
            chain_id=chain_id,
            seq=r.seq,
            head_hash=r.head_hash,
            at=r.signed_at,
        )
    )


def _findings(chain: ChainReport) -> set[tuple[str, int]]:
    return {(str(f.problem), f.seq) for f in chain.findings}


def _junk_problem(junk_key: str) -> str:
    return "key_mismatch" if junk_key == "another-key" else "bad_signature"


# -- attack 1: a junk checkpoint takes the honest one's key ---------------------------------


@pytest.mark.parametrize("junk_key", list(JUNK_KEYS))
def test_a_junk_checkpoint_at_the_head_does_not_stop_the_writers_checkpoint(
    ledger: Ledger, junk_key: str
) -> None:
    """A live writer's head and its next head squatted: each checkpoint is still written,
    signed, and verifies; the junk rows are reported, the head is not left unsigned."""
    chain_id = f"node-cp-squat-{junk_key}"
    written: list[object] = []
    live: list[ChainReport] = []

    async def run() -> None:
        writer, engine = await _writer(ledger.url, chain_id)
        try:
            for i in range(2):
                await writer.append(_put(i))
            with ledger.attacker.connect() as conn:
                seq, _ = _head(conn, chain_id)
            _junk_checkpoint(ledger.attacker, chain_id, seq, JUNK_KEYS[junk_key])
            written.append(await writer.write_checkpoint())
            # the next head's key, bet on before the event is written
            _junk_checkpoint(ledger.attacker, chain_id, seq + 1, JUNK_KEYS[junk_key])
            await writer.append(_put(2))
            written.append(await writer.write_checkpoint())
            live.append(_chain(ledger.attacker, chain_id))  # before the close signs the head
        finally:
            await writer.close()
            engine.dispose()

    asyncio.run(run())
    assert all(w is not None for w in written), (
        f"write_checkpoint returned {written}: a junk row under the head's checkpoint key made "
        "the writer take the head for signed, and it signed nothing"
    )
    with ledger.attacker.connect() as conn:
        head = _head(conn, chain_id)
    assert [seq for seq, _ in _valid_checkpoints(ledger.attacker, chain_id)] == [2, 3]
    assert _valid_checkpoints(ledger.attacker, chain_id)[-1] == head
    chain = live[0]
    # the head verifies under the honest checkpoint; only the junk rows are findings
    assert chain.head_seq == 3 and chain.unsigned_events == 0, chain.to_dict()
    assert _findings(chain) == {(_junk_problem(junk_key), 2), (_junk_problem(junk_key), 3)}


def test_audit_checkpoint_signs_a_head_whose_key_was_squatted(
    ledger: Ledger, tmp_path: Path
) -> None:
    """``kvgov audit checkpoint`` on a closed chain with a junk checkpoint at its head: it signs
    the head (it said "head already signed" before)."""
    chain_id = "node-cp-squat-cli"

    async def run() -> None:
        writer, engine = await _writer(ledger.url, chain_id)
        try:
            for i in range(2):
                await writer.append(_put(i))
        finally:
            await writer.close()
            engine.dispose()

    asyncio.run(run())
    _junk_checkpoint(ledger.attacker, chain_id, 2, JUNK_KEYS["chain-key"])
    env = _cli_env(ledger, tmp_path)
    result = CliRunner().invoke(build_app(), ["audit", "checkpoint", "--chain", chain_id], env=env)
    assert result.exit_code == 0, result.output
    assert f"{chain_id}: signed seq 2" in result.output, (
        f"{result.output!r}: the junk checkpoint passed for the head's signature"
    )
    with ledger.attacker.connect() as conn:
        assert _valid_checkpoints(ledger.attacker, chain_id) == [_head(conn, chain_id)]
    again = CliRunner().invoke(build_app(), ["audit", "checkpoint", "--chain", chain_id], env=env)
    assert "head already signed" in again.output  # the honest checkpoint counts, once
    verify = CliRunner().invoke(build_app(), ["audit", "verify"], env=env)
    assert verify.exit_code == 1
    assert f"BROKEN {chain_id}: bad_signature at seq 2" in verify.output, verify.output


def _key_parts(monkeypatch: pytest.MonkeyPatch, guessed: int) -> None:
    """The first ``guessed`` random key parts are ``deadbeef`` (an attacker who guessed 32
    random bits, or a broken random source), then random."""
    parts = itertools.chain(["deadbeef"] * guessed, iter(lambda: secrets.token_hex(4), None))
    monkeypatch.setattr(seal_store, "key_part", lambda: next(parts))


def test_a_guessed_checkpoint_nonce_costs_a_retry_logged_and_counted(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The plain key and the writer's first random nonce both taken: the checkpoint goes under
    a fresh nonce, in the same transaction; each take is logged and counted."""
    chain_id = "node-cp-squat-guess"
    _key_parts(monkeypatch, guessed=1)
    infos: list[object] = []

    async def run() -> int:
        writer, engine = await _writer(ledger.url, chain_id)
        try:
            await writer.append(_put(0))
            with ledger.attacker.begin() as conn:
                seq, _ = _head(conn, chain_id)
                for nonce in ("", "deadbeef"):
                    conn.execute(
                        table(Checkpoint)
                        .insert()
                        .values(
                            chain_id=chain_id,
                            seq=seq,
                            nonce=nonce,
                            head_hash="0" * 64,
                            signed_at=utcnow(),
                            signature=b"\0" * 64,
                            public_key=b"\0" * 32,
                        )
                    )
            infos.append(await writer.write_checkpoint())
        finally:
            await writer.close()
            engine.dispose()
        return writer.stats.seal_keys_taken

    with caplog.at_level(logging.WARNING):
        taken = asyncio.run(run())
    assert infos[0] is not None and taken == 2
    logged = [r for r in caplog.records if r.getMessage() == "ledger.seal.key_taken"]
    assert [getattr(r, "kind", None) for r in logged] == ["checkpoint", "checkpoint"]
    assert all(r.levelno == logging.ERROR for r in logged)
    cps = table(Checkpoint)
    with ledger.attacker.connect() as conn:
        nonces = conn.execute(sa.select(cps.c.nonce).where(cps.c.chain_id == chain_id)).scalars()
        honest = [n for n in nonces if n not in ("", "deadbeef")]
    assert len(honest) == 1 and len(honest[0]) == 8
    assert len(_valid_checkpoints(ledger.attacker, chain_id)) == 1


def test_the_purge_receipt_names_a_checkpoint_that_verifies(ledger: Ledger) -> None:
    """The receipt's checkpoint was the chain's newest row: a junk one far ahead of the head
    (any ``seq`` the runtime role likes) went into every signed receipt after it."""
    chain_id = "node-cp-squat-receipt"
    got: list[object] = []

    async def run() -> None:
        writer, engine = await _writer(ledger.url, chain_id)
        try:
            for i in range(2):
                await writer.append(_put(i))
            _junk_checkpoint(ledger.attacker, chain_id, 10**9, JUNK_KEYS["chain-key"])
            _junk_checkpoint(ledger.attacker, chain_id, 2, JUNK_KEYS["chain-key"])
            got.append(await writer_checkpointer(writer, engine, chain_id)())
        finally:
            await writer.close()
            engine.dispose()

    asyncio.run(run())
    info = got[0]
    assert info is not None
    seq, head_hash = getattr(info, "seq", None), getattr(info, "head_hash", None)
    assert (seq, head_hash) in _valid_checkpoints(ledger.attacker, chain_id), (
        f"the receipt names checkpoint {seq}: a junk row, not a signed head of the chain"
    )
    with ledger.attacker.connect() as conn:
        assert (seq, head_hash) == _head(conn, chain_id)


# -- attack 2: a junk row hides later tampering from audit verify ----------------------------


def test_a_junk_seal_does_not_hide_events_appended_after_the_close(
    ledger: Ledger, tmp_path: Path
) -> None:
    """A junk seal early in a closed chain, then rows appended after its close: verification
    reports both (it reported the junk row only, and passed over the appended rows)."""
    chain_id = "node-junk-then-append"

    async def run() -> None:
        writer, engine = await _writer(ledger.url, chain_id)
        try:
            for i in range(3):
                await writer.append(_put(i))
        finally:
            await writer.close(checkpoint=True)
            engine.dispose()

    asyncio.run(run())
    with ledger.attacker.begin() as conn:
        _junk_seal(conn, chain_id, "open", secrets.token_hex(16), 1)
    forged = _append_forged(ledger.attacker, chain_id, FRAMED)
    chain = _chain(ledger.attacker, chain_id)
    assert ("after_close", forged[0]) in _findings(chain), (
        f"audit verify found {sorted(_findings(chain))}: the junk seal at 1 hid the rows "
        f"{forged} appended after the writer's close"
    )
    assert _findings(chain) == {("key_mismatch", 1), ("after_close", forged[0])}
    # the CLI names both, not only the first
    env = _cli_env(ledger, tmp_path)
    out = CliRunner().invoke(build_app(), ["audit", "verify"], env=env).output
    assert f"BROKEN {chain_id}: key_mismatch at seq 1" in out, out
    assert f"after_close at seq {forged[0]}" in out, out


def test_a_junk_seal_does_not_hide_a_foreign_append_to_a_live_chain(ledger: Ledger) -> None:
    """A junk seal, then rows appended to a live writer's chain (its foreign seal names them):
    both reported."""
    chain_id = "node-junk-then-foreign"
    forged: list[int] = []

    async def run() -> None:
        writer, engine = await _writer(ledger.url, chain_id)
        try:
            await writer.append(_put(0))
            with ledger.attacker.begin() as conn:
                _junk_seal(conn, chain_id, "close", secrets.token_hex(16), 1)
            forged.extend(_append_forged(ledger.attacker, chain_id, FRAMED[:1]))
            await writer.append(_put(1))
        finally:
            await writer.close(checkpoint=True)
            engine.dispose()

    asyncio.run(run())
    chain = _chain(ledger.attacker, chain_id)
    assert _findings(chain) == {("key_mismatch", 1), ("foreign_append", forged[0])}, chain.to_dict()


@pytest.mark.postgres
def test_a_junk_checkpoint_does_not_hide_events_removed_after_a_signed_head(
    prod_db: ProdDatabase,
) -> None:
    """A junk checkpoint at 1, then the last events of a closed, checkpointed chain removed
    (as the superuser, the append-only guard off): verification reports both (it reported the
    junk row only: its signed head past the end went unchecked)."""
    chain_id = "node-junk-then-cut"
    ledger = Ledger(prod_db.url, sa.create_engine(prod_db.url))
    try:

        async def run() -> None:
            writer, engine = await _writer(ledger.url, chain_id)
            try:
                for i in range(4):
                    await writer.append(_put(i))
            finally:
                await writer.close(checkpoint=True)
                engine.dispose()

        asyncio.run(run())
        _junk_checkpoint(ledger.attacker, chain_id, 1, JUNK_KEYS["another-key"])
        with psycopg.connect(prod_db.superuser_dsn, autocommit=True) as su:
            su.execute("SET session_replication_role = replica")  # the append-only guard off
            su.execute("DELETE FROM ledger_events WHERE chain_id = %s AND seq > 2", (chain_id,))
        chain = _chain(ledger.attacker, chain_id)
    finally:
        ledger.attacker.dispose()
    assert ("checkpoint_mismatch", 3) in _findings(chain), (
        f"audit verify found {sorted(_findings(chain))}: the junk checkpoint at 1 hid the "
        "events removed after the signed head at 4"
    )
    assert _findings(chain) == {("key_mismatch", 1), ("checkpoint_mismatch", 3)}


@pytest.mark.postgres
def test_a_rewritten_head_under_a_valid_checkpoint_is_refused_not_reported_signed(
    prod_db: ProdDatabase, tmp_path: Path
) -> None:
    """The head's position holds another event than its valid checkpoint signed (the
    superuser removed it, the runtime role appended a forged one in its place): ``kvgov audit
    checkpoint`` refuses it (it said "head already signed", exit 0)."""
    chain_id = "node-cp-rewritten"
    ledger = Ledger(prod_db.url, sa.create_engine(prod_db.url))
    try:

        async def run() -> None:
            writer, engine = await _writer(ledger.url, chain_id)
            try:
                for i in range(2):
                    await writer.append(_put(i))
            finally:
                await writer.close(checkpoint=True)
                engine.dispose()

        asyncio.run(run())
        with psycopg.connect(prod_db.superuser_dsn, autocommit=True) as su:
            su.execute("SET session_replication_role = replica")  # the append-only guard off
            su.execute("DELETE FROM ledger_events WHERE chain_id = %s AND seq = 2", (chain_id,))
        assert _append_forged(ledger.attacker, chain_id, FRAMED[:1]) == [2]
        env = _cli_env(ledger, tmp_path)
        result = CliRunner().invoke(
            build_app(), ["audit", "checkpoint", "--chain", chain_id], env=env
        )
    finally:
        ledger.attacker.dispose()
    assert result.exit_code == 1, result.output
    assert f"{chain_id}: NOT signed" in result.output and "names another head" in result.output


def test_a_junk_twin_of_a_checkpoint_does_not_hide_it_from_the_paged_list(
    ledger: Ledger,
) -> None:
    """With 0013's key two rows may share ``(signed_at, chain_id, seq)`` (the runtime role can
    copy them from the honest checkpoint): a page boundary between them must not skip the
    other (``/v1/audit/checkpoints``' cursor carries the nonce; an old three-part cursor still
    reads)."""
    chain_id = "node-cp-twin"

    async def run() -> None:
        writer, engine = await _writer(ledger.url, chain_id)
        try:
            await writer.append(_put(0))
            assert await writer.write_checkpoint() is not None
        finally:
            await writer.close()
            engine.dispose()

    asyncio.run(run())
    cps = table(Checkpoint)
    with ledger.attacker.begin() as conn:
        honest = conn.execute(sa.select(cps).where(cps.c.chain_id == chain_id)).one()
        for nonce in ("0", "zz"):  # one sorts before the honest '' key, one after
            conn.execute(
                cps.insert().values(
                    chain_id=chain_id,
                    seq=honest.seq,
                    nonce=nonce,
                    head_hash="0" * 64,
                    signed_at=honest.signed_at,
                    signature=b"\0" * 64,
                    public_key=b"\0" * 32,
                )
            )
    seen: list[str] = []
    after = None
    with Session(ledger.attacker) as session:
        while True:
            page = list_checkpoints(session, chain_id=chain_id, after=after, limit=1)
            if not page:
                break
            seen.append(page[0].nonce)
            cursor = encode_cursor((page[0].signed_at, chain_id, page[0].seq, page[0].nonce))
            after = checkpoint_key(cursor)
    assert sorted(seen) == ["", "0", "zz"], seen
    old = checkpoint_key(encode_cursor((honest.signed_at, chain_id, honest.seq)))
    assert old == (honest.signed_at, chain_id, honest.seq, "")

"""``kvgov audit verify`` against an attacker who bypasses the append-only guard.

Each test builds a real ledger with the real writer (two chains, a signed checkpoint in the
middle of one), then tampers with it the way a database superuser would (Postgres: ``ALTER
TABLE ... DISABLE TRIGGER ALL``; SQLite: drop the guard triggers) and runs the CLI.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from typer.testing import CliRunner

from kvgov.cli.main import build_app
from kvgov.db.engine import make_engine
from kvgov.db.models import Checkpoint, LedgerEvent, table
from kvgov.errors import LedgerError
from kvgov.ledger.chain import (
    ChainedFields,
    link,
    load_signing_key,
    public_key_bytes,
    sign_checkpoint,
)
from kvgov.ledger.checkpoint import write_checkpoint
from kvgov.ledger.events import EntryChange, Event
from kvgov.ledger.trust import format_public_key
from kvgov.ledger.writer import LedgerWriter
from kvgov.types import EntryState, EventKind, Outcome

pytestmark = pytest.mark.postgres

CHAIN = "node-a"
OTHER = "node-b"


@dataclass
class Ledger:
    url: str
    env: dict[str, str]
    runner: CliRunner

    def cli(self, *args: str) -> Any:
        return self.runner.invoke(build_app(), list(args), env=self.env)

    def verify(self) -> tuple[int, dict[str, Any]]:
        result = self.cli("audit", "verify", "--json")
        return result.exit_code, json.loads(result.stdout)

    def chain(self, report: dict[str, Any], chain_id: str = CHAIN) -> dict[str, Any]:
        return next(c for c in report["chains"] if c["chain_id"] == chain_id)


def _event(i: int) -> Event:
    return Event(
        kind=EventKind.KV_PUT if i % 3 else EventKind.KV_GET,
        tenant="acme",
        actor=f"{i % 4:032x}",
        request_id=f"req-{i // 2}",
        key_digest=f"{i:064x}",
        tier="memory",
        nbytes=1000 + i,
        outcome=Outcome.OK,
        attrs={"chunk": i, "model": "llama"},
        entry=EntryChange(key_digest=f"{i:064x}", state=EntryState.LIVE, tenant="acme"),
    )


async def _write(url: str, chain_id: str, key: Ed25519PrivateKey, n: int, cp_at: int) -> None:
    engine = make_engine(url)
    writer = LedgerWriter(engine, chain_id=chain_id, signing_key=key)
    await writer.start()
    for i in range(1, n + 1):
        await writer.append(_event(i))
        if i == cp_at:
            assert await writer.write_checkpoint() is not None
    await writer.close()
    engine.dispose()


@pytest.fixture
def ledger(db_url: str, tmp_path: Path) -> Iterator[Ledger]:
    env = {"KVGOV_DATABASE_URL": db_url, "KVGOV_DATA_DIR": str(tmp_path / "data")}
    led = Ledger(db_url, env, CliRunner())
    assert led.cli("init").exit_code == 0
    key = load_signing_key(tmp_path / "data" / "ledger-signing.key")
    asyncio.run(_write(db_url, CHAIN, key, 12, cp_at=8))
    other = Ed25519PrivateKey.generate()
    asyncio.run(_write(db_url, OTHER, other, 5, cp_at=5))
    # node-b's key is distributed to this node as an operator configures it
    env["KVGOV_LEDGER__TRUSTED_KEYS"] = json.dumps([format_public_key(public_key_bytes(other))])
    code, report = led.verify()
    assert code == 0, report
    assert led.chain(report)["events"] == 12
    assert led.chain(report)["checkpoints"] == 1
    yield led


@contextmanager
def attacker(url: str) -> Iterator[sa.Connection]:
    """A superuser connection with the append-only guard switched off."""
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            if url.startswith("sqlite"):
                for table in ("ledger_events", "checkpoints", "chains"):
                    for action in ("update", "delete"):
                        conn.exec_driver_sql(f"DROP TRIGGER IF EXISTS {table}_no_{action}")
                yield conn
            else:
                for table in ("ledger_events", "checkpoints", "chains", "event_payloads"):
                    conn.exec_driver_sql(f"ALTER TABLE {table} DISABLE TRIGGER ALL")
                yield conn
                for table in ("ledger_events", "checkpoints", "chains", "event_payloads"):
                    conn.exec_driver_sql(f"ALTER TABLE {table} ENABLE TRIGGER ALL")
    finally:
        engine.dispose()


def _row(conn: sa.Connection, seq: int) -> dict[str, Any]:
    t = table(LedgerEvent)
    row = conn.execute(sa.select(t).where(t.c.chain_id == CHAIN, t.c.seq == seq)).one()
    return dict(row._mapping)


def _shift(conn: sa.Connection, from_seq: int, by: int) -> None:
    """Renumber events from ``from_seq`` on (in two steps, to dodge the primary key)."""
    params = {"c": CHAIN, "s": from_seq}
    conn.execute(
        sa.text("UPDATE ledger_events SET seq = -seq - 1000 WHERE chain_id = :c AND seq >= :s"),
        params,
    )
    conn.execute(
        sa.text(
            f"UPDATE ledger_events SET seq = -seq - 1000 + {by} WHERE chain_id = :c AND seq < 0"
        ),
        {"c": CHAIN},
    )


def assert_broken(ledger: Ledger, problem: str, seq: int) -> None:
    code, report = ledger.verify()
    assert code == 1
    assert report["ok"] is False
    first = ledger.chain(report)["first_bad"]
    assert (first["problem"], first["seq"]) == (problem, seq), first
    # the other chain is reported intact
    assert ledger.chain(report, OTHER)["ok"] is True
    text = ledger.cli("audit", "verify")
    assert text.exit_code == 1
    assert f"BROKEN {CHAIN}: {problem} at seq {seq}" in text.stdout


def test_intact_ledger_verifies(ledger: Ledger) -> None:
    result = ledger.cli("audit", "verify")
    assert result.exit_code == 0
    assert f"ok     {CHAIN}: 12 events, head 12, 1 checkpoints" in result.stdout


def test_modified_field_is_detected(ledger: Ledger) -> None:
    with attacker(ledger.url) as conn:
        conn.execute(
            sa.text("UPDATE ledger_events SET nbytes = 1 WHERE chain_id = :c AND seq = 5"),
            {"c": CHAIN},
        )
    assert_broken(ledger, "modified", 5)


def test_modified_attrs_are_detected(ledger: Ledger) -> None:
    with attacker(ledger.url) as conn:
        conn.execute(
            sa.text("UPDATE ledger_events SET attrs = :a WHERE chain_id = :c AND seq = 10"),
            {"c": CHAIN, "a": json.dumps({"chunk": 10, "model": "other"})},
        )
    assert_broken(ledger, "modified", 10)


def test_deleted_row_is_detected(ledger: Ledger) -> None:
    with attacker(ledger.url) as conn:
        conn.execute(
            sa.text("DELETE FROM ledger_events WHERE chain_id = :c AND seq = 4"), {"c": CHAIN}
        )
    assert_broken(ledger, "deleted", 4)


def test_deleted_and_renumbered_rows_are_detected(ledger: Ledger) -> None:
    with attacker(ledger.url) as conn:
        conn.execute(
            sa.text("DELETE FROM ledger_events WHERE chain_id = :c AND seq = 4"), {"c": CHAIN}
        )
        _shift(conn, 5, -1)
    code, report = ledger.verify()
    assert code == 1
    assert ledger.chain(report)["first_bad"]["seq"] == 4


def test_truncated_tail_is_caught_by_the_checkpoint(ledger: Ledger) -> None:
    with attacker(ledger.url) as conn:
        conn.execute(
            sa.text("DELETE FROM ledger_events WHERE chain_id = :c AND seq >= 7"), {"c": CHAIN}
        )
    assert_broken(ledger, "checkpoint_mismatch", 7)


def test_forged_row_inserted_in_the_middle_is_detected(ledger: Ledger) -> None:
    with attacker(ledger.url) as conn:
        _shift(conn, 5, 1)
        forged = _row(conn, 4)
        forged.update(seq=5, prev_hash=forged["hash"], kind="kv:delete", nbytes=0)
        forged["occurred_at"] = datetime.now(UTC)
        attrs = json.loads(forged["attrs"]) if isinstance(forged["attrs"], str) else forged["attrs"]
        fields = ChainedFields(
            **{k: v for k, v in forged.items() if k != "hash"} | {"attrs": attrs}
        )
        forged["hash"] = link(fields)  # the attacker knows the algorithm
        forged["attrs"] = json.dumps(attrs)
        cols = ", ".join(forged)
        conn.execute(
            sa.text(f"INSERT INTO ledger_events ({cols}) VALUES (:{', :'.join(forged)})"), forged
        )
    assert_broken(ledger, "inserted", 5)


def test_swapped_rows_are_detected(ledger: Ledger) -> None:
    with attacker(ledger.url) as conn:
        params = {"c": CHAIN}
        for a, b in ((3, -3), (6, 3), (-3, 6)):
            conn.execute(
                sa.text(f"UPDATE ledger_events SET seq = {b} WHERE chain_id = :c AND seq = {a}"),
                params,
            )
    assert_broken(ledger, "reordered", 3)


def test_rewritten_chain_with_recomputed_hashes_is_caught_by_the_checkpoint(
    ledger: Ledger,
) -> None:
    with attacker(ledger.url) as conn:
        prev = _row(conn, 2)["hash"]
        for seq in range(3, 13):
            row = _row(conn, seq)
            row.update(prev_hash=prev, nbytes=0 if seq == 3 else row["nbytes"])
            digest = link(ChainedFields(**{k: v for k, v in row.items() if k != "hash"}))
            conn.execute(
                sa.text(
                    "UPDATE ledger_events SET prev_hash = :p, hash = :h, nbytes = :n "
                    "WHERE chain_id = :c AND seq = :s"
                ),
                {"p": prev, "h": digest, "n": row["nbytes"], "c": CHAIN, "s": seq},
            )
            prev = digest
    assert_broken(ledger, "checkpoint_mismatch", 8)


def test_forged_checkpoint_signature_is_detected(ledger: Ledger) -> None:
    with attacker(ledger.url) as conn:
        head = _row(conn, 12)
        pk = conn.execute(
            sa.text("SELECT public_key FROM chains WHERE chain_id = :c"), {"c": CHAIN}
        ).scalar_one()
        conn.execute(
            sa.text(
                "INSERT INTO checkpoints (chain_id, seq, head_hash, signed_at, signature, "
                "public_key) VALUES (:c, 12, :h, :t, :sig, :pk)"
            ),
            {"c": CHAIN, "h": head["hash"], "t": datetime.now(UTC), "sig": b"\x07" * 64, "pk": pk},
        )
    assert_broken(ledger, "bad_signature", 12)


def test_altered_checkpoint_is_detected(ledger: Ledger) -> None:
    with attacker(ledger.url) as conn:
        conn.execute(
            sa.text("UPDATE checkpoints SET head_hash = :h WHERE chain_id = :c"),
            {"c": CHAIN, "h": "ab" * 32},
        )
    assert_broken(ledger, "bad_signature", 8)


def test_checkpoint_signed_by_another_key_is_detected(ledger: Ledger) -> None:
    mallory = Ed25519PrivateKey.generate()
    with attacker(ledger.url) as conn:
        conn.execute(
            sa.text("UPDATE chains SET public_key = :pk WHERE chain_id = :c"),
            {"c": CHAIN, "pk": public_key_bytes(mallory)},
        )
    engine = make_engine(ledger.url)
    try:
        # kvgov's own checkpoint refuses: the chain's genesis is not signed by her key
        with pytest.raises(LedgerError, match="no genesis signed by this key"):
            write_checkpoint(engine, CHAIN, mallory)
        with attacker(ledger.url) as conn:  # so she re-signs the head with her key herself
            ev = table(LedgerEvent)
            seq, head = conn.execute(
                sa.select(ev.c.seq, ev.c.hash)
                .where(ev.c.chain_id == CHAIN)
                .order_by(ev.c.seq.desc())
                .limit(1)
            ).one()
            now = datetime.now(UTC)
            conn.execute(
                table(Checkpoint)
                .insert()
                .values(
                    chain_id=CHAIN,
                    seq=seq,
                    head_hash=head,
                    signed_at=now,
                    signature=sign_checkpoint(mallory, CHAIN, seq, head, now),
                    public_key=public_key_bytes(mallory),
                )
            )
    finally:
        engine.dispose()
    # the swapped chain key is not a trusted one, and the genuine checkpoint at 8 no longer
    # matches it
    assert_broken(ledger, "untrusted_key", 0)
    result = ledger.cli("audit", "verify", "--json", "--trust-key", _signing_key_path(ledger))
    assert result.exit_code == 1
    findings = ledger.chain(json.loads(result.stdout))["findings"]
    assert {(f["problem"], f["seq"]) for f in findings} >= {("key_mismatch", 8)}


def _signing_key_path(ledger: Ledger) -> str:
    return str(Path(ledger.env["KVGOV_DATA_DIR"]) / "ledger-signing.key")


def test_checkpoint_command_signs_this_nodes_chain(ledger: Ledger) -> None:
    result = ledger.cli("audit", "checkpoint", "--note")
    assert result.exit_code == 0, result.output
    assert f"{CHAIN}: signed seq 12" in result.stdout
    assert "kvgov.ledger/v1 node-a\n12\n" in result.stdout
    assert OTHER not in result.stdout  # not this node's key
    again = ledger.cli("audit", "checkpoint")
    assert "already signed" in again.stdout
    code, report = ledger.verify()
    assert code == 0
    assert ledger.chain(report)["checkpoints"] == 2

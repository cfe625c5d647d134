"""``kvgov audit journal``: the local ledger journal as an operator reads it, against a real
Postgres mark; read-only (nothing cut off, no lock taken), exit 1 when a start would refuse it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from typer.testing import CliRunner

from kvgov.cli.main import build_app
from kvgov.db.engine import make_engine, upgrade
from kvgov.ledger.events import Event
from kvgov.ledger.journal import Journal, encode_event
from kvgov.ledger.writer import LedgerWriter
from kvgov.types import EventKind

pytestmark = pytest.mark.postgres

CHAIN = "node-j"


def journal_with_unapplied(pg_url: str, d: Path) -> None:
    """Three events committed through the journal (mark 3), then two more journaled that
    the database never got (a crash, as the next start would find it)."""
    upgrade(pg_url)
    engine = make_engine(pg_url)

    async def committed() -> None:
        writer = LedgerWriter(
            engine, chain_id=CHAIN, signing_key=Ed25519PrivateKey.generate(), journal=Journal(d)
        )
        await writer.start()
        await asyncio.gather(
            *(writer.submit_queued(Event(kind=EventKind.KV_PUT, nbytes=i)) for i in range(3))
        )
        await writer.close()

    asyncio.run(committed())
    engine.dispose()
    j = Journal(d)
    assert j.open(3, chain_id=CHAIN) == []
    for i in range(2):
        j.append(encode_event(Event(kind=EventKind.KV_GET, nbytes=i)))
    j.sync()
    j.close(applied_upto=3)


def run(pg_url: str, *args: str) -> tuple[int, str]:
    env = {"KVGOV_DATABASE__URL": pg_url}
    result = CliRunner().invoke(build_app(), ["audit", "journal", *args], env=env)
    return result.exit_code, result.stdout


def test_unapplied_records_are_counted_against_the_mark(pg_url: str, tmp_path: Path) -> None:
    d = tmp_path / "journal"
    journal_with_unapplied(pg_url, d)
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    code, out = run(pg_url, "--dir", str(d), "--json")
    assert code == 0, out
    report = json.loads(out)
    assert report["chain_id"] == CHAIN
    assert report["mark"] == 3 and report["unapplied"] == 2
    assert report["in_use"] is False and report["blocks_start"] is False
    assert [(s["first"], s["last"], s["records"]) for s in report["segments"]] == [(4, 5, 2)]
    code, out = run(pg_url, "--dir", str(d))
    assert code == 0
    assert f"chain '{CHAIN}', not in use" in out
    assert "records 4-5 (2)" in out and "records after it: 2" in out
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before  # read-only


def test_damage_a_start_would_refuse_exits_1(pg_url: str, tmp_path: Path) -> None:
    d = tmp_path / "journal"
    journal_with_unapplied(pg_url, d)
    (d / "journal-00000000000000000001.log").write_bytes(b"not a segment")
    code, out = run(pg_url, "--dir", str(d))
    assert code == 1
    assert "DAMAGED: not a kvgov journal segment" in out
    assert "a sidecar start would refuse this journal" in out


def test_a_journal_in_use_says_so(pg_url: str, tmp_path: Path) -> None:
    d = tmp_path / "journal"
    journal_with_unapplied(pg_url, d)
    held = Journal(d)
    held.open(3, chain_id=CHAIN)  # what a running sidecar holds
    try:
        code, out = run(pg_url, "--dir", str(d), "--json")
        assert code == 0
        assert json.loads(out)["in_use"] is True
    finally:
        held.close(applied_upto=3)


def test_no_journal_directory(pg_url: str, tmp_path: Path) -> None:
    code, out = run(pg_url, "--dir", str(tmp_path / "nowhere"))
    assert code == 0 and "no ledger journal at" in out

"""Attack (review r14, F3): junk ``checkpoints`` rows cost every receipt, job document, purge
list and debt restore one Ed25519 signature check each.

The runtime database role may INSERT into ``checkpoints``, copying the chain's public key (so the
cheap key comparison passes), and migration 0013's nonce lets any number of rows share one
position. :class:`kvgov.ledger.purge_trail._Signed` found the highest checkpoint signed within
a writer session's span by paging rows from the highest position down (``LIMIT 64 OFFSET n``)
and checking each signature until one verified; a live session's span has no end, so every
junk row at any position past the head was checked, by each purge's cross-check (inside the
finishing transaction), its job document, the purge list and a restart's ``proven_debts``, and
the ``OFFSET`` scans grew quadratically.

Now every reader goes through :func:`kvgov.ledger.checkpoint_scan.verified_checkpoints`: rows
past the chain's head are never read, a row naming another head than the chain's costs no
signature check, paging is by key, and a lookup examines at most ``MAX_EXAMINED`` rows: rows
that pass every SQL filter (at positions of the unsigned tail, whose hashes the role can read)
stop it there, logged and counted, and what it was to prove is not counted as signed (fail
closed) until the writer signs its head again.

Postgres, as the runtime role a sidecar has.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import Connection, text
from sqlalchemy.orm import Session

import kvgov.ledger.checkpoint_scan as scan
import kvgov.ledger.purge_trail as trail
from kvgov.db.engine import utcnow
from kvgov.db.purge_views import PurgeRequest
from kvgov.ledger.chain import checkpoint_signature_ok, public_key_bytes
from kvgov.ledger.checkpoint import latest_checkpoint
from kvgov.ledger.events import Event
from kvgov.proxy.app import Sidecar
from kvgov.types import EventKind
from tests.security import doors
from tests.security.test_purge_late_evict import _sidecar

pytestmark = pytest.mark.postgres

#: junk rows the attacker inserts (a real one would insert millions)
JUNK = 600


def _counting(monkeypatch: pytest.MonkeyPatch) -> Callable[[], int]:
    """Count the Ed25519 checkpoint checks from now on (the memo of earlier results cleared)."""
    checked = 0

    def counting(*args: object, **kwargs: object) -> bool:
        nonlocal checked
        checked += 1
        return checkpoint_signature_ok(*args, **kwargs)  # type: ignore[arg-type]

    scan._verifies.cache_clear()
    monkeypatch.setattr(scan, "checkpoint_signature_ok", counting)
    return lambda: checked


def _flood(conn: Connection, chain: str, seqs: list[int], head_hash: str | None) -> None:
    """Insert a junk checkpoint at each of ``seqs`` as the runtime role: the chain's own
    public key (readable), a random nonce, a junk signature, and ``head_hash`` (None: zeros)."""
    key = conn.execute(
        text("SELECT public_key FROM chains WHERE chain_id = :c"), {"c": chain}
    ).scalar_one()
    conn.execute(
        text(
            "INSERT INTO checkpoints (chain_id, seq, nonce, head_hash, signed_at, "
            "signature, public_key) VALUES (:c, :s, :n, :h, :t, :g, :k)"
        ),
        [
            {
                "c": chain,
                "s": seq,
                "n": secrets.token_hex(4),
                "h": head_hash or "0" * 64,
                "t": utcnow(),
                "g": b"\0" * 64,
                "k": bytes(key),
            }
            for seq in seqs
        ],
    )


def _capped(sc: Sidecar) -> float:
    value = sc.metrics.registry.get_sample_value("kvgov_ledger_checkpoint_scans_capped")
    return value or 0.0


async def test_junk_checkpoints_past_the_head_cost_no_signature_check(
    tmp_path: Path, prod_db: doors.ProdDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with _sidecar(tmp_path, prod_db) as sc:
        assert sc.purge is not None and sc.engine is not None and sc.writer is not None
        service = sc.purge.service
        job = await service.create(PurgeRequest(tenant="acme", user="alice", requested_by="t"))
        job = await service.wait(job.id)
        assert job.finished
        chain = sc.writer.chain_id
        with sc.engine.begin() as conn:  # the runtime role
            _flood(conn, chain, [10**12 + i for i in range(JUNK)], None)
        checked = _counting(monkeypatch)
        trusted = {public_key_bytes(service._signing_key)}
        with Session(sc.engine) as s:
            steps = trail.chained_steps(s, job.id, job.tenant, trusted)
        assert steps, "the honest steps must still count"
        assert checked() <= 64, (
            f"{JUNK} junk checkpoint rows past the head of chain {chain} cost one purge "
            f"cross-check {checked()} Ed25519 signature checks (one per junk row, OFFSET-paged)"
        )
        # nor does the receipt's named checkpoint (the newest that verifies) pay for them
        signed = latest_checkpoint(sc.engine, chain)
        assert signed is not None and signed.seq < 10**12
        assert checked() <= 64, f"the receipt's checkpoint cost {checked()} signature checks"
        # an honest purge after the flood still gets its receipt signed completed
        after = await doors.purge(sc, "acme", "bob")
        assert doors.receipt(after)["state"] == "completed", doors.receipt(after)


async def test_junk_checkpoints_on_the_chain_stop_at_the_cap_and_fail_closed(
    tmp_path: Path,
    prod_db: doors.ProdDatabase,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with _sidecar(tmp_path, prod_db) as sc:
        assert sc.purge is not None and sc.engine is not None and sc.writer is not None
        service = sc.purge.service
        job = await doors.purge(sc, "acme", "alice")
        assert doors.receipt(job)["state"] == "completed"
        # the chain moves on past its last checkpoint (an unsigned tail, normal between them)
        await sc.writer.append(Event(kind=EventKind.KV_MISS, tenant="acme"))
        chain = sc.writer.chain_id
        with sc.engine.begin() as conn:  # the runtime role reads the tail's hash
            head, head_hash = conn.execute(
                text(
                    "SELECT seq, hash FROM ledger_events WHERE chain_id = :c "
                    "ORDER BY seq DESC LIMIT 1"
                ),
                {"c": chain},
            ).one()
            _flood(conn, chain, [head] * JUNK, head_hash)
        checked = _counting(monkeypatch)
        trusted = {public_key_bytes(service._signing_key)}
        before = _capped(sc)
        with caplog.at_level(logging.WARNING), Session(sc.engine) as s:
            steps = trail.chained_steps(s, job.id, job.tenant, trusted)
        assert checked() <= scan.MAX_EXAMINED, (
            f"{JUNK} junk checkpoint rows at the head of chain {chain} (its own hash there) "
            f"cost one purge cross-check {checked()} Ed25519 signature checks"
        )
        # fail closed, and loud: the lookup stopped, so nothing it was to prove counts
        assert not steps
        assert any(r.message == "ledger.checkpoint.scan_capped" for r in caplog.records)
        assert _capped(sc) == before + 1
        # the writer signs its head again (plain nonce first): the honest steps count again
        assert await sc.writer.write_checkpoint() is not None
        with Session(sc.engine) as s:
            assert trail.chained_steps(s, job.id, job.tenant, trusted)

"""``audit verify`` and the shapes of ``event_payloads`` rows, on Postgres with the real roles.

The runtime role holds UPDATE on ``event_payloads`` (erasure), so with its credentials one can
write any combination of ``payload``, ``salt`` and ``erased_at``. Only two shapes are
consistent: kept (payload and salt present, not erased, hashing to the chained digest) and
erased (no payload, ``erased_at`` stamped). Every other shape must fail verification, naming
the chain and the position but never the payload; erasure through the real code paths must
still verify.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pytest
import sqlalchemy as sa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kvgov.db.engine import make_engine, make_sessionmaker, upgrade
from kvgov.db.models import EventPayload
from kvgov.ledger.events import Event
from kvgov.ledger.repository import LedgerRepository
from kvgov.ledger.verify import Problem, VerifyReport, verify
from kvgov.ledger.writer import LedgerWriter
from kvgov.services.purge import scope
from kvgov.types import EventKind, Outcome
from tests.pgroles import role_database

pytestmark = pytest.mark.postgres

CHAIN = "payload-shapes"
ALICE, BOB = "a" * 32, "b" * 32
#: what a forger writes; it must never show up in a report
FORGED = {"path": "/v1/healthz", "who": "forged-by-mallory"}


@dataclass
class Ledger:
    runtime: sa.Engine  # the runtime role, as a sidecar (or a thief of its credentials) connects

    def set_row(self, seq: int, **values: Any) -> None:
        with self.runtime.begin() as conn:
            n = conn.execute(
                sa.update(EventPayload)
                .where(EventPayload.chain_id == CHAIN, EventPayload.seq == seq)
                .values(**values)
            ).rowcount
        assert n == 1

    def row(self, seq: int) -> Any:
        with self.runtime.connect() as conn:
            return conn.execute(
                sa.select(EventPayload).where(
                    EventPayload.chain_id == CHAIN, EventPayload.seq == seq
                )
            ).one()


async def _write(url: str) -> None:
    """seq 1 (alice), 2 (bob), 4 (alice) carry payloads; seq 3 carries none."""
    engine = make_engine(url)
    writer = LedgerWriter(engine, chain_id=CHAIN, signing_key=Ed25519PrivateKey.generate())
    await writer.start()
    for actor, payload in (
        (ALICE, {"path": "/v1/purges/1", "who": "alice"}),
        (BOB, {"path": "/v1/purges/2", "who": "bob"}),
        (BOB, None),
        (ALICE, {"path": "/v1/purges/4", "who": "alice"}),
    ):
        await writer.append(
            Event(
                kind=EventKind.API_ACCESS,
                tenant="acme",
                actor=actor,
                principal="admin:alice",
                outcome=Outcome.ALLOW,
                payload=payload,
            )
        )
    assert await writer.write_checkpoint() is not None
    await writer.close()
    engine.dispose()


@pytest.fixture
def ledger() -> Iterator[Ledger]:
    with role_database() as db:
        upgrade(db.owner_url, runtime_role=db.runtime)
        asyncio.run(_write(db.runtime_url))
        engine = make_engine(db.runtime_url)
        try:
            led = Ledger(engine)
            assert verify(engine).ok
            yield led
        finally:
            engine.dispose()


def _assert_reported(report: VerifyReport, seq: int, words: str) -> None:
    assert not report.ok
    chain = next(c for c in report.chains if c.chain_id == CHAIN)
    first = chain.first_bad
    assert first is not None
    assert (first.problem, first.seq) == (Problem.PAYLOAD_MISMATCH, seq), first
    assert words in first.detail, first.detail
    # the report names the chain and position, never payload contents
    text = json.dumps(report.to_dict())
    for secret in ("forged-by-mallory", "/v1/healthz", "/v1/purges/", '"who"'):
        assert secret not in text


def test_verify_untouched_ledger_is_clean(ledger: Ledger) -> None:
    # a guard against a fix that is too strict: nothing was changed, nothing may be reported
    report = verify(ledger.runtime)
    assert report.ok, report.to_dict()
    chain = report.chains[0]
    assert (chain.chain_id, chain.events, chain.findings) == (CHAIN, 4, [])


def test_verify_reports_payload_rewritten_with_its_salt_nulled(ledger: Ledger) -> None:
    """The attack: the runtime role drops the salt and writes another payload, not erased."""
    ledger.set_row(2, salt=None, payload=FORGED)
    row = ledger.row(2)
    assert row.payload == FORGED and row.salt is None and row.erased_at is None
    _assert_reported(verify(ledger.runtime), 2, "without its salt")


# each shape a row must never have, from an untouched kept row at seq 2
SHAPES: dict[str, tuple[dict[str, Any], str]] = {
    "payload_without_salt": ({"salt": None}, "without its salt"),
    "salt_without_payload": ({"payload": None}, "not marked erased"),
    "nulls_without_erased_at": ({"payload": None, "salt": None}, "not marked erased"),
    "erased_at_with_payload_and_salt": ({"erased_at": "now"}, "marked erased but still present"),
    "erased_at_with_payload_no_salt": (
        {"salt": None, "erased_at": "now"},
        "marked erased but still present",
    ),
    "erased_at_with_forged_payload": (
        {"salt": None, "payload": FORGED, "erased_at": "now"},
        "marked erased but still present",
    ),
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_verify_reports_each_inconsistent_payload_shape(ledger: Ledger, shape: str) -> None:
    values, words = SHAPES[shape]
    ledger.set_row(2, **{k: datetime.now(UTC) if v == "now" else v for k, v in values.items()})
    _assert_reported(verify(ledger.runtime), 2, words)


def test_verify_reports_a_payload_row_for_an_event_without_one(ledger: Ledger) -> None:
    # seq 3 chained no payload digest: even an "erased" row for it was not written by kvgov
    with ledger.runtime.begin() as conn:
        conn.execute(
            sa.insert(EventPayload).values(
                chain_id=CHAIN, seq=3, salt=None, payload=None, erased_at=datetime.now(UTC)
            )
        )
    _assert_reported(verify(ledger.runtime), 3, "commits to no payload")


def test_verify_erasure_by_repository_is_clean_and_stays_checked(ledger: Ledger) -> None:
    with make_sessionmaker(ledger.runtime)() as session:
        assert LedgerRepository(session).erase_payloads(tenant="acme", actor=ALICE) == 2
        session.commit()
    for seq in (1, 4):
        row = ledger.row(seq)
        assert (row.payload, row.salt) == (None, None) and row.erased_at is not None
    report = verify(ledger.runtime)
    assert report.ok, report.to_dict()
    # an erased row cannot be filled again with content the chain never committed to
    ledger.set_row(4, payload=FORGED)
    _assert_reported(verify(ledger.runtime), 4, "marked erased but still present")


def test_verify_erasure_by_purge_service_is_clean_and_stays_checked(ledger: Ledger) -> None:
    # the purge state machine's erasure (scope.erase_payloads) drops payload and salt (a kept
    # salt would let anyone confirm a guessed payload against the chained digest)
    with make_sessionmaker(ledger.runtime)() as session:
        assert scope.erase_payloads(session, "acme", ALICE, now=datetime.now(UTC)) == 2
        session.commit()
    row = ledger.row(1)
    assert row.payload is None and row.salt is None and row.erased_at is not None
    report = verify(ledger.runtime)
    assert report.ok, report.to_dict()
    # "un-erasing" it leaves no payload and no salt without erased_at
    ledger.set_row(1, erased_at=None)
    _assert_reported(verify(ledger.runtime), 1, "not marked erased")
    # an erasure of an earlier release kept the salt: still an erasure (nothing to forge)
    ledger.set_row(1, salt=b"\x00" * 16, erased_at=datetime.now(UTC))
    assert verify(ledger.runtime).ok

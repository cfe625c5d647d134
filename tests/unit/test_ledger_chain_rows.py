"""The writer's chaining (``ledger.batch.chain_rows``) against the reference encoding, and the
encoding pinned: a ledger written today must verify with every later kvgov, so a change to
what is hashed, or how, must fail here (no database)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from kvgov.ledger.batch import chain_rows, prepare
from kvgov.ledger.chain import ENCODING_VERSION, GENESIS_HASH, ChainedFields, link
from kvgov.ledger.events import Event
from kvgov.ledger.pgfast import EVENT_COLUMNS
from kvgov.types import EventKind, Outcome

AT = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)

#: link() of the first event below at seq 1 on an empty chain "node-a", and of the second
#: after it: computed once with the encoding of ENCODING_VERSION 1 and never to change
PINNED = (
    "d06b6133f8c7fb88a48f219b49a196e97cf881b67000fb67cbea10be4673fd7c",
    "95996f27814820b0c3b0fee9a7ba8d8f817cb871c90e2d4a61aae7b88b71d90a",
)


def _events() -> list[Event]:
    return [
        Event(
            kind=EventKind.KV_PUT,
            tenant="acme",
            actor="a" * 32,
            request_id="req-1",
            key_digest="b" * 64,
            tier="memory",
            nbytes=4096,
            outcome=Outcome.OK,
            decision_id="d-1",
            policy_revision="rev-7",
            principal="engine-1",
            attrs={"model": "llama", "chunk": 3},
            occurred_at=AT,
        ),
        Event(
            kind=EventKind.KV_DENIED,
            tenant="acme",
            reason='quote " and \\ and \n ünïcødé',
            outcome=Outcome.DENY,
            occurred_at=AT,
        ),
    ]


def _as_fields(row: tuple[Any, ...]) -> tuple[ChainedFields, str]:
    values = dict(zip(EVENT_COLUMNS, row, strict=True))
    digest = values.pop("hash")
    attrs = values.pop("attrs")
    values["attrs"] = json.loads(attrs)
    return ChainedFields(**values), digest


def test_chain_rows_hash_what_the_reference_encoding_hashes_and_link_in_order() -> None:
    rows, head = chain_rows("node-a", (0, GENESIS_HASH), [prepare(e) for e in _events()])
    assert len(rows) == 2
    prev = GENESIS_HASH
    for seq, (row, event) in enumerate(zip(rows, _events(), strict=True), start=1):
        fields, digest = _as_fields(row)
        assert (fields.seq, fields.prev_hash, fields.encoding_version) == (seq, prev, 1)
        assert fields.kind == str(event.kind)
        assert fields.tenant == event.tenant
        assert fields.reason == event.reason
        assert fields.occurred_at == event.occurred_at
        assert link(fields) == digest
        prev = digest
    assert head == (2, prev)
    assert ENCODING_VERSION == 1


def test_the_encoding_is_pinned() -> None:
    rows, _ = chain_rows("node-a", (0, GENESIS_HASH), [prepare(e) for e in _events()])
    assert tuple(_as_fields(row)[1] for row in rows) == PINNED

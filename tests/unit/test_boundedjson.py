"""The bounded JSON decoder every engine reads JSON columns with (review r14, F1/F2)."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from kvgov.boundedjson import (
    MAX_JSON_BYTES,
    MAX_JSON_DEPTH,
    UNDECODABLE_KEY,
    bounded_dumps,
    bounded_loads,
    is_undecodable,
    nested_within,
)
from kvgov.errors import LedgerError
from kvgov.ledger.batch import prepare
from kvgov.ledger.chain import UNDECODABLE_LINK, ChainedFields, is_chain_hash, link
from kvgov.ledger.events import Event
from kvgov.types import EventKind


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize(
    ("text", "within"),
    [
        ("{}", True),
        (_nested(MAX_JSON_DEPTH), True),
        (_nested(MAX_JSON_DEPTH + 1), False),
        ('{"a":' * (MAX_JSON_DEPTH + 1) + "1" + "}" * (MAX_JSON_DEPTH + 1), False),
        ("[" + ",[1]" * 1000 + "]", True),  # wide, not deep
        (json.dumps({"s": "[" * 1000, "t": '\\"{{{{'}), True),  # brackets inside strings
        ("[" * 100, False),  # brackets that never close: not JSON
    ],
)
def test_depth_is_found_without_recursion(text: str, within: bool) -> None:
    assert nested_within(text) is within
    assert nested_within(text.encode()) is within


@pytest.mark.parametrize(
    "stored",
    [
        _nested(5000).encode(),  # psycopg hands bytes
        _nested(100_000),
        "not json",  # SQLite keeps any text
        "1" * 5000,  # past Python's int digit limit: ValueError
        b"\xff\xfe",
        b" " * (MAX_JSON_BYTES + 1),
    ],
)
def test_what_is_past_the_bounds_reads_as_a_fresh_marker(stored: str | bytes) -> None:
    first, second = bounded_loads(stored), bounded_loads(stored)
    assert is_undecodable(first) and is_undecodable(second) and first is not second
    assert set(first) == {UNDECODABLE_KEY}
    json.dumps(first)  # an API response shows it as it is


def test_a_value_within_the_bounds_reads_as_json_does() -> None:
    value = {"a": [1, {"b": None}], "c": "[[[["}
    assert bounded_loads(json.dumps(value).encode()) == value
    assert not is_undecodable(bounded_loads(json.dumps(dict(bounded_loads("x")))))


def test_the_marker_matches_no_hash() -> None:
    """A row read back with the marker has no hash to match, whatever its stored hash."""
    fields = ChainedFields(
        **dict.fromkeys(ChainedFields.__dataclass_fields__)
        | {
            "chain_id": "c",
            "seq": 1,
            "prev_hash": "0" * 64,
            "occurred_at": datetime.now(UTC),
            "kind": "kv:get",
            "attrs": bounded_loads(_nested(5000)),
            "encoding_version": 1,
        }
    )
    assert link(fields) == UNDECODABLE_LINK
    assert not is_chain_hash(link(fields))


def test_nothing_is_written_that_would_not_read_back() -> None:
    with pytest.raises(ValueError, match="would not read back"):
        bounded_dumps(json.loads(_nested(MAX_JSON_DEPTH + 1)))
    with pytest.raises(ValueError, match="nested deeper"):
        bounded_dumps(_deep_list(5000))  # past the interpreter's own limit
    deep = {"x": json.loads(_nested(MAX_JSON_DEPTH + 1))}
    with pytest.raises(LedgerError, match="would not read back"):
        prepare(Event(kind=EventKind.KV_PUT, tenant="acme", attrs=deep))
    with pytest.raises(LedgerError, match="would not read back"):
        prepare(Event(kind=EventKind.KV_PUT, tenant="acme", attrs={"s": "x" * MAX_JSON_BYTES}))
    prepare(Event(kind=EventKind.KV_PUT, tenant="acme", attrs={"x": [[1]]}))


def _deep_list(depth: int) -> list[object]:
    value: list[object] = []
    for _ in range(depth):
        value = [value]
    return value

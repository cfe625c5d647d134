"""Bounded JSON for every JSON column the application reads and writes (review r14, F1/F2).

The runtime database role (every sidecar's) may INSERT ``ledger_events``, ``purge_jobs`` and
``purge_steps`` rows. A JSON value nested a few thousand deep is valid ``json``/``jsonb`` for
Postgres, but Python's decoder raises :class:`RecursionError` on it, an error no caller expected:
one forged row killed the purge executor of every sidecar that read it and hid every EVICT a
restarted sidecar owed. :func:`~kvgov.db.engine.make_engine` therefore gives every engine
:func:`bounded_loads` as its ``json_deserializer``: SQLAlchemy hands it to psycopg
(``set_json_loads`` on the engine's own adapters map, so it decodes the ``json`` and ``jsonb``
results of every query on the engine's connections: ORM, Core, ``text()`` and the ledger
writer's raw-connection fast path alike) and calls it for SQLite's JSON columns.

A value nested deeper than :data:`MAX_JSON_DEPTH`, larger than :data:`MAX_JSON_BYTES`, or not
JSON at all (SQLite keeps any text) decodes to a fresh :class:`Undecodable`: a small dict, so
an API response or a CLI report shows it as it is, that no reader mistakes for a real value
(it names no purge, no step, no summary) and that the chain's hash check never accepts
(:func:`kvgov.ledger.chain.link`, :mod:`kvgov.ledger.verify`): a row holding one proves
nothing and ``audit verify`` names it. Decoding never raises.

:func:`bounded_dumps` (the engines' ``json_serializer``) refuses to write what the decoder
would not read back, so an honest row is never taken for a forged one; the ledger writer
checks its events' ``attrs`` and payloads the same way before chaining them
(:func:`check_bounds`).
"""

from __future__ import annotations

import json
import logging
import re
from typing import AnyStr, Final

log = logging.getLogger(__name__)

#: deepest nesting of arrays and objects decoded (what kvgov writes is a few levels deep;
#: Python's own decoder and encoder stay far from the interpreter's recursion limit)
MAX_JSON_DEPTH: Final = 64
#: largest encoded value decoded, in bytes (what kvgov writes is a few kilobytes)
MAX_JSON_BYTES: Final = 16 * 1024 * 1024
#: the one key of :class:`Undecodable`
UNDECODABLE_KEY: Final = "kvgov:undecodable"
#: its value: what happened, without any of the value's content
UNDECODABLE_REASON: Final = (
    f"stored JSON value not decoded: not JSON, nested deeper than {MAX_JSON_DEPTH} or over "
    f"{MAX_JSON_BYTES} bytes (no kvgov process writes one)"
)


class Undecodable(dict[str, str]):
    """What a stored JSON value past the bounds decodes to: ``{UNDECODABLE_KEY:
    UNDECODABLE_REASON}``, a fresh one each time (a caller may change its copy). Told apart
    from any stored value by its type (:func:`is_undecodable`), never by its content."""


def undecodable() -> Undecodable:
    return Undecodable({UNDECODABLE_KEY: UNDECODABLE_REASON})


def is_undecodable(value: object) -> bool:
    """Whether ``value`` is what :func:`bounded_loads` gave for a value it did not decode."""
    return type(value) is Undecodable


# a JSON string (escapes included), then anything that is not a bracket, then an innermost
# empty pair: the same three for text (SQLite, checks before a write) and bytes (psycopg)
_STRING = r'"[^"\\]*(?:\\.[^"\\]*)*"'
_NOT_BRACKET = r"[^\[\]{}]+"
_PAIR = r"\[\]|\{\}"
_TEXT = tuple(re.compile(p, re.DOTALL) for p in (_STRING, _NOT_BRACKET, _PAIR))
_BYTES = tuple(re.compile(p.encode(), re.DOTALL) for p in (_STRING, _NOT_BRACKET, _PAIR))


def nested_within(text: str | bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the arrays and objects of the JSON ``text`` nest at most ``limit`` deep, found
    without recursion (False too for brackets that do not pair up: not JSON).

    Text with at most ``limit`` opening brackets is within at once (the usual case: two
    ``count`` calls). Otherwise strings and everything but brackets are removed, then the
    innermost empty pairs, once per level: at most ``limit`` passes over the text."""
    if isinstance(text, str):
        if text.count("[") + text.count("{") <= limit:
            return True
        return _pairs_within(text, _TEXT, "", limit)
    if text.count(b"[") + text.count(b"{") <= limit:
        return True
    return _pairs_within(text, _BYTES, b"", limit)


def _pairs_within(
    text: AnyStr, patterns: tuple[re.Pattern[AnyStr], ...], empty: AnyStr, limit: int
) -> bool:
    string, not_bracket, pair = patterns
    skeleton = not_bracket.sub(empty, string.sub(empty, text))
    for _ in range(limit):
        if not skeleton:
            return True
        skeleton = pair.sub(empty, skeleton)
    return not skeleton


def _oversized(text: str | bytes) -> bool:
    """Whether ``text`` is over :data:`MAX_JSON_BYTES` in UTF-8 (encoded only when its length
    alone does not settle it)."""
    if isinstance(text, bytes) or len(text) * 4 <= MAX_JSON_BYTES:
        return len(text) > MAX_JSON_BYTES
    return len(text.encode("utf-8", "surrogatepass")) > MAX_JSON_BYTES


def check_bounds(text: str) -> str | None:
    """Why the JSON ``text`` would not be decoded (None: it would be)."""
    if _oversized(text):
        return f"larger than {MAX_JSON_BYTES} bytes"
    if not nested_within(text):
        return f"nested deeper than {MAX_JSON_DEPTH}"
    return None


def bounded_loads(data: str | bytes | bytearray | memoryview) -> object:
    """``json.loads`` for a value read from the database: :func:`undecodable` for one past
    the bounds or not JSON (logged by its size only), never an exception."""
    text = bytes(data) if isinstance(data, (bytearray, memoryview)) else data
    if _oversized(text):
        return _refused("size", len(text))
    if not nested_within(text):
        return _refused("depth", len(text))
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # not JSON (SQLite keeps any text), or bad UTF-8
        return _refused("invalid", len(text))


def _refused(why: str, size: int) -> Undecodable:
    log.warning("db.json.undecodable", extra={"why": why, "bytes": size})
    return undecodable()


def bounded_dumps(value: object) -> str:
    """``json.dumps`` for a value written to the database, refusing (``ValueError``) what
    :func:`bounded_loads` would not read back."""
    try:
        text = json.dumps(value)
    except RecursionError as exc:  # deeper than the interpreter's limit: never read back
        raise ValueError(f"JSON value nested deeper than {MAX_JSON_DEPTH}") from exc
    problem = check_bounds(text)
    if problem is not None:
        raise ValueError(f"JSON value {problem}: it would not read back")
    return text

"""Keyset (cursor) pagination for list endpoints.

A cursor is opaque to clients: base64url of a small JSON array holding the sort key of the last
row of the previous page. Keyset pagination stays correct while the ledger grows (no offsets that
shift) and costs one index range scan per page. A cursor that does not decode, or does not match
the endpoint's key shape, is a 422 problem, never a 500.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Annotated, Generic, TypeVar
from urllib.parse import urlencode

from fastapi import Query, Request
from pydantic import BaseModel, Field

from kvgov.errors import InvalidInputError

T = TypeVar("T")

DEFAULT_LIMIT = 50
MAX_LIMIT = 500
_MAX_CURSOR_CHARS = 1024

KeyValue = str | int | datetime
KeyType = type[str] | type[int] | type[datetime]

LimitParam = Annotated[
    int, Query(ge=1, le=MAX_LIMIT, description="Page size.", examples=[DEFAULT_LIMIT])
]
CursorParam = Annotated[
    str | None,
    Query(
        max_length=_MAX_CURSOR_CHARS,
        description="Opaque cursor from the previous page's `next` link.",
    ),
]


class Page(BaseModel, Generic[T]):
    """One page of a list. Follow ``next`` (a relative URL) until it is null."""

    items: list[T]
    limit: int = Field(description="the page size asked for")
    next: str | None = Field(default=None, description="URL of the next page, or null")


def encode_cursor(key: Sequence[KeyValue]) -> str:
    values = [v.isoformat() if isinstance(v, datetime) else v for v in key]
    raw = json.dumps(values, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str, shape: Sequence[KeyType]) -> tuple[KeyValue, ...]:
    """The sort key a cursor carries; :class:`InvalidInputError` when it is not one of ours."""
    try:
        padded = cursor + "=" * (-len(cursor) % 4)
        values = json.loads(base64.urlsafe_b64decode(padded.encode("ascii")))
    except (ValueError, binascii.Error, UnicodeError, RecursionError) as exc:
        raise InvalidInputError("cursor is not valid") from exc
    if not isinstance(values, list) or len(values) != len(shape):
        raise InvalidInputError("cursor is not valid")
    out: list[KeyValue] = []
    for value, kind in zip(values, shape, strict=True):
        if kind is datetime:
            if not isinstance(value, str):
                raise InvalidInputError("cursor is not valid")
            try:
                parsed = datetime.fromisoformat(value)
            except ValueError as exc:
                raise InvalidInputError("cursor is not valid") from exc
            if parsed.tzinfo is None:
                raise InvalidInputError("cursor is not valid")
            try:
                out.append(parsed.astimezone(UTC))
            except OverflowError as exc:
                raise InvalidInputError("cursor is not valid") from exc
        elif kind is int:
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**63:
                raise InvalidInputError("cursor is not valid")
            out.append(value)
        else:
            if not isinstance(value, str) or len(value) > 512 or "\x00" in value:
                raise InvalidInputError("cursor is not valid")
            out.append(value)
    return tuple(out)


def next_link(request: Request, key: Sequence[KeyValue] | None) -> str | None:
    """Relative URL of the next page: the same query with ``cursor`` replaced."""
    if key is None:
        return None
    params = [(k, v) for k, v in request.query_params.multi_items() if k != "cursor"]
    params.append(("cursor", encode_cursor(key)))
    return f"{request.url.path}?{urlencode(params)}"


def time_key(cursor: str | None) -> tuple[datetime, str] | None:
    """Decode a ``(time, id)`` cursor (most lists are ordered that way, newest first)."""
    if cursor is None:
        return None
    when, ident = decode_cursor(cursor, (datetime, str))
    if not isinstance(when, datetime) or not isinstance(ident, str):
        raise InvalidInputError("cursor is not valid")
    return (when, ident)


def checkpoint_key(cursor: str | None) -> tuple[datetime, str, int, str] | None:
    """Decode a checkpoint list's ``(time, chain id, seq, nonce)`` cursor: two checkpoints may
    share the first three (migration 0013), so the nonce breaks the tie, or a page boundary
    between them would skip one. A ``(time, chain id, seq)`` cursor of an earlier release is
    read with the nonce ``''``, the least: it skips every row equal on the three, as it did."""
    if cursor is None:
        return None
    try:
        key = decode_cursor(cursor, (datetime, str, int, str))
    except InvalidInputError:
        key = (*decode_cursor(cursor, (datetime, str, int)), "")
    when, ident, seq, nonce = key
    if (
        not isinstance(when, datetime)
        or not isinstance(ident, str)
        or not isinstance(seq, int)
        or not isinstance(nonce, str)
    ):
        raise InvalidInputError("cursor is not valid")
    return (when, ident, seq, nonce)

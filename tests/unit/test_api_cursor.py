"""A cursor is the client's bytes: whatever it decodes to, a bad one is a 422, never a 500."""

from __future__ import annotations

import base64
import sys
from datetime import UTC, datetime

import pytest

from kvgov.errors import InvalidInputError
from kvgov.proxy.api.pagination import decode_cursor, encode_cursor


def _at_depth(depth: int, cursor: str) -> object:
    """Decode ``cursor`` with ``depth`` frames already on the stack (as in a request handler
    under the ASGI server and middleware)."""
    if depth:
        return _at_depth(depth - 1, cursor)
    return decode_cursor(cursor, (datetime, int))


def test_a_deeply_nested_cursor_is_invalid_input_at_any_stack_depth() -> None:
    # the longest cursor the API takes (1024 characters) holds ~760 nested arrays: the JSON
    # parser raised RecursionError, not a ValueError, once the handler's own depth added to it
    cursor = base64.urlsafe_b64encode(b"[" * 760).decode().rstrip("=")
    depth = sys.getrecursionlimit() - 760 + 50
    with pytest.raises(InvalidInputError):
        _at_depth(depth, cursor)


def test_a_cursor_of_ours_still_decodes() -> None:
    key = (datetime(2026, 11, 26, 12, 0, 0, tzinfo=UTC), 42)
    assert decode_cursor(encode_cursor(key), (datetime, int)) == key

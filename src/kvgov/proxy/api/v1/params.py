"""Query and path parameters shared by the ``/v1`` routes, each documented with an example.

Text parameters refuse control characters (Postgres cannot even compare a string holding NUL)
and are capped at the widths of the ledger's columns; times without a zone are read as UTC.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from fastapi import Path, Query

from kvgov.errors import InvalidInputError

SAFE_TEXT = r"^[^\x00-\x1f\x7f]+$"

TenantQuery = Annotated[
    str | None,
    Query(
        min_length=1,
        max_length=128,
        pattern=SAFE_TEXT,
        description="Tenant id. Forced to the token's tenant for tenant-scoped tokens.",
        examples=["acme"],
    ),
]
RequiredTenantQuery = Annotated[
    str,
    Query(
        min_length=1,
        max_length=128,
        pattern=SAFE_TEXT,
        description="Tenant id the user belongs to (pseudonyms are tenant-bound).",
        examples=["acme"],
    ),
]
UserQuery = Annotated[
    str | None,
    Query(
        min_length=1,
        max_length=256,
        pattern=SAFE_TEXT,
        description="Raw user id; pseudonymised server-side like the ledger does. Needs a tenant.",
        examples=["alice@example.com"],
    ),
]
UserPath = Annotated[
    str,
    Path(
        min_length=1,
        max_length=256,
        pattern=SAFE_TEXT,
        description="Raw user id; pseudonymised server-side, never stored or returned.",
        examples=["alice@example.com"],
    ),
]
RequestIdPath = Annotated[
    str,
    Path(
        min_length=1,
        max_length=128,
        pattern=SAFE_TEXT,
        description="Request id the gateway tagged the inference request with.",
        examples=["req-9d21"],
    ),
]
SinceQuery = Annotated[
    datetime | None,
    Query(
        description="Only rows at or after this time (ISO 8601; UTC if no zone).",
        examples=["2026-11-21T00:00:00Z"],
    ),
]
UntilQuery = Annotated[
    datetime | None,
    Query(
        description="Only rows before this time (ISO 8601; UTC if no zone).",
        examples=["2026-11-22T00:00:00Z"],
    ),
]


def utc(value: datetime | None, name: str) -> datetime | None:
    """``value`` as an aware UTC datetime (naive means UTC); 422 when it is out of range."""
    if value is None:
        return None
    try:
        if value.tzinfo is None or value.utcoffset() is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)
    except (OverflowError, ValueError) as exc:
        raise InvalidInputError(f"{name} is out of range") from exc

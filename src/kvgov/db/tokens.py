"""Control-plane bearer tokens: creation, lookup by hash, listing, revocation.

A token is ``kvgov_`` followed by 256 random bits (base64url). Only its SHA-256 is stored: a
preimage of a 256-bit random value cannot be guessed, so no slow password hash is needed, and
lookup is one index probe on ``token_hash``. The raw token is shown once, at creation.

Like every repository here, :class:`TokenRepository` never commits: the CLI command or the API
request that uses it owns the transaction.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import uuid
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from kvgov.db.engine import utcnow
from kvgov.db.models import ApiToken
from kvgov.errors import NotFoundError
from kvgov.types import Role

TOKEN_PREFIX = "kvgov_"  # noqa: S105 - a prefix, not a secret
_MAX_TOKEN_CHARS = 256


def new_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def new_token_id() -> str:
    return str(uuid.uuid4())


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


@dataclass(frozen=True, slots=True)
class TokenRecord:
    """A token as stored: everything but the token itself."""

    id: str
    name: str
    role: Role
    tenant: str | None
    created_at: datetime
    revoked_at: datetime | None
    last_used_at: datetime | None

    @property
    def active(self) -> bool:
        return self.revoked_at is None


def _record(row: ApiToken) -> TokenRecord:
    return TokenRecord(
        id=row.id,
        name=row.name,
        role=row.role,
        tenant=row.tenant,
        created_at=row.created_at,
        revoked_at=row.revoked_at,
        last_used_at=row.last_used_at,
    )


class TokenRepository:
    def __init__(self, session: Session) -> None:
        self._session = session

    def create(
        self,
        role: Role,
        *,
        tenant: str | None = None,
        name: str = "",
        token_id: str | None = None,
    ) -> tuple[TokenRecord, str]:
        """Store a new token; returns its record and the raw token (shown once, never stored).

        ``token_id`` lets the caller record the creation in the ledger before this write."""
        token = new_token()
        row = ApiToken(
            id=token_id or new_token_id(),
            name=name or f"{role.value}-token",
            token_hash=hash_token(token),
            role=Role(role),
            tenant=tenant or None,
            created_at=utcnow(),
            revoked_at=None,
            last_used_at=None,
        )
        self._session.add(row)
        self._session.flush()
        return _record(row), token

    def verify(self, token: str) -> TokenRecord | None:
        """The active token matching ``token``, or None (unknown, malformed or revoked)."""
        if not token.startswith(TOKEN_PREFIX) or len(token) > _MAX_TOKEN_CHARS:
            return None
        digest = hash_token(token)
        row = self._session.scalar(select(ApiToken).where(ApiToken.token_hash == digest))
        if row is None or not hmac.compare_digest(row.token_hash, digest):
            return None
        if row.revoked_at is not None:
            return None
        return _record(row)

    def get(self, token_id: str) -> TokenRecord | None:
        row = self._session.get(ApiToken, token_id)
        return None if row is None else _record(row)

    def all(self, *, include_revoked: bool = True) -> list[TokenRecord]:
        query = select(ApiToken).order_by(ApiToken.created_at, ApiToken.id)
        if not include_revoked:
            query = query.where(ApiToken.revoked_at.is_(None))
        return [_record(row) for row in self._session.scalars(query)]

    def revoke(self, token_id: str) -> TokenRecord:
        """Revoke a token (idempotent); :class:`NotFoundError` if there is no such token."""
        row = self._session.get(ApiToken, token_id)
        if row is None:
            raise NotFoundError(f"no token with id {token_id!r}")
        if row.revoked_at is None:
            row.revoked_at = utcnow()
            self._session.flush()
        return _record(row)

    def touch(self, token_id: str, when: datetime) -> None:
        self._session.execute(
            update(ApiToken).where(ApiToken.id == token_id).values(last_used_at=when)
        )

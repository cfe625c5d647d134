"""Control-plane bearer tokens: creation, lookup by hash, listing, revocation.

A token is ``kvgov_`` followed by 256 random bits (base64url). Only its SHA-256 is stored: a
preimage of a 256-bit random value cannot be guessed, so no slow password hash is needed, and
lookup is one index probe on ``token_hash``. The raw token is shown once, at creation.

Like every repository here, :class:`TokenRepository` never commits: the CLI command or the API
request that uses it owns the transaction.

The row is not the whole story. The runtime role may INSERT and UPDATE ``api_tokens`` (the API
creates and revokes tokens as that role), and migration 0015's trigger only fixes a row once it
is written (review r15, F3). What the ledger says of a token is what counts: :meth:`TokenRepository.
trail` reads its chained ``token:created`` / ``token:revoked`` events (one indexed lookup) and
:func:`judge` weighs the row against them. A ``token:revoked`` event revokes the token whatever
its row says; a row whose role, tenant or hash differs from every ``token:created`` event of
its id is refused; a row with no ``token:created`` event at all (inserted by hand, or by the
runtime role) is accepted but said loudly (:func:`tokens_unrecorded`).

That role may INSERT into ``ledger_events`` too, so the API counts a ``token:created`` event
only where the ledger vouches for it (review r17, F1: a creation forged on a chain of the
attacker's own made a minted admin token "recorded"). :meth:`TokenRepository.trail` takes the
check (:mod:`kvgov.ledger.token_trail`, above this package) and leaves out the rows that fail
it; they are said and counted too (:func:`token_events_forged`).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import Row, Select, select, update
from sqlalchemy.orm import Session

from kvgov.db.engine import utcnow
from kvgov.db.models import ApiToken, LedgerEvent
from kvgov.db.tenants import TENANT_ID
from kvgov.db.token_index import is_token_event, token_id_of
from kvgov.errors import InvalidInputError, NotFoundError
from kvgov.types import EventKind, Role

TOKEN_PREFIX = "kvgov_"  # noqa: S105 - a prefix, not a secret
_MAX_TOKEN_CHARS = 256
#: the attrs key of a ``token:created`` event's :func:`creation_digest`
DIGEST_KEY = "token_digest"
#: token events of one token id read at most (an honest token has one creation and a
#: revocation or two; more are someone with the runtime role inserting junk)
_TRAIL_ROWS = 64


def new_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def new_token_id() -> str:
    return str(uuid.uuid4())


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def creation_digest(token_hash: str) -> str:
    """What a ``token:created`` event records of the token: a SHA-256 of its stored hash
    (domain-separated). The stored hash is a SHA-256 of 256 random bits, so this names the
    token without helping anyone find it (or the stored hash, which a database reader has
    anyway): it only lets the API tell whether a row's hash is the one its creation recorded."""
    return hashlib.sha256(b"kvgov token:created\x00" + token_hash.encode("utf-8")).hexdigest()


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


@dataclass(frozen=True, slots=True)
class Creation:
    """What one chained ``token:created`` event says of its token (None: not said)."""

    role: str | None
    tenant: str | None
    #: :func:`creation_digest` of the token's hash (None: an event of a release before 0015)
    digest: str | None


@dataclass(frozen=True, slots=True)
class Trail:
    """A token's chained events: whether any revokes it, and what each creation the ledger
    vouches for says."""

    revoked: bool
    created: tuple[Creation, ...]
    #: ``(chain_id, seq)`` of the ``token:created`` rows the ledger does not vouch for: not in
    #: :attr:`created` (review r17, F1)
    forged: tuple[tuple[str, int], ...] = ()


class Standing(StrEnum):
    """A token row weighed against its chained events (:func:`judge`)."""

    #: a creation event names its role, tenant and hash
    RECORDED = "recorded"
    #: a creation event of a release before 0015 (no hash digest) names its role and tenant
    RECORDED_LEGACY = "recorded_legacy"
    #: a ``token:revoked`` event is chained: revoked, whatever the row says
    REVOKED = "revoked"
    #: creation events exist, none names this row's role, tenant and hash: the row was edited
    CONTRADICTED = "contradicted"
    #: no creation event: the row was inserted outside ``kvgov token``/``/v1/tokens``
    UNRECORDED = "unrecorded"


def judge(record: TokenRecord, trail: Trail, token_hash: str | None) -> Standing:
    """Weigh ``record`` against ``trail``. ``token_hash`` is the row's hash (the presented
    token's); None skips the hash (a dashboard session, whose sign-in checked it)."""
    if trail.revoked:
        return Standing.REVOKED
    if not trail.created:
        return Standing.UNRECORDED
    digest = None if token_hash is None else creation_digest(token_hash)
    legacy = False
    for made in trail.created:
        if made.role != record.role.value or made.tenant != record.tenant:
            continue
        if made.digest is None:
            legacy = True
        elif digest is None or hmac.compare_digest(made.digest.encode(), digest.encode()):
            return Standing.RECORDED
    return Standing.RECORDED_LEGACY if legacy else Standing.CONTRADICTED


def _creation(tenant: str | None, attrs: object) -> Creation:
    """One ``token:created`` row's :class:`Creation` (a row of junk matches no token)."""
    if not isinstance(attrs, dict):
        return Creation(role=None, tenant=tenant, digest="")
    role = attrs.get("role")
    digest: str | None = None
    if DIGEST_KEY in attrs:
        value = attrs[DIGEST_KEY]
        digest = value if isinstance(value, str) else ""  # present but junk: matches nothing
    return Creation(role=role if isinstance(role, str) else None, tenant=tenant, digest=digest)


class _Counter:
    """Distinct things (token ids found :attr:`Standing.UNRECORDED`; forged events) seen
    since start (a metric's source), and whether each was said already."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: set[str] = set()

    def first(self, token_id: str) -> bool:
        """Count ``token_id``; whether this is its first time."""
        with self._lock:
            if token_id in self._seen:
                return False
            self._seen.add(token_id)
            return True

    @property
    def count(self) -> int:
        return len(self._seen)


_UNRECORDED = _Counter()
_FORGED = _Counter()


def tokens_unrecorded() -> int:
    """Token ids used since the process started whose row no chained ``token:created`` event
    explains (someone inserted them into ``api_tokens`` by hand, or with the runtime role)."""
    return _UNRECORDED.count


def unrecorded_first_seen(token_id: str) -> bool:
    """Count ``token_id`` as :attr:`Standing.UNRECORDED`; whether it is new (to be logged)."""
    return _UNRECORDED.first(token_id)


def token_events_forged() -> int:
    """``token:created`` events seen since the process started that the ledger does not vouch
    for (not on a chain a trusted key signed, or not under a head it signed: someone inserted
    them into ``ledger_events`` with the runtime role). Each is counted once."""
    return _FORGED.count


def forged_first_seen(chain_id: str, seq: int) -> bool:
    """Count the event at ``chain_id``/``seq`` as forged; whether it is new (to be logged)."""
    return _FORGED.first(f"{seq}@{chain_id}")


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


def trail_query(token_id: str) -> Select[Any]:
    """``token_id``'s token events (every column: a row's hash is checked against them),
    revocations first: what :meth:`TokenRepository.trail` runs (named here so its plan can be
    read back)."""
    t = LedgerEvent.__table__.c
    return (
        select(LedgerEvent.__table__)
        .where(is_token_event(t.kind), token_id_of(t.attrs) == token_id)
        .order_by(t.kind.desc())  # 'token:revoked' sorts after 'token:created'
        .limit(_TRAIL_ROWS)
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
        token: str | None = None,
    ) -> tuple[TokenRecord, str]:
        """Store a new token; returns its record and the raw token (shown once, never stored).

        ``token_id`` and ``token`` (from :func:`new_token`) let the caller record the creation
        in the ledger, with the token's :func:`creation_digest`, before this write. ``tenant``
        None is a token of every tenant; anything else must be a tenant id
        (:class:`InvalidInputError`): an empty string never widens the scope to all."""
        if tenant is not None and not TENANT_ID.fullmatch(tenant):
            raise InvalidInputError(f"invalid tenant id {tenant!r} for a token")
        if token is None:
            token = new_token()
        elif not token.startswith(TOKEN_PREFIX) or len(token) > _MAX_TOKEN_CHARS:
            raise ValueError("not a kvgov token")
        row = ApiToken(
            id=token_id or new_token_id(),
            name=name or f"{role.value}-token",
            token_hash=hash_token(token),
            role=Role(role),
            tenant=tenant,
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

    def trail(self, token_id: str, vouch: Callable[[Row[Any]], bool] | None = None) -> Trail:
        """``token_id``'s chained token events: one probe of ``ix_ledger_events_token_id``
        (migration 0015), revocations first.

        ``vouch`` says whether the ledger vouches for a ``token:created`` row (the API's:
        :class:`kvgov.ledger.token_trail.TokenEventProofs`); one it does not is left out of
        :attr:`Trail.created` and named in :attr:`Trail.forged`. None believes every row (the
        CLI and tests reading back what they wrote). A ``token:revoked`` row counts whether
        vouched for or not: one the runtime role inserted only locks a token out, which that
        role can do anyway by setting ``revoked_at``, and believing it fails closed."""
        rows = self._session.execute(trail_query(token_id)).all()
        revoked = any(row.kind == EventKind.TOKEN_REVOKED.value for row in rows)
        created: list[Creation] = []
        forged: list[tuple[str, int]] = []
        for row in rows:
            if row.kind != EventKind.TOKEN_CREATED.value:
                continue
            if vouch is None or vouch(row):
                created.append(_creation(row.tenant, row.attrs))
            else:
                forged.append((row.chain_id, row.seq))
        return Trail(revoked=revoked, created=tuple(created), forged=tuple(forged))

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

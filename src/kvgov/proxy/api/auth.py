"""Who is calling the control plane, and what they may see.

Bearer tokens (``Authorization: Bearer kvgov_...``) are looked up by their SHA-256 in the
``api_tokens`` table (see :mod:`kvgov.db.tokens`); the raw token is never stored or logged.
The row is then weighed against the token's chained events (:func:`check_ledger`): the runtime
database role that every sidecar holds may write ``api_tokens``, never rewrite the ledger.
Each token has a role and optionally a tenant:

- ``auditor`` reads the compliance API; ``admin`` also purges and manages tokens and keys;
  ``engine`` tokens belong to the data plane and get 403 on every control-plane route.
- a tenant-scoped token sees only its tenant: list filters are forced to it, and asking for
  another tenant (or an object of another tenant) is 403.

Every request authenticated as an admin is recorded in the ledger (``api:access``) before it is
served; if the ledger cannot record it, the request is refused (503).

Authentication runs on threads of its own (:func:`in_auth_thread`), not on anyio's worker
threads that every sync route takes: requests busy in slow routes do not hold back every other
caller's authentication. Whole-ledger verification goes through the process's
:class:`~kvgov.proxy.api.verifier.LedgerVerifier` (one at a time, its report kept).

The dashboard also accepts a short-lived session cookie that ``POST /dashboard/login`` issues in
exchange for a token (see :mod:`kvgov.proxy.api.dashboard`); the ``/v1`` API accepts bearer
tokens only, so the cookie cannot be used for cross-site requests against it.
"""

from __future__ import annotations

import asyncio
import base64
import contextvars
import functools
import hashlib
import hmac
import json
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Annotated, Any, ParamSpec, Protocol, TypeVar

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import Engine, Row
from sqlalchemy.orm import Session

from kvgov.config import Settings
from kvgov.db.engine import make_sessionmaker, utcnow
from kvgov.db.tokens import (
    Standing,
    TokenRecord,
    TokenRepository,
    forged_first_seen,
    hash_token,
    judge,
    unrecorded_first_seen,
)
from kvgov.errors import AuthError, ForbiddenError, KvgovError
from kvgov.ledger.events import Event, EventSink
from kvgov.ledger.token_trail import TokenEventProofs
from kvgov.ledger.verify import VerifyReport
from kvgov.logging import get_logger
from kvgov.proxy.api.routes import route_template
from kvgov.proxy.api.verifier import LedgerVerifier, Verified
from kvgov.types import EventKind, Role

log = get_logger(__name__)

P = ParamSpec("P")
T = TypeVar("T")

SESSION_COOKIE = "kvgov_dashboard"
SESSION_TTL_S = 8 * 3600
#: ``last_used_at`` is refreshed at most this often per token (one write per request is waste)
_TOUCH_EVERY = timedelta(seconds=60)


class UserPseudonymizer(Protocol):
    """What the API needs of :class:`kvgov.ledger.pseudonym.Pseudonymizer`."""

    def user(self, tenant: str, user_id: str) -> str: ...


@dataclass
class ApiContext:
    """What the control-plane routes need, built once by the application factory."""

    settings: Settings
    engine: Engine
    sink: EventSink
    pseudonymizer: UserPseudonymizer
    #: signs dashboard session cookies; random per process unless given
    session_secret: bytes
    #: raw Ed25519 public keys purge receipts are checked against; None: the ledger's signing
    #: key (``settings.signing_key_path``), read on first use
    receipt_keys: tuple[bytes, ...] | None = None
    #: the keyring ``/v1/keys/rotate`` rotates through; None: one is built on first use from the
    #: settings (the sidecar passes its own, so a rotation takes effect in it at once)
    keyring: Any = None
    #: raw Ed25519 public keys ledger chains are verified against; None: read from the settings
    #: (this node's own key, ``ledger.trusted_keys`` and its file) at each verification
    chain_keys: frozenset[bytes] | None = None
    #: chains the ledger must hold (the serving sidecar's own)
    expected_chains: tuple[str, ...] = ()
    #: runs whole-ledger verifications one at a time and keeps their report (the sidecar's,
    #: one per process); None: one of this context's own, from ``settings.api``
    verifier: LedgerVerifier | None = None
    _sessions: Callable[[], Session] = field(init=False, repr=False)
    #: token ids a chained ``token:revoked`` event was seen for: a revocation is permanent, so
    #: these are refused without asking the ledger again (bounded by the table's rows)
    _revoked: set[str] = field(init=False, repr=False, default_factory=set)
    _revoked_lock: threading.Lock = field(init=False, repr=False, default_factory=threading.Lock)
    #: which ``token:created`` events the ledger vouches for, memoised (review r17, F1)
    token_proofs: TokenEventProofs = field(init=False, repr=False, default_factory=TokenEventProofs)
    _verify_engine: Engine | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self._sessions = make_sessionmaker(self.engine)
        if self.verifier is None:
            self.verifier = LedgerVerifier.from_settings(self.settings.api)

    def seen_revoked(self, token_id: str) -> bool:
        with self._revoked_lock:
            return token_id in self._revoked

    def remember_revoked(self, token_id: str) -> None:
        with self._revoked_lock:
            self._revoked.add(token_id)

    def session(self) -> Session:
        return self._sessions()

    async def ledger_report(self, *, fleet_wide: bool) -> Verified:
        """The ledger's verification for a caller (``fleet_wide``: not tenant-scoped): the
        kept report while fresh enough, else the running one, else a fresh one
        (:class:`~kvgov.proxy.api.verifier.LedgerVerifier`: never more than one at a time,
        never on the API's worker threads)."""
        assert self.verifier is not None  # __post_init__
        return await self.verifier.report(self.verify_ledger, fleet_wide=fleet_wide)

    def verify_ledger(self) -> VerifyReport:
        """``audit verify`` against the trusted keys, never the ones stored in the ledger
        (blocking). Run on :meth:`verification_engine`, not the sidecar's pool; routes go
        through :meth:`ledger_report`."""
        from kvgov.ledger.trust import verify_trusted

        engine = self.verification_engine()
        try:
            return verify_trusted(engine, self.ledger_keys(), expect_chains=self.expected_chains)
        finally:
            if engine is not self.engine:
                # the connection goes with the run: none idles between verifications
                engine.dispose()

    def verification_engine(self) -> Engine:
        """The engine verifications run on: on PostgreSQL one of their own with a single
        connection (a verification needs one at a time), so the sidecar's ledger pool (its
        heartbeat, key revalidation, purge executor, ledger committer) never waits for one.
        SQLite engines pool nothing (a connection per checkout): the API's own."""
        if self.engine.dialect.name != "postgresql":
            return self.engine
        if self._verify_engine is None:
            from kvgov.db.engine import make_engine

            url = self.engine.url.render_as_string(hide_password=False)
            self._verify_engine = make_engine(url, pool_size=1, max_overflow=0)
        return self._verify_engine

    def ledger_keys(self) -> frozenset[bytes]:
        """The keys a ledger chain must be signed by for its events to count (see
        :attr:`chain_keys`)."""
        from kvgov.ledger.trust import trusted_keys

        return self.chain_keys if self.chain_keys is not None else trusted_keys(self.settings)

    def trusted_receipt_keys(self) -> tuple[bytes, ...]:
        """The keys a receipt must be signed by to show as verified (none: nothing verifies)."""
        if self.receipt_keys is None:
            from kvgov.ledger.chain import load_public_key

            path = self.settings.signing_key_path
            try:
                what = "the ledger signing key (ledger.signing_key_path)"
                self.receipt_keys = (load_public_key(path, what),) if path.exists() else ()
            except (KvgovError, OSError) as exc:
                # a file others may write is refused like an unreadable one: nothing verifies
                # (the error names the file and its mode, never the key)
                reason = exc.message if isinstance(exc, KvgovError) else type(exc).__name__
                log.warning("api.receipt_key.unreadable", extra={"error": reason[:300]})
                self.receipt_keys = ()
        return self.receipt_keys


@dataclass(frozen=True, slots=True)
class Principal:
    """The authenticated caller."""

    #: what ledger events record as ``principal``: ``token:<id>`` or ``anonymous``
    id: str
    name: str
    role: Role
    tenant: str | None
    token_id: str | None = None

    @property
    def is_admin(self) -> bool:
        return self.role is Role.ADMIN

    @property
    def fleet_wide(self) -> bool:
        """Whether this caller may see figures that move with every tenant's traffic
        (``/metrics``, ledger chains' counts and checkpoints): not tenant-scoped."""
        return self.tenant is None

    def tenant_filter(self, requested: str | None) -> str | None:
        """The tenant a list query must be restricted to (forced for tenant-scoped tokens)."""
        if self.tenant is None:
            return requested
        if requested is None or requested == self.tenant:
            return self.tenant
        raise ForbiddenError(f"this token is scoped to tenant {self.tenant!r}")

    def check_tenant(self, tenant: str | None) -> None:
        """403 unless this caller may see an object of ``tenant``."""
        if self.tenant is not None and tenant != self.tenant:
            raise ForbiddenError(f"this token is scoped to tenant {self.tenant!r}")


ANONYMOUS = Principal(id="anonymous", name="auth disabled", role=Role.ADMIN, tenant=None)


def principal_for(record: TokenRecord) -> Principal:
    return Principal(
        id=f"token:{record.id}",
        name=record.name,
        role=record.role,
        tenant=record.tenant,
        token_id=record.id,
    )


async def api_context(request: Request) -> ApiContext:
    # async: FastAPI runs a sync dependency on anyio's worker threads, and every route,
    # authentication's included, takes this one (busy sync routes would hold it back)
    ctx = getattr(request.app.state, "kvgov_api", None)
    if not isinstance(ctx, ApiContext):
        raise RuntimeError("the kvgov API routes were mounted without include_v1()")
    return ctx


Context = Annotated[ApiContext, Depends(api_context)]


def db_session(ctx: Context) -> Iterator[Session]:
    """A read session per request; the API's read routes never write, so it is rolled back."""
    session = ctx.session()
    try:
        yield session
    finally:
        session.rollback()
        session.close()


DbSession = Annotated[Session, Depends(db_session)]


# -- tokens -------------------------------------------------------------------------------------


bearer_scheme = HTTPBearer(
    auto_error=False,
    scheme_name="bearer",
    description="A kvgov control-plane token (`kvgov token create --role auditor`).",
)
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)]


def check_ledger(
    ctx: ApiContext, session: Session, record: TokenRecord, token_hash: str | None
) -> None:
    """:class:`AuthError` unless the token's chained events bear its row out (review r15, F3).

    One indexed lookup of the token's events per request (none once it was seen revoked): a
    ``token:revoked`` event refuses it whatever ``revoked_at`` says, and a row whose role,
    tenant or hash (``token_hash``; None: not checked) no ``token:created`` event of its id
    names is refused. A row with no creation event at all is served, and logged and counted
    (``api.token.unrecorded``, :func:`kvgov.db.tokens.tokens_unrecorded`): it was inserted
    outside ``kvgov token`` and ``/v1/tokens``.

    A creation event counts only where the ledger vouches for it (:mod:`kvgov.ledger.
    token_trail`: a trusted key's chain, signed genesis, under a head it signed; memoised):
    one the runtime role inserted on a chain of its own is no creation, so the token it
    names stays unrecorded, and the event is logged and counted once (``api.token.
    forged_event``, :func:`kvgov.db.tokens.token_events_forged`; review r17, F1)."""
    if ctx.seen_revoked(record.id):
        raise AuthError("invalid or revoked token")

    def vouch(row: Row[Any]) -> bool:
        return ctx.token_proofs.vouches(session, row, ctx.ledger_keys)

    trail = TokenRepository(session).trail(record.id, vouch)
    for chain_id, seq in trail.forged:
        if forged_first_seen(chain_id, seq):
            log.error(
                "api.token.forged_event",
                extra={
                    "token_id": record.id,
                    "chain_id": chain_id,
                    "seq": seq,
                    "hint": "a token:created event of this token is on no chain a trusted key"
                    " signed, or under no head it signed: it was inserted into ledger_events"
                    " outside a ledger writer (it counts for nothing)",
                },
            )
    standing = judge(record, trail, token_hash)
    if standing is Standing.REVOKED:
        ctx.remember_revoked(record.id)
        if record.revoked_at is None:
            log.error(
                "api.token.revocation_undone",
                extra={
                    "token_id": record.id,
                    "hint": "a token:revoked event is chained for this token, yet its row is not"
                    " revoked: someone cleared revoked_at (the token stays refused)",
                },
            )
        raise AuthError("invalid or revoked token")
    if standing is Standing.CONTRADICTED:
        log.error(
            "api.token.contradicted",
            extra={
                "token_id": record.id,
                "hint": "no token:created event of this id names the row's role, tenant and"
                " hash: the row was edited after its creation (refused)",
            },
        )
        raise AuthError("invalid or revoked token")
    if standing is Standing.UNRECORDED and unrecorded_first_seen(record.id):
        log.warning(
            "api.token.unrecorded",
            extra={
                "token_id": record.id,
                "role": record.role.value,
                "hint": "no token:created event is chained for this token: it was inserted into"
                " api_tokens outside kvgov token and /v1/tokens",
            },
        )


def verify_token(ctx: ApiContext, token: str) -> Principal:
    """The principal of a raw bearer token; :class:`AuthError` for unknown or revoked tokens."""
    with ctx.session() as session:
        repo = TokenRepository(session)
        record = repo.verify(token)
        if record is None:
            raise AuthError("invalid or revoked token")
        check_ledger(ctx, session, record, hash_token(token))
        now = utcnow()
        if record.last_used_at is None or now - record.last_used_at > _TOUCH_EVERY:
            repo.touch(record.id, now)
            session.commit()
    return principal_for(record)


def principal_by_token_id(ctx: ApiContext, token_id: str) -> Principal:
    with ctx.session() as session:
        record = TokenRepository(session).get(token_id)
        if record is None or record.revoked_at is not None:
            raise AuthError("the session's token was revoked")
        # the hash was checked at sign-in; the row's revocation, role and tenant are now
        check_ledger(ctx, session, record, None)
    return principal_for(record)


def _authenticate_sync(
    ctx: ApiContext,
    request: Request,
    credentials: HTTPAuthorizationCredentials | None,
    *,
    allow_cookie: bool,
) -> Principal:
    if not ctx.settings.api.auth:
        return ANONYMOUS
    if credentials is not None and credentials.credentials:
        return verify_token(ctx, credentials.credentials)
    if allow_cookie:
        cookie = request.cookies.get(SESSION_COOKIE)
        claims = read_session_claims(ctx.session_secret, cookie) if cookie else None
        if claims is not None and session_token(ctx, claims[1]) == claims[0]:
            return principal_by_token_id(ctx, claims[0])
    raise AuthError("a bearer token is required")


#: threads authentication runs on (a token lookup each), apart from anyio's default limiter
AUTH_THREADS = 8


@functools.cache
def _auth_executor() -> ThreadPoolExecutor:
    """Authentication's own threads, made on first use (one pool per process).

    Not anyio's default limiter (40 threads), which every sync route and sync dependency
    takes too: requests busy in those routes (a flood of slow reads by one auditor) would
    queue every other caller's authentication behind them, an admin's purge included."""
    return ThreadPoolExecutor(max_workers=AUTH_THREADS, thread_name_prefix="kvgov-auth")


async def in_auth_thread(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """``fn`` on authentication's own threads (see :func:`_auth_executor`), in a copy of the
    caller's context (as ``run_in_threadpool`` would)."""
    call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(_auth_executor(), call)


async def authenticate_in_thread(
    ctx: ApiContext,
    request: Request,
    credentials: HTTPAuthorizationCredentials | None,
    *,
    allow_cookie: bool,
) -> Principal:
    """The caller's principal (:func:`_authenticate_sync`) on authentication's own threads."""
    return await in_auth_thread(
        _authenticate_sync, ctx, request, credentials, allow_cookie=allow_cookie
    )


async def authenticate(request: Request, ctx: Context, credentials: Credentials) -> Principal:
    return await authenticate_in_thread(ctx, request, credentials, allow_cookie=False)


async def authenticate_dashboard(
    request: Request, ctx: Context, credentials: Credentials
) -> Principal:
    return await authenticate_in_thread(ctx, request, credentials, allow_cookie=True)


async def record_admin_access(ctx: ApiContext, request: Request, principal: Principal) -> None:
    """Append ``api:access`` for an admin request and wait until it is durable.

    Only the route template and the names of query parameters are recorded: values (a user id
    in ``/v1/users/{user}/...``) could be personal data.
    """
    if not principal.is_admin:
        return
    template = route_template(request)
    await ctx.sink.append(
        Event(
            kind=EventKind.API_ACCESS,
            tenant=principal.tenant or request.query_params.get("tenant"),
            principal=principal.id,
            attrs={
                "method": request.method,
                "route": template,
                "query": sorted(set(request.query_params.keys())),
            },
        )
    )


def require(*roles: Role) -> Callable[..., Awaitable[Principal]]:
    """A dependency admitting only ``roles`` (admins are always admitted) and auditing admins."""
    allowed = frozenset(roles) | {Role.ADMIN}

    async def dependency(
        request: Request,
        ctx: Context,
        principal: Annotated[Principal, Depends(authenticate)],
    ) -> Principal:
        if principal.role not in allowed:
            raise ForbiddenError(f"role {principal.role.value!r} may not use this endpoint")
        await record_admin_access(ctx, request, principal)
        return principal

    return dependency


async def _require_global_admin(
    request: Request,
    ctx: Context,
    principal: Annotated[Principal, Depends(authenticate)],
) -> Principal:
    if principal.role is not Role.ADMIN:
        raise ForbiddenError(f"role {principal.role.value!r} may not use this endpoint")
    if principal.tenant is not None:
        raise ForbiddenError("managing tokens needs an admin token that is not tenant-scoped")
    await record_admin_access(ctx, request, principal)
    return principal


async def require_fleet_reader(
    request: Request,
    ctx: Context,
    principal: Annotated[Principal, Depends(authenticate)],
) -> Principal:
    """Auditors and admins that are not tenant-scoped: fleet-wide figures (``/metrics``)."""
    if principal.role not in (Role.AUDITOR, Role.ADMIN):
        raise ForbiddenError(f"role {principal.role.value!r} may not use this endpoint")
    if not principal.fleet_wide:
        raise ForbiddenError("fleet-wide figures need a token that is not tenant-scoped")
    await record_admin_access(ctx, request, principal)
    return principal


#: auditors and admins (every read route)
Reader = Annotated[Principal, Depends(require(Role.AUDITOR))]
#: admins only (purges, keys)
Admin = Annotated[Principal, Depends(require(Role.ADMIN))]
#: admins that are not tenant-scoped (token management)
GlobalAdmin = Annotated[Principal, Depends(_require_global_admin)]


# -- dashboard sessions -----------------------------------------------------------------------


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def issue_session(
    secret: bytes, token_id: str, *, session_id: str = "", now: float | None = None
) -> str:
    """A signed cookie value naming the token, the server-side session
    (:mod:`kvgov.db.sessions`) and an expiry (the raw token is not in it)."""
    issued = time.time() if now is None else now
    claims = {"t": token_id, "s": session_id, "exp": int(issued) + SESSION_TTL_S}
    body = _b64(json.dumps(claims).encode())
    mac = hmac.new(secret, body.encode(), hashlib.sha256).digest()
    return f"{body}.{_b64(mac)}"


def read_session(secret: bytes, value: str, *, now: float | None = None) -> str | None:
    """The token id of a validly signed, unexpired session cookie, else None (whether its
    session is still open is the server's to say: :func:`session_token`)."""
    claims = read_session_claims(secret, value, now=now)
    return None if claims is None else claims[0]


def open_session(ctx: ApiContext, token_id: str) -> str:
    """Start a server-side dashboard session of ``token_id``; returns its id."""
    from kvgov.db.sessions import SessionRepository

    with ctx.session() as session:
        session_id = SessionRepository(session).open(token_id, ttl_s=SESSION_TTL_S, now=utcnow())
        session.commit()
    return session_id


def session_token(ctx: ApiContext, session_id: str) -> str | None:
    """The token id of an open, unexpired server-side session, else None."""
    from kvgov.db.sessions import SessionRepository

    with ctx.session() as session:
        return SessionRepository(session).token_of(session_id, now=utcnow())


def close_session(ctx: ApiContext, session_id: str) -> None:
    """Sign-out: the session ends on the server (a kept copy of the cookie opens nothing)."""
    from kvgov.db.sessions import SessionRepository

    with ctx.session() as session:
        SessionRepository(session).close(session_id)
        session.commit()


def read_session_claims(
    secret: bytes, value: str, *, now: float | None = None
) -> tuple[str, str] | None:
    """(token id, session id) of a validly signed, unexpired session cookie, else None."""
    body, _, mac = value.partition(".")
    if not body or not mac:
        return None
    expected = hmac.new(secret, body.encode(), hashlib.sha256).digest()
    try:
        if not hmac.compare_digest(expected, _unb64(mac)):
            return None
        data = json.loads(_unb64(body))
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    token_id, session_id, exp = data.get("t"), data.get("s"), data.get("exp")
    if not isinstance(token_id, str) or not isinstance(exp, int):
        return None
    if exp < (time.time() if now is None else now):
        return None
    return token_id, session_id if isinstance(session_id, str) else ""

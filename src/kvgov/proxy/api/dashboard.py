"""``/dashboard``: a small, read-only, server-rendered compliance page (Jinja2, no JS build).

It shows what the ``/v1`` API shows, from the same queries: ledger integrity, per-tenant stats,
recent denials, and erasure requests built by the same function as ``GET /v1/purges`` (state,
counts, and whether each receipt's signature verifies against the ledger's public key).
A tenant-scoped token sees only its tenant.

Sign-in: the page accepts the same bearer token as the API (``Authorization`` header, for
scripts and reverse proxies), or a person pastes a token into the sign-in form, which is POSTed
to ``/dashboard/login`` and exchanged for a session cookie. Deliberately there is no
``?token=`` URL exchange: tokens in URLs end up in access logs, browser history and Referer
headers. The cookie is HttpOnly, ``SameSite=Strict``, scoped to ``/dashboard``, ``Secure`` over
HTTPS, expires after 8 hours, and holds only an HMAC-signed token id and session id (never the
token). The session lives on the server (``dashboard_sessions``, :mod:`kvgov.db.sessions`,
only a hash of its id): sign-out deletes it, so a copy of the cookie opens nothing afterwards;
it also ends at its expiry and with the token's revocation. The ``/v1`` API ignores the
cookie, so it gives no cross-site request power. Pages are sent with a strict
Content-Security-Policy and no caching.

Sign-in and sign-out refuse cross-site requests (:func:`_cross_site`): ``SameSite=Strict`` keeps
the cookie from being *sent* cross-site, but not from being *set* by the answer to a top-level
cross-site POST, so without this a page elsewhere could sign a visitor's browser into the
attacker's session (login CSRF), or sign them out.

A tenant-scoped token sees the ledger's verdict but not the per-chain table: chains are shared
by every tenant, so their event counts and checkpoints move with other tenants' traffic (the
same rule as ``/v1/audit/verify`` and ``/metrics``).
"""

from __future__ import annotations

import functools
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import parse_qs, urlsplit

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from jinja2 import Environment, FileSystemLoader, select_autoescape

from kvgov.db import queries_admin as qa
from kvgov.errors import AuthError, KvgovError
from kvgov.ledger import queries_api as q
from kvgov.proxy.api.auth import (
    SESSION_COOKIE,
    SESSION_TTL_S,
    ApiContext,
    Context,
    Credentials,
    Principal,
    authenticate_in_thread,
    close_session,
    in_auth_thread,
    issue_session,
    open_session,
    read_session_claims,
    record_admin_access,
    verify_token,
)
from kvgov.proxy.api.v1.audit import report_out, scoped_report_out, stats_out
from kvgov.proxy.api.v1.purge_reads import purge_summaries
from kvgov.proxy.api.verifier import Verified
from kvgov.types import Environment as KvgovEnvironment
from kvgov.types import Role

_HERE = Path(__file__).parent
_SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'self'; img-src 'self' data:; form-action 'self'; "
        "frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
}
_MAX_FORM_BYTES = 4096
_DEFAULT_PORTS = {"http": 80, "https": 443}
#: ``Sec-Fetch-Site`` values of a request this site itself (or the user, typing) started
_SAME_SITE_FETCH = frozenset({"same-origin", "none"})


def _human_bytes(value: int | None) -> str:
    if value is None:
        return "-"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{value} B"


def _when(value: datetime | None) -> str:
    return "-" if value is None else value.strftime("%Y-%m-%d %H:%M:%S UTC")


def _templates() -> Environment:
    env = Environment(
        loader=FileSystemLoader(_HERE / "templates"),
        autoescape=select_autoescape(["html"]),
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["human_bytes"] = _human_bytes
    env.filters["when"] = _when
    env.filters["short"] = lambda v, n=12: "-" if not v else (v if len(v) <= n else v[:n] + "…")
    return env


def _html(env: Environment, name: str, status: int, **context: Any) -> HTMLResponse:
    body = env.get_template(name).render(**context)
    return HTMLResponse(body, status_code=status, headers=_SECURITY_HEADERS)


def _origin(scheme: str, netloc: str) -> tuple[str, str, int | None] | None:
    """``(scheme, host, port)`` with the scheme's default port filled in; None if malformed."""
    try:
        parts = urlsplit(f"{scheme}://{netloc}")
        port = parts.port
    except ValueError:
        return None
    if not parts.hostname:
        return None
    scheme = parts.scheme.lower()
    return scheme, parts.hostname.lower(), port if port is not None else _DEFAULT_PORTS.get(scheme)


def _cross_site(request: Request) -> str | None:
    """Why a state-changing dashboard POST is refused as cross-site, or None to allow it.

    Refused: a ``Sec-Fetch-Site`` other than ``same-origin`` / ``none``, or an ``Origin`` that is
    not this server's own (scheme, host and port as this server sees the request; behind a
    TLS-terminating proxy, list it in ``api.forwarded_allow_ips`` so the scheme is https). An
    opaque ``Origin: null`` passes only where ``Sec-Fetch-Site`` vouches for the request:
    Chromium sends it on the page's own sign-in, as the page's ``no-referrer`` policy asks.

    Allowed when the request carries *neither* header, on purpose: non-browser clients (curl,
    scripts, reverse-proxy health checks) send neither and cannot be made to post by another
    site, and every current browser sends ``Origin`` on a POST form submission (and
    ``Sec-Fetch-Site``), so a cross-site sign-in from one is always caught here. Only a browser
    old enough to predate both headers is not covered; it gets no fetch-metadata protection
    from any site.
    """
    fetch_site = request.headers.get("sec-fetch-site")
    if fetch_site is not None and fetch_site.strip().lower() not in _SAME_SITE_FETCH:
        return f"Sec-Fetch-Site is {fetch_site.strip()[:32]!r}"
    origin = request.headers.get("origin")
    if origin is not None and origin.strip() == "null" and fetch_site is not None:
        # an opaque origin vouched for by fetch metadata: Chromium sends ``Origin: null`` on
        # this page's own form POST, as its ``Referrer-Policy: no-referrer`` asks
        return None
    if origin is not None:
        raw = origin.strip()
        scheme, sep, netloc = raw.partition("://")
        plain = sep and not any(c in netloc for c in "/@?#")
        theirs = _origin(scheme, netloc) if plain else None
        ours = _origin(request.url.scheme, request.url.netloc)
        if theirs is None or ours is None or theirs != ours:
            return "Origin is not this site"
    return None


def _secure_cookie(ctx: ApiContext, request: Request) -> bool:
    """Whether the session cookie is ``Secure`` (``api.secure_cookies``; unset: always in
    production, where a TLS proxy may forward the request as plain HTTP, else over HTTPS)."""
    configured = ctx.settings.api.secure_cookies
    if configured is not None:
        return configured
    return ctx.settings.environment is KvgovEnvironment.PRODUCTION or request.url.scheme == "https"


def _refuse_cross_site(env: Environment, request: Request) -> HTMLResponse | None:
    """A 403 (no cookie set or cleared) for a cross-site sign-in or sign-out, else None."""
    why = _cross_site(request)
    if why is None:
        return None
    return _html(
        env,
        "login.html",
        403,
        error=(
            "Refused: this request came from another site "
            f"({why}). Sign in from this dashboard's own page."
        ),
    )


def _load(ctx: ApiContext, principal: Principal, verified: Verified) -> dict[str, Any]:
    """Everything the page shows (the ledger's verification: ``verified``), read in one
    session."""
    report, at = verified.report, verified.verified_at
    fleet = principal.fleet_wide
    # per-chain counts and checkpoints only for fleet-wide readers (chains span every tenant)
    verify_report = report_out(report, at) if fleet else scoped_report_out(report, at)
    with ctx.session() as session:
        stats = q.tenant_stats(
            session, tenants=None if principal.tenant is None else [principal.tenant]
        )
        denials = q.recent_denials(session, tenant=principal.tenant, limit=20)
        purge_rows = qa.list_purges(session, tenant=principal.tenant, limit=20)
        summaries = purge_summaries(
            session, purge_rows, ctx.trusted_receipt_keys(), ctx.ledger_keys()
        )
    purges = [(summary, r.receipt) for summary, r in zip(summaries, purge_rows, strict=True)]
    return {
        "verify": verify_report,
        "chain_detail": fleet,
        "stats": [stats_out(s) for s in stats],
        "denials": denials,
        "purges": purges,
    }


@functools.cache
def _env() -> Environment:
    return _templates()


async def optional_principal(
    request: Request, ctx: Context, credentials: Credentials
) -> Principal | None:
    try:
        return await authenticate_in_thread(ctx, request, credentials, allow_cookie=True)
    except AuthError:
        return None


MaybePrincipal = Annotated[Principal | None, Depends(optional_principal)]

router = APIRouter(tags=["dashboard"])


@router.get(
    "/dashboard",
    summary="Compliance dashboard",
    description=(
        "Server-rendered HTML page (ledger integrity, tenant stats, denials, purges). Signs in "
        "with a bearer token or the session cookie from `POST /dashboard/login`; without "
        "either it answers 401 with the sign-in form."
    ),
    response_class=HTMLResponse,
    responses={
        200: {"content": {"text/html": {"example": "<!doctype html>..."}}},
        401: {"description": "Sign-in form", "content": {"text/html": {}}},
        403: {
            "description": "Engine tokens cannot open the dashboard",
            "content": {"text/html": {}},
        },
    },
)
async def dashboard(request: Request, ctx: Context, principal: MaybePrincipal) -> Response:
    env = _env()
    if principal is None:
        return _html(env, "login.html", 401, error=None)
    if principal.role is Role.ENGINE:
        return _html(env, "login.html", 403, error="Engine tokens cannot open the dashboard.")
    await record_admin_access(ctx, request, principal)
    # the verification (shared, kept: kvgov.proxy.api.verifier) before the page's own reads
    verified = await ctx.ledger_report(fleet_wide=principal.fleet_wide)
    data = await run_in_threadpool(_load, ctx, principal, verified)
    return _html(env, "dashboard.html", 200, principal=principal, **data)


@router.post(
    "/dashboard/login",
    summary="Dashboard sign-in",
    description=(
        "Exchange a token (form field `token`) for a dashboard session cookie. Refused (403, "
        "no cookie) when `Sec-Fetch-Site` is present and not `same-origin`/`none`, or `Origin` "
        "is present and not this server's own origin (login CSRF); a request with neither "
        "header (scripts, curl) is allowed."
    ),
    response_class=HTMLResponse,
    responses={
        303: {"description": "Signed in; redirect to /dashboard"},
        401: {"description": "Invalid token: the form again", "content": {"text/html": {}}},
        403: {
            "description": "Engine tokens cannot open the dashboard, or a cross-site request",
            "content": {"text/html": {}},
        },
    },
)
async def login(request: Request, ctx: Context) -> Response:
    env = _env()
    refused = _refuse_cross_site(env, request)
    if refused is not None:
        return refused
    raw = await request.body()
    form = parse_qs(raw[:_MAX_FORM_BYTES].decode("utf-8", "replace"))
    token = (form.get("token") or [""])[0].strip()
    try:
        principal = await in_auth_thread(verify_token, ctx, token)
    except KvgovError:
        return _html(env, "login.html", 401, error="That token is not valid.")
    if principal.role is Role.ENGINE or principal.token_id is None:
        return _html(env, "login.html", 403, error="Engine tokens cannot open the dashboard.")
    session_id = await run_in_threadpool(open_session, ctx, principal.token_id)
    response = RedirectResponse("/dashboard", status_code=303, headers=_SECURITY_HEADERS)
    response.set_cookie(
        SESSION_COOKIE,
        issue_session(ctx.session_secret, principal.token_id, session_id=session_id),
        max_age=SESSION_TTL_S,
        path="/dashboard",
        httponly=True,
        secure=_secure_cookie(ctx, request),
        samesite="strict",
    )
    return response


@router.post(
    "/dashboard/logout",
    summary="Dashboard sign-out",
    description=(
        "End the dashboard session on the server and clear its cookie. Cross-site requests "
        "are refused (403) like sign-in's."
    ),
    response_class=HTMLResponse,
    responses={
        303: {"description": "Signed out; redirect to /dashboard"},
        403: {"description": "A cross-site request", "content": {"text/html": {}}},
    },
)
async def logout(request: Request, ctx: Context) -> Response:
    refused = _refuse_cross_site(_env(), request)
    if refused is not None:
        return refused
    cookie = request.cookies.get(SESSION_COOKIE)
    claims = read_session_claims(ctx.session_secret, cookie) if cookie else None
    if claims is not None and claims[1]:
        await run_in_threadpool(close_session, ctx, claims[1])
    response = RedirectResponse("/dashboard", status_code=303, headers=_SECURITY_HEADERS)
    response.delete_cookie(SESSION_COOKIE, path="/dashboard")
    return response


def mount(app: FastAPI) -> None:
    """Add the dashboard routes and its static files to ``app``."""
    app.include_router(router)
    app.mount("/dashboard/static", StaticFiles(directory=_HERE / "static"), name="kvgov-static")

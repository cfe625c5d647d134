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
"""

from __future__ import annotations

import functools
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import parse_qs

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
    _authenticate_sync,
    close_session,
    issue_session,
    open_session,
    read_session_claims,
    record_admin_access,
    verify_token,
)
from kvgov.proxy.api.v1.audit import report_out, stats_out
from kvgov.proxy.api.v1.purge_reads import purge_summary
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


def _load(ctx: ApiContext, principal: Principal) -> dict[str, Any]:
    """Everything the page shows, read in one session."""
    verify_report = report_out(ctx.verify_ledger())
    with ctx.session() as session:
        stats = q.tenant_stats(
            session, tenants=None if principal.tenant is None else [principal.tenant]
        )
        denials = q.recent_denials(session, tenant=principal.tenant, limit=20)
        purge_rows = qa.list_purges(session, tenant=principal.tenant, limit=20)
    trusted = ctx.trusted_receipt_keys()
    purges = [(purge_summary(r, trusted), r.receipt) for r in purge_rows]
    return {
        "verify": verify_report,
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
        return await run_in_threadpool(
            _authenticate_sync, ctx, request, credentials, allow_cookie=True
        )
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
    data = await run_in_threadpool(_load, ctx, principal)
    return _html(env, "dashboard.html", 200, principal=principal, **data)


@router.post(
    "/dashboard/login",
    summary="Dashboard sign-in",
    description="Exchange a token (form field `token`) for a dashboard session cookie.",
    response_class=HTMLResponse,
    responses={
        303: {"description": "Signed in; redirect to /dashboard"},
        401: {"description": "Invalid token: the form again", "content": {"text/html": {}}},
        403: {
            "description": "Engine tokens cannot open the dashboard",
            "content": {"text/html": {}},
        },
    },
)
async def login(request: Request, ctx: Context) -> Response:
    env = _env()
    raw = await request.body()
    form = parse_qs(raw[:_MAX_FORM_BYTES].decode("utf-8", "replace"))
    token = (form.get("token") or [""])[0].strip()
    try:
        principal = await run_in_threadpool(verify_token, ctx, token)
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
        secure=request.url.scheme == "https",
        samesite="strict",
    )
    return response


@router.post(
    "/dashboard/logout",
    summary="Dashboard sign-out",
    description="End the dashboard session on the server and clear its cookie.",
    response_class=HTMLResponse,
    responses={303: {"description": "Signed out; redirect to /dashboard"}},
)
async def logout(request: Request, ctx: Context) -> Response:
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

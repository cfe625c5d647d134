"""RFC 9457 problem details: every error the control plane answers is ``application/problem+json``.

Domain code raises :mod:`kvgov.errors`; this module is the edge that maps them to HTTP statuses,
together with FastAPI's validation errors (422), unknown routes (404) and anything unexpected
(500, logged with its traceback and the route's template, never the path, whose parameters
may be raw user ids; never shown to the client). For the same reason a problem's ``instance``
is the route's template, never the path (the answer's body may be kept by an ingress, a
browser's error reporting or an APM), and is left out when no route matched.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvgov.errors import (
    AmbiguousRequestError,
    AuthError,
    ForbiddenError,
    IntegrityError,
    InvalidInputError,
    KvgovError,
    LedgerBackpressureError,
    LedgerError,
    NotFoundError,
    RateLimitedError,
    UnknownSubjectError,
)
from kvgov.logging import get_logger
from kvgov.proxy.api.routes import matched_template, route_template

log = get_logger(__name__)

PROBLEM_JSON = "application/problem+json"
_TYPE_BASE = "https://kvgov.dev/problems/"


class FieldError(BaseModel):
    """One invalid input field (422 only)."""

    loc: list[str | int]
    msg: str
    type: str


class Problem(BaseModel):
    """An error answer (RFC 9457). ``code`` is kvgov's stable machine-readable error code."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "type": "https://kvgov.dev/problems/forbidden",
                    "title": "Forbidden",
                    "status": 403,
                    "detail": "this token is scoped to tenant 'acme'",
                    "code": "forbidden",
                }
            ]
        }
    )

    type: str = Field(description="URI identifying the problem type")
    title: str
    status: int
    detail: str | None = None
    instance: str | None = Field(
        default=None,
        description=(
            "the template of the route that answered (`/v1/users/{user}/footprint`), never "
            "the request's path, whose parameters may be personal data; absent when no route "
            "matched"
        ),
    )
    code: str
    errors: list[FieldError] | None = None


class UnavailableError(KvgovError):
    """Something the operation needs is not configured or not reachable here (the KEK for a
    key rotation); answered as 503 with the reason."""

    code = "unavailable"


_STATUS_BY_ERROR: tuple[tuple[type[KvgovError], int], ...] = (
    (AuthError, 401),
    (ForbiddenError, 403),
    (NotFoundError, 404),
    (InvalidInputError, 422),
    (AmbiguousRequestError, 409),
    (UnknownSubjectError, 409),
    (RateLimitedError, 429),
    (UnavailableError, 503),
    (LedgerBackpressureError, 503),
    (IntegrityError, 500),
    (LedgerError, 503),
)

_TITLES = {
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    409: "Conflict",
    422: "Unprocessable Content",
    429: "Too Many Requests",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


def problem_response(
    status: int,
    code: str,
    detail: str | None,
    request: Request | None = None,
    *,
    errors: list[FieldError] | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = Problem(
        type=_TYPE_BASE + code,
        title=_TITLES.get(status, "Error"),
        status=status,
        detail=detail,
        # the route's template, never the path: a path parameter may be a raw user id
        instance=matched_template(request) if request is not None else None,
        code=code,
        errors=errors,
    )
    return JSONResponse(
        body.model_dump(mode="json", exclude_none=True),
        status_code=status,
        media_type=PROBLEM_JSON,
        headers=headers,
    )


def status_for(exc: KvgovError) -> int:
    for cls, status in _STATUS_BY_ERROR:
        if isinstance(exc, cls):
            return status
    return 500


async def _kvgov_error(request: Request, exc: Exception) -> JSONResponse:
    if not isinstance(exc, KvgovError):
        return await _unexpected(request, exc)
    status = status_for(exc)
    headers = {"WWW-Authenticate": 'Bearer realm="kvgov"'} if status == 401 else None
    if isinstance(exc, RateLimitedError):
        headers = {"Retry-After": str(exc.retry_after_s)}
    if status >= 500:
        # the route's template, never the path: a path parameter may be a raw user id
        log.error("api.error", extra={"code": exc.code, "route": route_template(request)})
        detail = exc.message if status == 503 else "internal error"
    else:
        detail = exc.message
    return problem_response(status, exc.code, detail, request, headers=headers)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    if not isinstance(exc, RequestValidationError):
        return await _unexpected(request, exc)
    errors = [
        FieldError(
            loc=[p if isinstance(p, int) else str(p) for p in err.get("loc", ())],
            msg=str(err.get("msg", "")),
            type=str(err.get("type", "")),
        )
        for err in exc.errors()
    ]
    return problem_response(
        422, "validation_error", "the request is not valid", request, errors=errors
    )


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    if not isinstance(exc, StarletteHTTPException):
        return await _unexpected(request, exc)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    detail = exc.detail if isinstance(exc.detail, str) else None
    headers = dict(exc.headers) if exc.headers else None
    return problem_response(exc.status_code, code, detail, request, headers=headers)


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.error("api.unhandled", extra={"route": route_template(request)}, exc_info=exc)
    return problem_response(500, "internal_error", "internal error", request)


def install_problem_handlers(app: FastAPI) -> None:
    """Answer every error of ``app`` as problem+json."""
    app.add_exception_handler(KvgovError, _kvgov_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)


def problem_responses(
    *statuses: int, described: dict[int, str] | None = None
) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses=`` entries documenting the problem answers of an operation
    (``described``: an operation's own wording of some of them)."""
    descriptions = {
        401: "No or invalid bearer token",
        403: "The token's role or tenant does not allow this",
        404: "No such object",
        409: "Ambiguous (`ambiguous_request`: name the tenant)",
        422: "Invalid parameters",
        429: "Too many requests (`rate_limited`): try again after `Retry-After` seconds",
        503: "The ledger (or another dependency) cannot serve this now",
        **(described or {}),
    }
    out: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        out[status] = {
            "model": Problem,
            "description": descriptions.get(status, _TITLES.get(status, "Error")),
            "content": {PROBLEM_JSON: {"schema": {"$ref": "#/components/schemas/Problem"}}},
        }
        if status == 429:
            out[status]["headers"] = {
                "Retry-After": {
                    "description": "whole seconds after which the request may succeed",
                    "schema": {"type": "integer", "minimum": 1},
                }
            }
    return out

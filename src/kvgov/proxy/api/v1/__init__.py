"""The ``/v1`` compliance API and the dashboard, mounted on the control-plane app.

The application factory calls :func:`include_v1` once with an :class:`ApiContext`; nothing is
built at import time. It mounts every read route, purges and keys included; ``POST
/v1/purges`` needs the purge service and is mounted by
:func:`kvgov.proxy.api.v1.purges.include_purges`.
"""

from __future__ import annotations

import secrets

from fastapi import APIRouter, FastAPI
from sqlalchemy import Engine

from kvgov.config import Settings
from kvgov.ledger.events import EventSink
from kvgov.proxy.api.auth import ApiContext
from kvgov.proxy.api.problems import install_problem_handlers

API_DESCRIPTION = """\
Read the kvgov ledger: cache entries, request provenance, user footprints, policy decisions,
ledger integrity, checkpoints, per-tenant stats, erasure requests with their signed receipts,
and data keys; admins also purge and rotate keys.

**Auth**: `Authorization: Bearer <token>` (create one with `kvgov token create`). Roles:
`auditor` reads, `admin` also purges and manages tokens and keys, `engine` tokens are refused
(403). A tenant-scoped token sees only its tenant. Every admin request is a ledger event.

**Errors** are `application/problem+json` (RFC 9457) with a stable `code`.
**Lists** are cursor-paginated: follow `next` until it is null.
User ids are pseudonymised server-side exactly as in the ledger; raw ids are never returned.
"""

OPENAPI_TAGS = [
    {"name": "cache data", "description": "Entries, provenance and user footprints."},
    {"name": "audit", "description": "Decisions, ledger integrity, checkpoints, stats."},
    {"name": "purges", "description": "Right to be forgotten: purge jobs and signed receipts."},
    {"name": "keys", "description": "Data keys: list (auditors), rotate (admins)."},
    {"name": "tokens", "description": "Control-plane tokens (global admins only)."},
    {"name": "tenants", "description": "Tenants' retention periods (admins set them)."},
    {"name": "dashboard", "description": "The read-only compliance dashboard page."},
]


def v1_router() -> APIRouter:
    from kvgov.proxy.api.v1 import audit, entries, keys, purge_reads, tenants, tokens

    router = APIRouter(prefix="/v1")
    router.include_router(entries.router)
    router.include_router(audit.router)
    router.include_router(purge_reads.router)
    router.include_router(keys.router)
    router.include_router(tokens.router)
    router.include_router(tenants.router)
    return router


def include_v1(app: FastAPI, ctx: ApiContext) -> None:
    """Mount ``/v1`` and ``/dashboard`` on ``app`` and answer its errors as problem+json."""
    from kvgov.proxy.api import dashboard

    app.state.kvgov_api = ctx
    install_problem_handlers(app)
    app.include_router(v1_router())
    dashboard.mount(app)
    app.description = (app.description or "") + API_DESCRIPTION
    app.openapi_tags = [*(app.openapi_tags or []), *OPENAPI_TAGS]
    app.openapi_schema = None


def include_sidecar_api(app: FastAPI, settings: Settings, engine: Engine, sink: EventSink) -> None:
    """What the control-plane factory calls: the compliance API over the sidecar's ledger
    engine and writer, pseudonymising with the ledger's key (``kvgov init`` creates it)."""
    from kvgov.ledger.pseudonym import Pseudonymizer

    ctx = ApiContext(
        settings=settings,
        engine=engine,
        sink=sink,
        pseudonymizer=Pseudonymizer.from_file(settings.pseudonym_key_path),
        # dashboard sessions end when the process restarts (sign in again)
        session_secret=secrets.token_bytes(32),
    )
    include_v1(app, ctx)

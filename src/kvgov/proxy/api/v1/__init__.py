"""The ``/v1`` compliance API routes and their OpenAPI description.

:func:`kvgov.proxy.api.compliance.include_v1` mounts them (with the dashboard, which reads
through these routes' helpers; keeping the mounting there keeps ``v1`` and ``dashboard`` out of
an import circle). ``POST /v1/purges`` needs the purge service and is mounted by
:func:`kvgov.proxy.api.v1.purges.include_purges`.
"""

from __future__ import annotations

from fastapi import APIRouter

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

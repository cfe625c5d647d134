"""``/v1/keys``: data keys over REST (the same service as ``kvgov keys``).

``GET /v1/keys`` lists key versions (ids, versions, state, usage, creation and destruction
times; never key material, not even wrapped) to auditors and admins; ``POST /v1/keys/rotate``
lets an admin start a new version for a tenant's key or a user's key, recorded in the ledger
exactly as the CLI records it (:mod:`kvgov.services.keys`). User ids are pseudonymised on
arrival. There is no shred route: a shred without deleting the ciphertext and the engines'
copies is half an erasure, so over REST keys are shredded only by a purge (``POST
/v1/purges``), which does all of it and signs a receipt.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Protocol

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, ConfigDict, Field

from kvgov.db import queries_admin as qa
from kvgov.db.models import DataKey
from kvgov.errors import InvalidInputError, KeyManagementError, StartupError
from kvgov.keys.ids import KeyInfo
from kvgov.proxy.api.auth import Admin, ApiContext, Context, DbSession, Reader
from kvgov.proxy.api.pagination import (
    DEFAULT_LIMIT,
    CursorParam,
    LimitParam,
    Page,
    decode_cursor,
    next_link,
)
from kvgov.proxy.api.problems import UnavailableError, problem_responses
from kvgov.proxy.api.v1.params import SAFE_TEXT, TenantQuery, UserQuery
from kvgov.services import keys as keys_service
from kvgov.types import KeyState

router = APIRouter(tags=["keys"])

_PSEUDO = "3f9c2a51b0d84e6f9a7c11d2e8b45a90"
_KEY_EXAMPLE: dict[str, Any] = {
    "key_id": f"u:acme:{_PSEUDO}",
    "version": 2,
    "tenant": "acme",
    "user": _PSEUDO,
    "state": "active",
    "usage_count": 1843,
    "kek_id": "file:8c1e0e0a7a3f",
    "created_at": "2026-11-21T10:15:02Z",
    "destroyed_at": None,
}


class KeyOut(BaseModel):
    """One version of a data key: what may be shown (never material)."""

    model_config = ConfigDict(json_schema_extra={"examples": [_KEY_EXAMPLE]})

    key_id: str = Field(description="`t:<tenant>` or `u:<tenant>:<user pseudonym>`")
    version: int
    tenant: str
    user: str | None = Field(description="pseudonym of the user of a user-scoped key")
    state: KeyState = Field(description="active (new writes), retired (reads only), destroyed")
    usage_count: int = Field(description="chunks sealed under this version (flushed counts)")
    kek_id: str = Field(description="the key-encryption key that wraps it")
    created_at: datetime
    destroyed_at: datetime | None = Field(description="when it was crypto-shredded")


class KeyRotate(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{"tenant": "acme"}, {"tenant": "acme", "user": "u42"}]},
    )

    tenant: str = Field(min_length=1, max_length=64, pattern=r"^[^\s:\x00-\x1f\x7f]+$")
    user: str | None = Field(
        default=None,
        min_length=1,
        max_length=256,
        pattern=SAFE_TEXT,
        description="raw user id (pseudonymised on arrival); omit to rotate the tenant key",
    )


class LedgerPosition(BaseModel):
    chain_id: str
    seq: int


class KeyRotated(BaseModel):
    """The new version, and where the ledger recorded the rotation."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [{"rotated": _KEY_EXAMPLE, "ledger": [{"chain_id": "node-a", "seq": 812}]}]
        }
    )

    rotated: KeyOut
    ledger: list[LedgerPosition]


class _ApiKeyring(Protocol):  # what the routes need of kvgov.keys.keyring.Keyring
    def rotate(self, tenant: str, user: str | None = None) -> KeyInfo: ...

    def next_version(self, tenant: str, user: str | None = None) -> int: ...

    def flush_usage(self) -> None: ...


def _keyring(request: Request, ctx: ApiContext) -> _ApiKeyring:
    """The sidecar's keyring when the app has one, else one built from the settings once."""
    ring = getattr(request.app.state, "kvgov_keyring", None) or ctx.keyring
    if ring is None:
        from kvgov.db.keystore import SqlKeyStore
        from kvgov.keys.keyring import Keyring

        try:
            ring = Keyring.from_settings(ctx.settings, SqlKeyStore(ctx.engine))
        except (StartupError, OSError) as exc:
            raise UnavailableError(f"key management is not available here: {exc}") from exc
        ctx.keyring = ring
    return ring  # type: ignore[no-any-return]


def key_out(row: DataKey | KeyInfo) -> KeyOut:
    return KeyOut(
        key_id=row.key_id,
        version=row.version,
        tenant=row.tenant,
        user=row.user,
        state=KeyState(row.state),
        usage_count=row.usage_count,
        kek_id=row.kek_id,
        created_at=row.created_at,
        destroyed_at=row.destroyed_at,
    )


def _key_cursor(cursor: str | None) -> tuple[str, int] | None:
    if cursor is None:
        return None
    key_id, version = decode_cursor(cursor, (str, int))
    if not isinstance(key_id, str) or not isinstance(version, int):
        raise InvalidInputError("cursor is not valid")
    return (key_id, version)


@router.get(
    "/keys",
    summary="List data keys",
    description=(
        "Every data key version (of the caller's tenant for tenant-scoped tokens), ordered by "
        "key id and version: state, usage and creation/destruction times. Never key material. "
        "`user` (raw id, pseudonymised server-side; needs `tenant`) shows one user's keys."
    ),
    response_model=Page[KeyOut],
    responses=problem_responses(401, 403, 422),
)
def list_keys(
    *,
    request: Request,
    principal: Reader,
    ctx: Context,
    session: DbSession,
    tenant: TenantQuery = None,
    user: UserQuery = None,
    state: Annotated[KeyState | None, Query(description="Key state.", examples=["active"])] = None,
    limit: LimitParam = DEFAULT_LIMIT,
    cursor: CursorParam = None,
) -> Page[KeyOut]:
    tenant = principal.tenant_filter(tenant)
    pseudonym = None
    if user is not None:
        if tenant is None:
            raise InvalidInputError("filtering by user needs a tenant (pseudonyms are per tenant)")
        pseudonym = ctx.pseudonymizer.user(tenant, user)
    ring = getattr(request.app.state, "kvgov_keyring", None) or ctx.keyring
    if ring is not None:
        ring.flush_usage()  # the usage this process counted but has not written yet
    rows = qa.list_keys(
        session,
        tenant=tenant,
        user=pseudonym,
        state=state,
        after=_key_cursor(cursor),
        limit=limit + 1,
    )
    key = None
    if len(rows) > limit:
        key = (rows[limit - 1].key_id, rows[limit - 1].version)
    return Page[KeyOut](
        items=[key_out(r) for r in rows[:limit]], limit=limit, next=next_link(request, key)
    )


@router.post(
    "/keys/rotate",
    summary="Rotate a data key",
    description=(
        "Retire the active version of a tenant's key (or, with `user`, of that user's key) and "
        "start a new one for new writes; data sealed under older versions stays readable. The "
        "first rotation of a scope with no key creates version 1. Recorded in the ledger "
        "(`key:rotated` / `key:created`, principal = the token) like `kvgov keys rotate`. "
        "Admins only; a tenant-scoped admin may rotate only its tenant's keys. Shredding is "
        "not offered here: it is part of a purge (`POST /v1/purges`)."
    ),
    response_model=KeyRotated,
    responses=problem_responses(401, 403, 422, 503),
)
async def rotate_key(
    body: KeyRotate, principal: Admin, ctx: Context, request: Request
) -> KeyRotated:
    principal.check_tenant(body.tenant)
    subject = None if body.user is None else ctx.pseudonymizer.user(body.tenant, body.user)
    try:
        keys_service.check_scope(body.tenant, subject)
    except KeyManagementError as exc:
        raise InvalidInputError(exc.message) from exc
    ring = _keyring(request, ctx)
    # recorded before the keyring changes (as token changes are): a ledger that cannot take
    # the event (backpressure, database down) fails the request with nothing rotated
    planned = await run_in_threadpool(
        keys_service.planned_rotation,
        ring,
        body.tenant,
        subject,
        principal=principal.id,
        reason="api rotate",
    )
    first = await ctx.sink.append(planned)
    done = await run_in_threadpool(
        keys_service.rotate_key,
        ring,
        body.tenant,
        subject,
        principal=principal.id,
        reason="api rotate",
        recorded=planned,
    )
    recorded = [{"chain_id": first.chain_id, "seq": first.seq}]
    recorded += await keys_service.record(ctx.sink, done.events)
    return KeyRotated(rotated=key_out(done.key), ledger=[LedgerPosition(**r) for r in recorded])

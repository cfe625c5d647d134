"""``/v1/tokens``: admins manage control-plane tokens over REST (same as ``kvgov token``).

Creating or revoking a token is a ledger event (``token:created`` / ``token:revoked``), recorded
before the change is written: the ledger may name a token whose commit then failed, never the
other way round (and on SQLite the single writer is never waited on while holding a write). The
API believes those events over the row (:mod:`kvgov.services.tokens`), and a creation only
under a head its writer signed (:mod:`kvgov.ledger.token_trail`): the head is signed after the
creation is chained and before the token exists.
"""

from __future__ import annotations

from typing import Annotated, Protocol, runtime_checkable

from fastapi import APIRouter, Path, Response, status
from fastapi.concurrency import run_in_threadpool

from kvgov.db.tokens import TokenRecord, TokenRepository, new_token, new_token_id
from kvgov.errors import NotFoundError
from kvgov.proxy.api.auth import Context, GlobalAdmin
from kvgov.proxy.api.problems import problem_responses
from kvgov.proxy.api.v1.schemas import TokenCreate, TokenCreated, TokenOut
from kvgov.services.tokens import token_event
from kvgov.types import EventKind

router = APIRouter(tags=["tokens"])


@runtime_checkable
class HeadSigner(Protocol):
    """A sink that signs its chain's head on demand (the sidecar's
    :class:`~kvgov.ledger.writer.LedgerWriter`)."""

    async def write_checkpoint(self) -> object: ...


TokenIdPath = Annotated[
    str,
    Path(
        min_length=1,
        max_length=36,
        pattern=r"^[0-9a-f-]+$",
        examples=["5b0c8a8e-1f0e-4f55-9d73-2d7f9a3b8c11"],
    ),
]


def token_out(record: TokenRecord) -> TokenOut:
    return TokenOut(
        id=record.id,
        name=record.name,
        role=record.role,
        tenant=record.tenant,
        created_at=record.created_at,
        revoked_at=record.revoked_at,
        last_used_at=record.last_used_at,
    )


@router.get(
    "/tokens",
    summary="List tokens",
    description="Every control-plane token (never the token itself). Admins without a tenant.",
    response_model=list[TokenOut],
    responses=problem_responses(401, 403),
)
async def list_tokens(principal: GlobalAdmin, ctx: Context) -> list[TokenOut]:
    def run() -> list[TokenRecord]:
        with ctx.session() as session:
            return TokenRepository(session).all()

    return [token_out(r) for r in await run_in_threadpool(run)]


@router.post(
    "/tokens",
    summary="Create a token",
    description="Create a token; the response carries the bearer token, shown only this once.",
    status_code=status.HTTP_201_CREATED,
    response_model=TokenCreated,
    responses=problem_responses(401, 403, 422),
)
async def create_token(body: TokenCreate, principal: GlobalAdmin, ctx: Context) -> TokenCreated:
    token_id, raw = new_token_id(), new_token()
    await ctx.sink.append(
        token_event(
            EventKind.TOKEN_CREATED, token_id, body.role, body.tenant, principal.id, token=raw
        )
    )
    if isinstance(ctx.sink, HeadSigner):
        # the API counts a creation only under a head its writer signed (review r17, F1):
        # signed now, before the token exists, so it is proven at its first use. A failure
        # fails the request, and no token exists that its creation does not explain
        await ctx.sink.write_checkpoint()

    def run() -> tuple[TokenRecord, str]:
        with ctx.session() as session:
            out = TokenRepository(session).create(
                body.role, tenant=body.tenant, name=body.name, token_id=token_id, token=raw
            )
            session.commit()
            return out

    record, token = await run_in_threadpool(run)
    return TokenCreated(**token_out(record).model_dump(), token=token)


@router.delete(
    "/tokens/{token_id}",
    summary="Revoke a token",
    description="Revoke a token at once (idempotent). Its dashboard sessions end with it.",
    status_code=status.HTTP_204_NO_CONTENT,
    response_class=Response,
    responses=problem_responses(401, 403, 404, 422),
)
async def revoke_token(token_id: TokenIdPath, principal: GlobalAdmin, ctx: Context) -> Response:
    def find() -> TokenRecord | None:
        with ctx.session() as session:
            return TokenRepository(session).get(token_id)

    def run() -> None:
        with ctx.session() as session:
            TokenRepository(session).revoke(token_id)
            session.commit()

    found = await run_in_threadpool(find)
    if found is None:
        raise NotFoundError(f"no token with id {token_id!r}")
    await ctx.sink.append(
        token_event(EventKind.TOKEN_REVOKED, found.id, found.role, found.tenant, principal.id)
    )
    await run_in_threadpool(run)
    return Response(status_code=status.HTTP_204_NO_CONTENT)

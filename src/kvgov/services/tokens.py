"""Control-plane tokens: the one ledger event that ``kvgov token`` and ``/v1/tokens`` record.

Creating or revoking a token is recorded before the change is written (the ledger may name a
token whose commit then failed, never the other way round). Persistence is
:mod:`kvgov.db.tokens`; this module is the part the CLI and the API share.

The ledger is what the API believes of a token (review r15, F3): a chained ``token:revoked``
revokes it whatever its row says, and a ``token:created`` records, besides the token's id, role
and tenant, a digest of its hash (:func:`kvgov.db.tokens.creation_digest`), so a row whose hash
was swapped no longer matches its creation. The token is therefore drawn before its creation is
recorded (:func:`new_token`), and the row is written with it.
"""

from __future__ import annotations

from kvgov.db.tokens import DIGEST_KEY, creation_digest, hash_token
from kvgov.ledger.events import Event
from kvgov.types import EventKind, Role


def token_event(
    kind: EventKind,
    token_id: str,
    role: Role,
    tenant: str | None,
    principal: str,
    *,
    token: str | None = None,
) -> Event:
    """The ``token:created`` / ``token:revoked`` event for one token (never the token itself,
    nor its stored hash). A creation needs ``token``: it records its digest."""
    if kind not in (EventKind.TOKEN_CREATED, EventKind.TOKEN_REVOKED):
        raise ValueError(f"not a token event kind: {kind}")
    attrs = {"token_id": token_id, "role": role.value}
    if kind is EventKind.TOKEN_CREATED:
        if token is None:
            raise ValueError("a token:created event records the token's digest: pass token")
        attrs[DIGEST_KEY] = creation_digest(hash_token(token))
    return Event(kind=kind, tenant=tenant, principal=principal, attrs=attrs)

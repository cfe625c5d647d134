"""Control-plane tokens: the one ledger event that ``kvgov token`` and ``/v1/tokens`` record.

Creating or revoking a token is recorded before the change is written (the ledger may name a
token whose commit then failed, never the other way round). Persistence is
:mod:`kvgov.db.tokens`; this module is the part the CLI and the API share.
"""

from __future__ import annotations

from kvgov.ledger.events import Event
from kvgov.types import EventKind, Role


def token_event(
    kind: EventKind, token_id: str, role: Role, tenant: str | None, principal: str
) -> Event:
    """The ``token:created`` / ``token:revoked`` event for one token (never the token itself)."""
    if kind not in (EventKind.TOKEN_CREATED, EventKind.TOKEN_REVOKED):
        raise ValueError(f"not a token event kind: {kind}")
    return Event(
        kind=kind,
        tenant=tenant,
        principal=principal,
        attrs={"token_id": token_id, "role": role.value},
    )

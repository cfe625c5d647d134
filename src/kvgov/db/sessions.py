"""Dashboard sessions on the server: sign-in adds one, every request checks it, sign-out and
expiry delete it.

A session id is 256 random bits (base64url) that only the browser's cookie holds; the table
keeps its SHA-256, the token it was opened with and when it expires. A stolen copy of the
cookie therefore dies with the sign-out, with the expiry, and (checked by the caller) with the
token's revocation. Like every repository here, :class:`SessionRepository` never commits.

One token keeps at most :data:`MAX_SESSIONS_PER_TOKEN` sessions: a sign-in past it ends that
token's oldest (review r15: every sign-in of a valid auditor token added a row, without bound,
and expired rows went only with the next sign-in). Ending the oldest rather than refusing the
sign-in keeps a user who never signed out of old browsers able to sign in; whoever holds the
token could sign in anyway, so ending its other sessions costs them nothing they could not do.
Two sign-ins of one token at once may each keep their own row past the cap (neither sees the
other's yet): the next sign-in trims it back.
"""

from __future__ import annotations

import hashlib
import secrets
from datetime import datetime, timedelta

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from kvgov.db.models import DashboardSession

_MAX_ID_CHARS = 128
#: live dashboard sessions one token may have; a sign-in past it ends the token's oldest
MAX_SESSIONS_PER_TOKEN = 16


def hash_session_id(session_id: str) -> str:
    return hashlib.sha256(session_id.encode("utf-8")).hexdigest()


class SessionRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

    def open(self, token_id: str, *, ttl_s: int, now: datetime) -> str:
        """A new session of ``token_id``; returns its id (stored only as a hash). Sessions
        past their expiry (every token's) are deleted on the way, and so are this token's
        oldest beyond :data:`MAX_SESSIONS_PER_TOKEN` with the new one (their cookies open
        nothing from then on)."""
        self.session.execute(delete(DashboardSession).where(DashboardSession.expires_at < now))
        session_id = secrets.token_urlsafe(32)
        id_hash = hash_session_id(session_id)
        # the token's other sessions, newest first: all but the newest cap - 1 end
        older = (
            select(DashboardSession.id_hash)
            .where(DashboardSession.token_id == token_id, DashboardSession.id_hash != id_hash)
            .order_by(DashboardSession.created_at.desc(), DashboardSession.id_hash.desc())
            .offset(MAX_SESSIONS_PER_TOKEN - 1)
        )
        ended = list(self.session.scalars(older))
        if ended:
            self.session.execute(
                delete(DashboardSession).where(DashboardSession.id_hash.in_(ended))
            )
        self.session.add(
            DashboardSession(
                id_hash=id_hash,
                token_id=token_id,
                created_at=now,
                expires_at=now + timedelta(seconds=ttl_s),
            )
        )
        return session_id

    def token_of(self, session_id: str, *, now: datetime) -> str | None:
        """The token id of a live session, else None (unknown, signed out or expired)."""
        if not session_id or len(session_id) > _MAX_ID_CHARS:
            return None
        row = self.session.execute(
            select(DashboardSession.token_id, DashboardSession.expires_at).where(
                DashboardSession.id_hash == hash_session_id(session_id)
            )
        ).first()
        if row is None or row.expires_at <= now:
            return None
        return str(row.token_id)

    def close(self, session_id: str) -> bool:
        """End a session (sign-out). True if it was open."""
        if not session_id or len(session_id) > _MAX_ID_CHARS:
            return False
        done = self.session.execute(
            delete(DashboardSession).where(DashboardSession.id_hash == hash_session_id(session_id))
        )
        return bool(getattr(done, "rowcount", 0))

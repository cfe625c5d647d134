"""The fleet registry (``sidecars``): each sidecar's heartbeat and who counts as live.

A sidecar registers on start and refreshes ``last_seen_at`` on its own clock (the sidecar's
heartbeat task, and its purge executor when it starts and on every poll). A purge job gives its
``tiers``/``engines`` steps to every sidecar seen within ``purge.sidecar_live_s``
(:func:`live_sidecars`); nothing else reads the table. Functions take a :class:`Session` and
never commit: the caller owns the transaction.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from kvgov.db.models import Sidecar


def heartbeat(s: Session, sidecar_id: str, *, now: datetime, chain_id: str | None) -> None:
    """Register ``sidecar_id`` (first beat) or refresh its ``last_seen_at``."""
    row = s.get(Sidecar, sidecar_id)
    if row is None:
        s.add(Sidecar(id=sidecar_id, chain_id=chain_id, started_at=now, last_seen_at=now))
    else:
        row.last_seen_at = now


def live_sidecars(s: Session, *, now: datetime, max_age_s: float) -> list[str]:
    """Sidecars that reported within ``max_age_s``: each gets its own tiers/engines steps."""
    since = now - timedelta(seconds=max_age_s)
    return list(s.scalars(select(Sidecar.id).where(Sidecar.last_seen_at >= since)))

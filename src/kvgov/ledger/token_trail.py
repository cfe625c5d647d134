"""Which API token events the ledger vouches for (review r17, F1).

The API weighs every token row against the token's chained ``token:created`` events
(:func:`kvgov.db.tokens.judge`). The runtime role may INSERT into ``chains`` and
``ledger_events`` and the chain hash is unkeyed, so a row in ``ledger_events`` proves nothing by
itself: that role could register a chain of its own (any key, or a trusted public key copied)
and put a ``token:created`` on it that names the admin token it just minted, and the API served
that token as recorded, silencing the one alarm for minting (``api.token.unrecorded``). A
creation counts only where :func:`kvgov.ledger.purge_trail.proves_event` holds, exactly as a
purge receipt's events do: its own hash covers its columns, on a chain a trusted key holds and
whose genesis that key signed, at a position a writer session of that key covered and signed
a head at or above while it was live. The writers that record a creation sign their head
before the token row is written (``POST /v1/tokens``; ``kvgov token create`` closes its
session with a checkpoint), so an honest token's creation is proven by its first use.

Proving costs a seal and checkpoint read of the event's chain, so it is memoised: a proven
event (by chain, position and hash: the runtime role cannot change a row once written) for
the life of the process, an unproven one for :data:`RETRY_S` (a creation chained by a writer
that had not signed yet, e.g. a pod of the previous release during a rolling upgrade, is
proven by that writer's next periodic checkpoint). The token's request then costs nothing
more than the one indexed lookup of its events it already made.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection
from typing import Any

from sqlalchemy import Row
from sqlalchemy.orm import Session

from kvgov.ledger.purge_trail import proves_event

#: seconds an unproven event is not looked at again (it is treated as not chained meanwhile)
RETRY_S = 30.0
#: unproven events remembered at most (the runtime role can insert any number): past it the
#: memo starts afresh, which costs a new proof of each, never a wrong answer
_REFUSED_MAX = 4096
#: the reader name the seal and checkpoint reads log a capped read under
READER = "api_tokens"

#: an event's identity: chain, position and stored hash
EventKey = tuple[str, int, str]


class TokenEventProofs:
    """Memoised :func:`~kvgov.ledger.purge_trail.proves_event` for token events (one per
    :class:`~kvgov.proxy.api.auth.ApiContext`; thread-safe: authentication runs on several
    threads)."""

    def __init__(self, retry_s: float = RETRY_S) -> None:
        self._retry_s = retry_s
        self._lock = threading.Lock()
        self._proven: set[EventKey] = set()
        #: unproven events and the monotonic time until which they stay so
        self._refused: dict[EventKey, float] = {}

    def vouches(
        self, session: Session, row: Row[Any], trusted: Callable[[], Collection[bytes]]
    ) -> bool:
        """Whether the ledger vouches for ``row`` (a ``ledger_events`` row, every column).
        ``trusted`` gives the keys a chain must be held by, asked only when the memo does not
        answer."""
        key: EventKey = (str(row.chain_id), int(row.seq), str(row.hash))
        now = time.monotonic()
        with self._lock:
            if key in self._proven:
                return True
            until = self._refused.get(key)
            if until is not None and now < until:
                return False
        proven = proves_event(row, trusted(), session.connection(), READER)
        with self._lock:
            if proven:
                self._proven.add(key)
                self._refused.pop(key, None)
            else:
                if len(self._refused) >= _REFUSED_MAX:
                    self._refused.clear()
                self._refused[key] = now + self._retry_s
        return proven

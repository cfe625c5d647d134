"""Erasure fences: what a purge under way tells the data plane, so no put outlives it.

A purge's tier step reads its scope once (``cache_entries``) and deletes exactly that. A put
admitted before it and still arriving (a large value on a slow link, pool backpressure, an
engine trickling its payload on purpose) would be stored after that read and stay live under a
``completed`` receipt (review r10, F2). So before the step reads its scope, it raises a fence
in this process's pipeline (:meth:`~kvgov.proxy.dataplane.pipeline.Pipeline.fence`): a tenant
and, for a user purge, the subject's pseudonym. While it stands:

- every put of that scope in flight when it was raised is marked, and is not made visible
  when its bytes have arrived: removed from any tier it reached, acknowledged ``error``;
- a put of that scope admitted while it stands is refused at admission (``denied``).

Both are recorded as ``kv:entry:denied`` with reason :data:`ERASURE_IN_PROGRESS`. A fence
stands for its purge job's life: it is lifted once the job is finished (here or by another
process), or at the latest at ``until`` (the job's timeout and a step lease later: by then the
job has had its final step claimable for a whole lease).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvgov.errors import KvgovError
from kvgov.proxy.dataplane.index import EntryMeta

#: the reason a fenced put's denial and ack carry
ERASURE_IN_PROGRESS = "erasure_in_progress"


@dataclass(frozen=True, slots=True)
class Fence:
    """One erasure under way: ``tenant``'s data, or, with ``subject``, that user's in it."""

    tenant: str
    #: the purged user's pseudonym (None: the whole tenant)
    subject: str | None
    #: ``time.time()`` after which it lapses even if nobody lifted it
    until: float

    def covers(self, tenant: str, actor: str | None, key_user: str | None) -> bool:
        """Whether a put by ``actor`` (of a key tagged ``key_user``) in ``tenant`` is in scope:
        the whole tenant, or the subject acts or the key is the subject's (as a user purge's
        scope: owned by or scoped to the subject)."""
        if tenant != self.tenant:
            return False
        subject = self.subject
        return subject is None or subject in (actor, key_user)

    def holds(self, entry: EntryMeta) -> bool:
        """Whether a stored entry is in scope (owned by or scoped to the subject)."""
        return self.covers(entry.tenant, entry.owner, entry.scope_user)


class ErasureFencedError(KvgovError):
    """A put in flight when an erasure of its scope began: not made visible."""

    code = ERASURE_IN_PROGRESS


def in_scope(entries: Iterable[tuple[str, EntryMeta]], fence: Fence) -> list[str]:
    """The digests of ``entries`` (an index's items) a purge of ``fence``'s scope covers."""
    return [digest for digest, entry in entries if fence.holds(entry)]

"""What a purge covers, found through the ledger, and the ledger-side erasure.

Scope errs on the side of deleting more (KV cache is recomputable): a user purge covers every
cache entry of the tenant that the user owns, that is scoped to the user, *or* that the user ever
put (a chained ``kv:put`` or ``kv:put:kept`` by the user for that key: a re-put of a live entry
keeps its first owner), in any state (an entry marked expired or deleted may still linger in a
tier some sidecar could not reach at the time); a tenant purge covers every entry of the tenant
and every key a chained put of the tenant names. The "put" part stands on the chained events,
which the runtime database role can only append to, not on the mutable ``cache_entries`` row:
a row moved to another tenant or re-keyed stays in scope, and a digest whose row is missing is
still deleted from the tiers and evicted (:func:`scoped_entries`). Functions take a session and
never commit.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import ColumnElement, and_, func, or_, select, tuple_, update
from sqlalchemy.orm import Session

from kvgov.db.models import CacheEntry, EventPayload, LedgerEvent, UserRef
from kvgov.ledger.repository import put_digests, tenant_entries, user_digests, user_entries
from kvgov.types import EntryState, EventKind


@dataclass(frozen=True, slots=True)
class ScopedEntry:
    key_digest: str
    #: None: no ``cache_entries`` row has the digest, though a chained put named it
    state: EntryState | None
    tiers: tuple[str, ...]
    size: int | None


def spelling_variants(user: str) -> set[str]:
    """Other spellings of a raw user id an operator may have meant: surrounding spaces
    stripped, Unicode NFC/NFKC forms, and lower, upper, case-folded, capitalised and title
    case. A purge matches the id exactly as the gateway sent it (its keyed pseudonym); these
    only warn that a near miss has data (:func:`known_subjects`)."""
    forms = {user, user.strip()}
    forms |= {unicodedata.normalize(nf, f) for f in set(forms) for nf in ("NFC", "NFKC")}
    cased = (str.lower, str.upper, str.casefold, str.capitalize, str.title)
    forms |= {case(f) for f in set(forms) for case in cased}
    forms.discard(user)
    forms.discard("")
    return forms


def known_subjects(s: Session, tenant: str, pseudonyms: Collection[str]) -> set[str]:
    """The ``pseudonyms`` the ledger has seen act in ``tenant`` (its ``user_refs``)."""
    if not pseudonyms:
        return set()
    rows = s.scalars(
        select(UserRef.pseudonym).where(
            UserRef.tenant == tenant, UserRef.pseudonym.in_(list(pseudonyms))
        )
    )
    return set(rows)


def _entry_filter(tenant: str, subject: str | None) -> ColumnElement[bool]:
    if subject is None:
        return tenant_entries(tenant)
    return user_entries(subject, tenant)


def scoped_entries(s: Session, tenant: str, subject: str | None) -> list[ScopedEntry]:
    """The entries a purge deletes and evicts, by key digest: the rows in scope, and the
    digests the scope's chained puts name that no row has (a row re-keyed by whoever holds the
    runtime role; state unknown, so None)."""
    rows = s.execute(
        select(CacheEntry.key_digest, CacheEntry.state, CacheEntry.tiers, CacheEntry.size).where(
            _entry_filter(tenant, subject)
        )
    )
    found = [
        ScopedEntry(digest, state, tuple(tiers or ()), size) for digest, state, tiers, size in rows
    ]
    rowless = put_digests(tenant, subject).where(
        ~select(CacheEntry.key_digest)
        .where(CacheEntry.key_digest == LedgerEvent.key_digest)
        .exists()
    )
    found += [ScopedEntry(d, None, (), None) for d in s.scalars(rowless.distinct()) if d]
    return sorted(found, key=lambda e: e.key_digest)


#: what ``Identity.principal`` records for an authenticated engine connection
ENGINE_PRINCIPAL = "engine:"
#: what it records for the ``lm://`` listener's engine (no control channel: never sent EVICT)
LM_PRINCIPAL = "lm:"
#: the events after which an engine's local tiers may hold a copy of the entry
_HOLDING_KINDS = (EventKind.KV_PUT, EventKind.KV_PUT_KEPT, EventKind.KV_GET)


@dataclass(frozen=True, slots=True)
class Holders:
    """The engines the ledger saw store or read a tenant's data.

    ``anywhere`` (any of the tenant's data, through any sidecar) may be sent the purge's EVICT
    on whichever sidecar they are connected to: an engine may have moved between sidecars.
    ``here`` and ``lm_here`` stored or read an entry *in the purge's scope* through the
    executing sidecar (on its chain), so that sidecar must reach them or name them
    unreachable; each other sidecar's ``engines@S`` answers for its own chain."""

    anywhere: frozenset[str] = frozenset()
    #: kvgov-wire engine ids that held an entry in scope through this sidecar's chain
    here: frozenset[str] = frozenset()
    #: ``lm://`` engine ids that held an entry in scope through this sidecar's chain
    lm_here: frozenset[str] = frozenset()


def _held(tenant: str) -> ColumnElement[bool]:
    return and_(
        LedgerEvent.tenant == tenant,
        LedgerEvent.kind.in_([str(k) for k in _HOLDING_KINDS]),
        or_(
            LedgerEvent.principal.like(ENGINE_PRINCIPAL + "%"),
            LedgerEvent.principal.like(LM_PRINCIPAL + "%"),
        ),
    )


def engines_that_held(
    s: Session, tenant: str, subject: str | None = None, *, chain_id: str | None = None
) -> Holders:
    """The engines the ledger saw store or read ``tenant``'s data (their local tiers may hold
    copies), through ``ix_ledger_events_tenant_kind``; with ``chain_id`` (the executing
    sidecar's chain) also those that did so on that chain for an entry in the purge's scope
    (``subject``'s digests, :func:`~kvgov.ledger.repository.user_digests`, as
    :func:`scoped_entries` finds them, rows or not; every entry for a tenant purge:
    ``ix_ledger_events_key_digest``)."""
    anywhere: set[str] = set()
    for (principal,) in s.execute(select(LedgerEvent.principal).where(_held(tenant)).distinct()):
        if principal and principal.startswith(ENGINE_PRINCIPAL):
            anywhere.add(principal[len(ENGINE_PRINCIPAL) :])
    here: set[str] = set()
    lm_here: set[str] = set()
    if chain_id is not None:
        ours = and_(_held(tenant), LedgerEvent.chain_id == chain_id)
        if subject is not None:
            # the scope's digests whether or not a row has them (a row gone, or never written
            # for a put only the chain records): a holder of such a digest is reached too
            ours = and_(ours, LedgerEvent.key_digest.in_(user_digests(subject, tenant)))
        for (principal,) in s.execute(select(LedgerEvent.principal).where(ours).distinct()):
            if principal and principal.startswith(ENGINE_PRINCIPAL):
                here.add(principal[len(ENGINE_PRINCIPAL) :])
            elif principal:
                lm_here.add(principal[len(LM_PRINCIPAL) :])
    return Holders(frozenset(anywhere), frozenset(here), frozenset(lm_here))


def _event_filter(tenant: str, subject: str | None) -> ColumnElement[bool]:
    if subject is None:
        return LedgerEvent.tenant == tenant
    in_scope = select(CacheEntry.key_digest).where(_entry_filter(tenant, subject))
    return and_(
        LedgerEvent.tenant == tenant,
        or_(LedgerEvent.actor == subject, LedgerEvent.key_digest.in_(in_scope)),
    )


def erasable_payloads(s: Session, tenant: str, subject: str | None) -> int:
    """How many stored payloads of the subject's events are not yet erased."""
    q = (
        select(func.count())
        .select_from(EventPayload)
        .join(
            LedgerEvent,
            and_(
                LedgerEvent.chain_id == EventPayload.chain_id,
                LedgerEvent.seq == EventPayload.seq,
            ),
        )
        .where(_event_filter(tenant, subject), EventPayload.erased_at.is_(None))
    )
    return int(s.scalar(q) or 0)


def erase_payloads(s: Session, tenant: str, subject: str | None, *, now: datetime) -> int:
    """Drop the erasable payload of every event by or about the subject (the chained rows keep
    only the salted digest, so the chain still verifies). Returns how many were erased."""
    events = select(LedgerEvent.chain_id, LedgerEvent.seq).where(_event_filter(tenant, subject))
    result = s.execute(
        update(EventPayload)
        .where(
            tuple_(EventPayload.chain_id, EventPayload.seq).in_(events),
            EventPayload.erased_at.is_(None),
        )
        .values(payload=None, salt=None, erased_at=now)
        .execution_options(synchronize_session=False)
    )
    return int(getattr(result, "rowcount", 0) or 0)


def mark_users_erased(s: Session, tenant: str, subject: str | None, *, now: datetime) -> int:
    """Set ``user_refs.erased_at`` for the subject (every user of the tenant for a tenant
    purge). The pseudonym row is kept: it is what the erasure event points at."""
    q = update(UserRef).where(UserRef.tenant == tenant, UserRef.erased_at.is_(None))
    if subject is not None:
        q = q.where(UserRef.pseudonym == subject)
    result = s.execute(q.values(erased_at=now))
    return int(getattr(result, "rowcount", 0) or 0)

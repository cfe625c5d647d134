"""Index changes a writer batch carries, applied in the batch's transaction.

Events explain the mutable tables: a put creates a ``cache_entries`` row and later events change
its state or tiers; a request id upserts ``requests``; a new actor, owner or scoped user gets a
``user_refs`` row; a ``policy:decision`` event records its decision in ``policy_decisions``.
"""

from __future__ import annotations

from collections.abc import Sequence, Set
from typing import Any, Protocol

from sqlalchemy import Connection, bindparam, select, update
from sqlalchemy.dialects import postgresql, sqlite

from kvgov.ledger.events import EntryChange, Event
from kvgov.ledger.models import CacheEntry, PolicyDecision, Request, UserRef, table
from kvgov.types import EventKind

_ENTRY_OPTIONAL = [
    "tenant",
    "owner",
    "scope_user",
    "scope",
    "sensitivity",
    "model",
    "size",
    "tiers",
    "key_id",
    "key_version",
    "expires_at",
    "decision_id",
    "policy_revision",
]

#: set when an entry is created, never changed by later events
_KEEP_ON_UPDATE = frozenset({"key_digest", "created_at", "created_request_id", "chain_id"})


class _Item(Protocol):
    @property
    def event(self) -> Event: ...
    @property
    def attrs(self) -> dict[str, Any]: ...


def apply_indexes(
    conn: Connection,
    chain_id: str,
    batch: Sequence[_Item],
    seqs: list[int],
    known_users: Set[str],
) -> set[str]:
    requests: dict[str, dict[str, Any]] = {}
    users: dict[str, dict[str, Any]] = {}
    entries: dict[str, dict[str, Any]] = {}
    decisions: dict[str, dict[str, Any]] = {}
    for item, seq in zip(batch, seqs, strict=True):
        e = item.event
        at = e.occurred_at
        if e.request_id is not None:
            req = requests.setdefault(
                e.request_id,
                {"request_id": e.request_id, "first_seen_at": at, "tenant": None, "actor": None},
            )
            req["last_seen_at"] = at
            req["tenant"] = req["tenant"] or e.tenant
            req["actor"] = req["actor"] or e.actor
            req["principal"] = e.principal
        if e.actor is not None and e.tenant is not None and e.actor not in known_users:
            users.setdefault(e.actor, {"pseudonym": e.actor, "tenant": e.tenant, "created_at": at})
        if e.entry is not None:
            _merge_entry(entries, e.entry, e, chain_id)
            tenant = e.entry.tenant or e.tenant
            for who in (e.entry.owner, e.entry.scope_user):
                if who is not None and tenant is not None and who not in known_users:
                    users.setdefault(who, {"pseudonym": who, "tenant": tenant, "created_at": at})
        if e.kind == EventKind.POLICY_DECISION:
            decision = _decision_row(item, chain_id, seq)
            if decision is not None:
                decisions.setdefault(decision["decision_id"], decision)
    if users:
        stmt = _insert(conn, table(UserRef)).on_conflict_do_nothing(index_elements=["pseudonym"])
        conn.execute(stmt, list(users.values()))
    if requests:
        ins = _insert(conn, table(Request))
        stmt = ins.on_conflict_do_update(
            index_elements=["request_id"],
            set_={"last_seen_at": ins.excluded.last_seen_at},
        )
        conn.execute(stmt, list(requests.values()))
    if decisions:
        stmt = _insert(conn, table(PolicyDecision)).on_conflict_do_nothing(
            index_elements=["decision_id"]
        )
        conn.execute(stmt, list(decisions.values()))
    if entries:
        _write_entries(conn, entries)
    return set(users)


def _merge_entry(
    entries: dict[str, dict[str, Any]], change: EntryChange, event: Event, chain_id: str
) -> None:
    """Fold successive changes to one key within a batch: later non-None values win."""
    at = event.occurred_at
    current = entries.get(change.key_digest)
    if current is None:
        current = {
            "key_digest": change.key_digest,
            "created_at": at,
            "created_request_id": change.request_id or event.request_id,
            "chain_id": chain_id,
        }
        entries[change.key_digest] = current
    current["state"] = change.state
    current["updated_at"] = at
    if change.tenant is None and event.tenant is not None:
        current.setdefault("tenant", event.tenant)
    for name in _ENTRY_OPTIONAL:
        value = getattr(change, name)
        if value is not None:
            current[name] = list(value) if name == "tiers" else value


def _write_entries(conn: Connection, entries: dict[str, dict[str, Any]]) -> None:
    entries_t = table(CacheEntry)
    existing = set(
        conn.execute(
            select(entries_t.c.key_digest).where(entries_t.c.key_digest.in_(list(entries)))
        ).scalars()
    )
    fresh = [_full_entry(v) for k, v in entries.items() if k not in existing]
    if fresh:
        # another chain may create the same key between the SELECT and here: its row wins, and
        # this event still records what happened
        stmt = _insert(conn, entries_t).on_conflict_do_nothing(index_elements=["key_digest"])
        conn.execute(stmt, fresh)
    groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for key in existing:
        change = entries[key]
        cols = tuple(sorted(c for c in change if c not in _KEEP_ON_UPDATE))
        groups.setdefault(cols, []).append({"b_key": key, **{f"v_{c}": change[c] for c in cols}})
    for cols, params in groups.items():
        stmt = (
            update(entries_t)
            .where(entries_t.c.key_digest == bindparam("b_key"))
            .values({c: bindparam(f"v_{c}") for c in cols})
        )
        conn.execute(stmt, params)


def _full_entry(change: dict[str, Any]) -> dict[str, Any]:
    row = dict.fromkeys(_ENTRY_OPTIONAL)
    row.update(change)
    if row.get("tiers") is None:
        row["tiers"] = []
    return row


def _decision_row(item: _Item, chain_id: str, seq: int) -> dict[str, Any] | None:
    a = item.attrs
    decision_id = a.get("decision_id") or item.event.decision_id
    if not decision_id:
        return None
    return {
        "decision_id": str(decision_id),
        "policy_revision": a.get("policy_revision") or item.event.policy_revision,
        "data_revision": a.get("data_revision"),
        "input_digest": a.get("input_digest"),
        "allowed": bool(a.get("allowed", False)),
        "reasons": list(a.get("reasons") or []),
        "tiers": list(a.get("tiers") or []),
        "ttl_s": a.get("ttl_s"),
        "scope": a.get("scope"),
        "tenant": item.event.tenant,
        "operation": a.get("operation"),
        "first_seen_at": item.event.occurred_at,
        "chain_id": chain_id,
        "seq": seq,
    }


def _insert(conn: Connection, target: Any) -> Any:
    dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
    return dialect.insert(target)

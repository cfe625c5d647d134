"""Index changes a writer batch carries, applied in the batch's transaction.

Events explain the mutable tables: a put creates a ``cache_entries`` row and later events change
its state or tiers; a request id upserts ``requests``; a new actor, owner or scoped user gets a
``user_refs`` row; a ``policy:decision`` event records its decision in ``policy_decisions``.

An entry has lives. A put of an entry that is live (LMCache re-puts chunks it already stored)
refreshes its tiers, size, key, expiry and decision but keeps its life: owner, scope user,
creation time, creating request and chain. A put of an entry that expired, was deleted or purged
starts a new life with the new put's values. Whether the row is live is decided by the UPDATE
itself (a CASE on the row's state), so a concurrent chain's change is not overwritten blindly.
No change rewrites a row's key digest, nor a tenant the chain names: a change only fills an
empty tenant, except that on Postgres a put claims a row whose tenant differs from its own and
no chained event names (a row the runtime role inserted under another tenant before the first
put: nothing else writes one), which then starts a new life with the put's values
(:data:`_CLAIMED`; migration 0012's trigger allows exactly that change).
"""

from __future__ import annotations

import json
from collections.abc import Sequence, Set
from dataclasses import dataclass, field
from datetime import datetime
from enum import Enum
from typing import Any, Protocol

from sqlalchemy import ColumnElement, Connection, Table, bindparam, case, func, select, update
from sqlalchemy.dialects import postgresql, sqlite

from kvgov.db.models import CacheEntry, PolicyDecision, Request, UserRef, table
from kvgov.ledger.events import EntryChange, Event
from kvgov.ledger.pgfast import execute_pipelined
from kvgov.types import EntryState, EventKind

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

#: what a put of a live entry keeps and a put of an ended entry (or a new key) sets: its life
_LIFE = ("owner", "scope_user", "created_at", "created_request_id", "chain_id")

#: what no change rewrites once a row has it: a digest's tenant is fixed by its key (the digest
#: is keyed over the whole key, tenant tag included). An UPDATE only fills an empty one (FILL);
#: the key digest is never written at all. On Postgres an owner trigger refuses any other change
#: to either, the runtime role's own included (migration 0011); purge scope stands on the
#: chained events anyway (``kvgov.ledger.repository.user_entries``)
FIXED_ENTRY_COLUMNS = frozenset({"tenant"})


class _Mode(Enum):
    """How an UPDATE writes one column of an existing ``cache_entries`` row."""

    SET = "set"
    #: the row's value while it is live (a re-put), else the new one (a new life)
    KEEP_IF_LIVE = "keep_if_live"
    #: the row's value if it has one, else the new one
    FILL = "fill"
    #: KEEP_IF_LIVE, filling an empty value (scope_user: err on covering more in a purge)
    FILL_IF_LIVE = "fill_if_live"
    #: a put's tenant: FILL, except that it replaces a tenant no chained event names (a
    #: squatted row, :data:`_CLAIMED`; Postgres only: SQLite has no other role to squat)
    CLAIM = "claim"

    #: members are singletons compared by identity: hashed by it too, in C (``Enum``'s own
    #: ``__hash__`` is a Python call, and each batch hashes a tuple of every column's mode)
    __hash__ = object.__hash__


@dataclass(slots=True)
class _Plan:
    """The changes a batch makes to one key, folded in order."""

    #: every column the batch writes, latest value
    values: dict[str, Any]
    #: how the UPDATE of an existing row writes a column of ``values`` (default SET)
    modes: dict[str, _Mode] = field(default_factory=dict)
    #: the entry's state after the last change folded (None: as in the database)
    state: EntryState | None = None
    #: a put of the entry is among the changes (its tenant may claim a squatted row)
    put: bool = False


class _Item(Protocol):
    @property
    def event(self) -> Event: ...
    @property
    def attrs(self) -> dict[str, Any]: ...


@dataclass(slots=True)
class IndexRows:
    """What a batch writes to the index tables, folded per key."""

    users: dict[str, dict[str, Any]]
    requests: dict[str, dict[str, Any]]
    decisions: dict[str, dict[str, Any]]
    entries: dict[str, _Plan]


def apply_indexes(
    conn: Connection,
    chain_id: str,
    batch: Sequence[_Item],
    seqs: list[int],
    known_users: Set[str],
) -> set[str]:
    """Write the index changes ``batch`` carries; returns the user pseudonyms it inserted."""
    rows = plan_indexes(chain_id, batch, seqs, known_users)
    if conn.dialect.name == "postgresql":
        _write_pg(conn, rows)
        return set(rows.users)
    users, requests, decisions, entries = rows.users, rows.requests, rows.decisions, rows.entries
    if users:
        stmt = dialect_insert(conn, table(UserRef)).on_conflict_do_nothing(
            index_elements=["pseudonym"]
        )
        conn.execute(stmt, list(users.values()))
    if requests:
        ins = dialect_insert(conn, table(Request))
        stmt = ins.on_conflict_do_update(
            index_elements=["request_id", "tenant"],
            set_={"last_seen_at": ins.excluded.last_seen_at},
        )
        conn.execute(stmt, list(requests.values()))
    if decisions:
        stmt = dialect_insert(conn, table(PolicyDecision)).on_conflict_do_nothing(
            index_elements=["decision_id"]
        )
        conn.execute(stmt, list(decisions.values()))
    if entries:
        _write_entries(conn, entries)
    return set(users)


def plan_indexes(
    chain_id: str, batch: Sequence[_Item], seqs: list[int], known_users: Set[str]
) -> IndexRows:
    """Fold the batch's index changes (pure computation)."""
    requests: dict[str, dict[str, Any]] = {}
    users: dict[str, dict[str, Any]] = {}
    entries: dict[str, _Plan] = {}
    decisions: dict[str, dict[str, Any]] = {}
    for item, seq in zip(batch, seqs, strict=True):
        e = item.event
        at = e.occurred_at
        if e.request_id is not None:
            tenant_key = e.tenant or ""  # a request is an id in a tenant (migration 0004)
            req = requests.setdefault(
                f"{tenant_key}\x00{e.request_id}",
                {
                    "request_id": e.request_id,
                    "first_seen_at": at,
                    "tenant": tenant_key,
                    "actor": None,
                },
            )
            req["last_seen_at"] = at
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
    return IndexRows(users, requests, decisions, entries)


def _merge_entry(
    entries: dict[str, _Plan], change: EntryChange, event: Event, chain_id: str
) -> None:
    """Fold one change into the key's plan: later non-None values win, except that a put of an
    entry that is live keeps its life (owner, scope user, creation time and request)."""
    at = event.occurred_at
    plan = entries.get(change.key_digest)
    if plan is None:
        # a row this batch inserts without a put (an evict of an unknown key) starts here
        plan = _Plan(
            values={
                "created_at": at,
                "created_request_id": change.request_id or event.request_id,
                "chain_id": chain_id,
            },
            modes=dict.fromkeys(("created_at", "created_request_id", "chain_id"), _Mode.FILL),
        )
        entries[change.key_digest] = plan
    values, modes = plan.values, plan.modes
    is_put = event.kind == EventKind.KV_PUT and change.state is EntryState.LIVE
    plan.put = plan.put or is_put
    if is_put and plan.state is not EntryState.LIVE:
        life = {
            "owner": change.owner,
            "scope_user": change.scope_user,
            "created_at": at,
            "created_request_id": change.request_id or event.request_id,
            "chain_id": chain_id,
        }
        values.update(life)
        if plan.state is None:  # the first change: the row's state is the database's
            modes.update(dict.fromkeys(_LIFE, _Mode.KEEP_IF_LIVE))
            modes["scope_user"] = _Mode.FILL_IF_LIVE
        else:  # ended earlier in this batch: a new life, whatever the row held
            modes.update(dict.fromkeys(_LIFE, _Mode.SET))
    elif is_put and change.scope_user is not None and values.get("scope_user") is None:
        values["scope_user"] = change.scope_user
        modes.setdefault("scope_user", _Mode.FILL)
    values["state"] = change.state
    values["updated_at"] = at
    if change.tenant is None and event.tenant is not None:
        values.setdefault("tenant", event.tenant)
    for name in _ENTRY_OPTIONAL:
        if is_put and name in _LIFE:
            continue
        value = getattr(change, name)
        if value is not None:
            values[name] = list(value) if name == "tiers" else value
            modes.pop(name, None)
    plan.state = change.state


def _write_entries(conn: Connection, entries: dict[str, _Plan]) -> None:
    entries_t = table(CacheEntry)
    existing = set(
        conn.execute(
            select(entries_t.c.key_digest).where(entries_t.c.key_digest.in_(list(entries)))
        ).scalars()
    )
    fresh = [_full_entry(k, v.values) for k, v in entries.items() if k not in existing]
    if fresh:
        # another chain may create the same key between the SELECT and here: its row wins, and
        # this event still records what happened
        stmt = dialect_insert(conn, entries_t).on_conflict_do_nothing(index_elements=["key_digest"])
        conn.execute(stmt, fresh)
    groups: dict[tuple[tuple[str, _Mode], ...], list[dict[str, Any]]] = {}
    for key in existing:
        plan = entries[key]
        cols = _update_columns(plan)
        params = {f"v_{c}": plan.values[c] for c, _ in cols}
        groups.setdefault(cols, []).append({"b_key": key, **params})
    for cols, rows in groups.items():
        # the CASEs read the row as it is before this UPDATE (and, on Postgres, as committed
        # by any other chain that updated it first): whether the put found it live
        stmt = (
            update(entries_t)
            .where(entries_t.c.key_digest == bindparam("b_key"))
            .values({c: _column_value(entries_t, c, mode) for c, mode in cols})
        )
        conn.execute(stmt, rows)


def _update_columns(plan: _Plan) -> tuple[tuple[str, _Mode], ...]:
    """The columns an UPDATE of the key's existing row writes, each with its mode, sorted (one
    statement per distinct tuple); :data:`FIXED_ENTRY_COLUMNS` are only filled, or claimed by
    a put (:attr:`_Mode.CLAIM`)."""
    modes = plan.modes
    fixed = _Mode.CLAIM if plan.put else _Mode.FILL
    # a list, not a generator (one call per event, not one per column)
    return tuple(
        sorted(
            [
                (c, fixed if c in FIXED_ENTRY_COLUMNS else modes.get(c, _Mode.SET))
                for c in plan.values
            ]
        )
    )


def _column_value(entries_t: Table, name: str, mode: _Mode) -> ColumnElement[Any]:
    column = entries_t.c[name]
    new = bindparam(f"v_{name}", type_=column.type)
    live = entries_t.c.state == EntryState.LIVE
    if mode is _Mode.KEEP_IF_LIVE:
        return case((live, column), else_=new)
    if mode in (_Mode.FILL, _Mode.CLAIM):  # SQLite: no role but the owner writes the file
        return func.coalesce(column, new)
    if mode is _Mode.FILL_IF_LIVE:
        return case((live, func.coalesce(column, new)), else_=new)
    return new


def _full_entry(key: str, values: dict[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = dict.fromkeys(_ENTRY_OPTIONAL)
    row.update(values)
    row["key_digest"] = key
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


def dialect_insert(conn: Connection, target: Any) -> Any:
    """An INSERT of ``target`` in ``conn``'s dialect (Postgres or SQLite): one that takes
    ``on_conflict_do_nothing`` / ``on_conflict_do_update``."""
    dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
    return dialect.insert(target)


# -- Postgres: one set-based statement per table (per group of entry upserts) --------------
#
# Each statement takes its rows as ONE parameter, a JSON array of objects that
# ``json_populate_recordset`` turns into rows of the table's own type (so column types come from
# the schema; a key an object lacks reads as NULL). Against an ``executemany`` this is one
# Bind/Execute and one result per statement instead of one per row: the per-row protocol work
# in psycopg's Python code was most of the writer's commit time for small batches, and
# ``json.dumps`` does the per-value work in C. A batch folds its changes per key first, so no
# statement touches a row twice (which ``ON CONFLICT DO UPDATE`` would refuse).

_ENTRY_COLS = ("key_digest", *_ENTRY_OPTIONAL, "state", "created_at", "updated_at")
_ENTRY_COLS += ("created_request_id", "chain_id")
_USER_COLS = ("pseudonym", "tenant", "created_at")
_REQUEST_COLS = ("request_id", "first_seen_at", "tenant", "actor", "last_seen_at", "principal")
_DECISION_COLS = (
    "decision_id",
    "policy_revision",
    "data_revision",
    "input_digest",
    "allowed",
    "reasons",
    "tiers",
    "ttl_s",
    "scope",
    "tenant",
    "operation",
    "first_seen_at",
    "chain_id",
    "seq",
)


def _from_json(table_name: str, cols: Sequence[str], select_list: str | None = None) -> str:
    names = ", ".join(cols)
    return (
        f"INSERT INTO {table_name} AS t ({names})"  # noqa: S608 - constants
        f" SELECT {select_list or names} FROM json_populate_recordset(NULL::{table_name}, %s)"
    )


_USERS_SQL = _from_json("user_refs", _USER_COLS) + " ON CONFLICT (pseudonym) DO NOTHING"
_REQUESTS_SQL = (
    _from_json("requests", _REQUEST_COLS)
    + " ON CONFLICT (request_id, tenant) DO UPDATE SET last_seen_at = excluded.last_seen_at"
)
_DECISIONS_SQL = (
    _from_json("policy_decisions", _DECISION_COLS) + " ON CONFLICT (decision_id) DO NOTHING"
)
#: a new row's ``tiers`` is never NULL (the column is NOT NULL; an absent value is no tiers)
_ENTRY_SELECT = ", ".join(
    "COALESCE(tiers, '[]'::jsonb)" if c == "tiers" else c for c in _ENTRY_COLS
)
#: whether a put claims the row: its tenant differs from the put's, and no chained event
#: names the row's key digest with the row's tenant. The writer inserts a row in the
#: transaction that chains its first event, under that event's tenant, so such a row is one
#: the runtime role inserted under another tenant before the first put (review: squatted
#: rows); the put's tenant takes it, and the put starts a new life there. The CASE looks at
#: the chain only for a row whose tenant differs (never on the common path: a re-put of the
#: tenant's own row). Migration 0012's trigger allows this change, and no other
_CLAIMED = (
    "(CASE WHEN t.tenant IS NULL OR excluded.tenant IS NULL OR t.tenant = excluded.tenant"
    " THEN false ELSE NOT EXISTS (SELECT 1 FROM ledger_events e"
    " WHERE e.key_digest = t.key_digest AND e.tenant = t.tenant) END)"
)
#: a put finds the row live, and its own (not claimed): it keeps the row's life
_LIVE = f"(t.state = '{EntryState.LIVE.value}' AND NOT {_CLAIMED})"
_MODE_SQL = {
    _Mode.SET: "excluded.{c}",
    _Mode.KEEP_IF_LIVE: "CASE WHEN " + _LIVE + " THEN t.{c} ELSE excluded.{c} END",
    _Mode.FILL: "COALESCE(t.{c}, excluded.{c})",
    _Mode.FILL_IF_LIVE: (
        "CASE WHEN " + _LIVE + " THEN COALESCE(t.{c}, excluded.{c}) ELSE excluded.{c} END"
    ),
    _Mode.CLAIM: (
        "CASE WHEN " + _CLAIMED + " THEN excluded.{c} ELSE COALESCE(t.{c}, excluded.{c}) END"
    ),
}
_entry_sql_cache: dict[tuple[tuple[str, _Mode], ...], str] = {}


def _entry_sql(cols: tuple[tuple[str, _Mode], ...]) -> str:
    """An upsert of ``cache_entries``: a new key gets the full row; an existing one the
    columns ``cols``, each as its mode says (the CASEs read the row as it was, like the UPDATE
    of the portable path)."""
    sql = _entry_sql_cache.get(cols)
    if sql is None:
        sets = ", ".join(f"{c} = " + _MODE_SQL[mode].format(c=c) for c, mode in cols)
        sql = (
            _from_json("cache_entries", _ENTRY_COLS, _ENTRY_SELECT)
            + f" ON CONFLICT (key_digest) DO UPDATE SET {sets}"
        )
        if len(_entry_sql_cache) < 256:
            _entry_sql_cache[cols] = sql
    return sql


def _json_default(value: object) -> str:
    """Timestamps as ISO 8601 with their offset (Postgres reads them to the microsecond)."""
    if isinstance(value, datetime):
        if value.utcoffset() is None:
            raise ValueError("naive datetime given to the ledger; use an aware UTC datetime")
        return value.isoformat()
    raise TypeError(f"cannot store a {type(value).__name__} in an index row")


#: one encoder, built once (``json.dumps(default=...)`` builds one per call); str enums
#: encode as their value
_ROWS_JSON = json.JSONEncoder(default=_json_default, separators=(",", ":"))


def pg_index_statements(rows: IndexRows) -> list[tuple[str, tuple[str]]]:
    """The index changes as ``(sql, (rows_json,))`` statements, in the order the portable path
    writes them (user references, requests, decisions, entries)."""
    encode = _ROWS_JSON.encode
    statements: list[tuple[str, tuple[str]]] = []
    if rows.users:
        statements.append((_USERS_SQL, (encode(list(rows.users.values())),)))
    if rows.requests:
        statements.append((_REQUESTS_SQL, (encode(list(rows.requests.values())),)))
    if rows.decisions:
        statements.append((_DECISIONS_SQL, (encode(list(rows.decisions.values())),)))
    groups: dict[tuple[tuple[str, _Mode], ...], list[dict[str, Any]]] = {}
    for key, plan in rows.entries.items():
        # a new key's row takes every value (the JSON object); an existing one ``cols`` as told
        groups.setdefault(_update_columns(plan), []).append({**plan.values, "key_digest": key})
    statements.extend((_entry_sql(cols), (encode(group),)) for cols, group in groups.items())
    return statements


def _write_pg(conn: Connection, rows: IndexRows) -> None:
    execute_pipelined(conn, pg_index_statements(rows))

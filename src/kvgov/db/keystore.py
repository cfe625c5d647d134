"""Wrapped data keys in the ledger database: ``SqlKeyStore``.

It satisfies :class:`kvgov.keys.store.WrappedKeyStore` structurally (the ledger never imports
``kvgov.keys``). Unlike a repository it is its own unit of work: every call commits, because a
data key must be durable before anything is sealed with it, and a shredded key must stay
shredded whatever happens to the caller's transaction afterwards.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from sqlalchemy import Engine, Row, select, update
from sqlalchemy.exc import IntegrityError

from kvgov.db.engine import SQLITE_BEGIN_IMMEDIATE, utcnow
from kvgov.db.models import DataKey, table
from kvgov.types import KeyState, WrappedKey


def _to_key(row: Row[Any]) -> WrappedKey:
    m = row._mapping
    return WrappedKey(
        key_id=m["key_id"],
        version=m["version"],
        tenant=m["tenant"],
        user=m["user"],
        state=KeyState(m["state"]),
        wrapped=None if m["wrapped"] is None else bytes(m["wrapped"]),
        kek_id=m["kek_id"],
        created_at=m["created_at"],
        usage_count=m["usage_count"],
        destroyed_at=m["destroyed_at"],
    )


class SqlKeyStore:
    """A ``WrappedKeyStore`` on the ``data_keys`` table."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._t = table(DataKey)

    def add(self, key: WrappedKey) -> None:
        try:
            with self.engine.begin() as conn:
                conn.execute(
                    self._t.insert().values(
                        key_id=key.key_id,
                        version=key.version,
                        tenant=key.tenant,
                        user=key.user,
                        state=key.state,
                        wrapped=key.wrapped,
                        kek_id=key.kek_id,
                        created_at=key.created_at,
                        usage_count=key.usage_count,
                        destroyed_at=key.destroyed_at,
                    )
                )
        except IntegrityError:
            raise ValueError(f"key {key.key_id} v{key.version} exists") from None

    def get(self, key_id: str, version: int) -> WrappedKey | None:
        t = self._t
        with self.engine.connect() as conn:
            row = conn.execute(
                select(t).where(t.c.key_id == key_id, t.c.version == version)
            ).first()
        return None if row is None else _to_key(row)

    def latest(self, key_id: str) -> WrappedKey | None:
        t = self._t
        with self.engine.connect() as conn:
            row = conn.execute(
                select(t).where(t.c.key_id == key_id).order_by(t.c.version.desc()).limit(1)
            ).first()
        return None if row is None else _to_key(row)

    def versions(self, tenant: str | None = None) -> list[WrappedKey]:
        t = self._t
        query = select(t).order_by(t.c.key_id, t.c.version)
        if tenant is not None:
            query = query.where(t.c.tenant == tenant)
        with self.engine.connect() as conn:
            return [_to_key(r) for r in conn.execute(query)]

    def states(self, key_ids: Collection[str]) -> dict[tuple[str, int], KeyState]:
        """One query (the primary key's ``key_id`` prefix); the caller bounds the batch."""
        if not key_ids:
            return {}
        t = self._t
        gone = t.c.wrapped.is_(None).label("gone")
        query = select(t.c.key_id, t.c.version, t.c.state, gone).where(
            t.c.key_id.in_(list(key_ids))
        )
        with self.engine.connect() as conn:
            return {
                # a row without wrapped bytes is destroyed whatever its state column says
                (r.key_id, r.version): KeyState.DESTROYED if r.gone else KeyState(r.state)
                for r in conn.execute(query)
            }

    def set_state(self, key_id: str, version: int, state: KeyState) -> bool:
        """Conditional: a destroyed row (or one without wrapped bytes) is never changed, so a
        shred that lands between a caller's read and this call stays a shred."""
        t = self._t
        with self.engine.begin() as conn:
            done = conn.execute(
                update(t)
                .where(
                    t.c.key_id == key_id,
                    t.c.version == version,
                    t.c.state != KeyState.DESTROYED,
                    t.c.wrapped.is_not(None),
                )
                .values(state=state)
            )
            if done.rowcount:
                return True
            exists = conn.execute(
                select(t.c.version).where(t.c.key_id == key_id, t.c.version == version)
            ).first()
        if exists is None:
            raise KeyError((key_id, version))
        return False

    def add_usage(self, key_id: str, version: int, count: int) -> None:
        t = self._t
        with self.engine.begin() as conn:
            done = conn.execute(
                update(t)
                .where(t.c.key_id == key_id, t.c.version == version)
                .values(usage_count=t.c.usage_count + count)
            )
        if done.rowcount == 0:
            raise KeyError((key_id, version))

    def destroy(self, tenant: str, user: str | None) -> list[WrappedKey]:
        t = self._t
        now = utcnow()
        where = [t.c.tenant == tenant, t.c.state != KeyState.DESTROYED]
        if user is not None:
            where.append(t.c.user == user)
        # a read, then writes: on SQLite take the write lock at BEGIN, else a commit by another
        # writer (the ledger's) between the two fails the upgrade at once ("database is locked",
        # the busy timeout does not apply to it)
        immediate = self.engine.connect().execution_options(**{SQLITE_BEGIN_IMMEDIATE: True})
        with immediate as conn, conn.begin():
            rows = conn.execute(select(t).where(*where).with_for_update()).all()
            if not rows:
                return []
            for r in rows:
                conn.execute(
                    update(t)
                    .where(t.c.key_id == r.key_id, t.c.version == r.version)
                    .values(state=KeyState.DESTROYED, wrapped=None, destroyed_at=now)
                )
        return [
            WrappedKey(
                key_id=k.key_id,
                version=k.version,
                tenant=k.tenant,
                user=k.user,
                state=KeyState.DESTROYED,
                wrapped=None,
                kek_id=k.kek_id,
                created_at=k.created_at,
                usage_count=k.usage_count,
                destroyed_at=now,
            )
            for k in map(_to_key, rows)
        ]

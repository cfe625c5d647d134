"""The purge service's transactions on SQLite (the embedded default, ``kvgov demo``) beside
another writer: they wait for the write lock instead of failing with "database is locked".

A deferred SQLite transaction that reads, then writes, fails at once (no busy wait) when another
connection committed in between: its snapshot is stale. Every writer must take the lock at BEGIN
(``BEGIN IMMEDIATE``), as the ledger writer does. ``kvgov demo`` hit it when creating a
purge job while the sidecar's ledger writer and heartbeat were writing.
"""

from __future__ import annotations

import threading
from typing import Any

from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from kvgov.config import Settings
from kvgov.db import sidecars
from kvgov.db.engine import SQLITE_BEGIN_IMMEDIATE, make_engine, make_sessionmaker, upgrade, utcnow
from kvgov.db.models import Sidecar
from kvgov.services.purge.steps import StepContext


def _context(engine: Engine) -> StepContext:
    unused: Any = None  # the ports a database-only call never reaches
    return StepContext(
        settings=Settings(),
        sessions=make_sessionmaker(engine),
        sink=unused,
        tiers=unused,
        shredder=unused,
        evictor=unused,
        local_index=unused,
        sidecar_id="sidecar-a",
        principal="test",
    )


async def test_read_then_write_waits_for_a_writer_that_commits_in_between(
    sqlite_url: str,
) -> None:
    upgrade(sqlite_url)
    engine = make_engine(sqlite_url)
    try:
        ctx = _context(engine)
        immediate = engine.execution_options(**{SQLITE_BEGIN_IMMEDIATE: True})
        other_done = threading.Event()
        errors: list[BaseException] = []

        def other_writer() -> None:  # the ledger writer's way: BEGIN IMMEDIATE, on its connection
            try:
                with Session(immediate) as s, s.begin():
                    sidecars.heartbeat(s, "sidecar-b", now=utcnow(), chain_id=None)
            except BaseException as exc:  # reported below, on the test's thread
                errors.append(exc)
            finally:
                other_done.set()

        def read_then_write(s: Session) -> list[str]:
            live = sidecars.live_sidecars(s, now=utcnow(), max_age_s=60)  # read: snapshot taken
            t = threading.Thread(target=other_writer)
            t.start()
            # a deferred transaction lets the other writer commit now; an immediate one makes
            # it wait for this transaction's end (busy timeout)
            other_done.wait(0.5)
            sidecars.heartbeat(s, "sidecar-a", now=utcnow(), chain_id=None)  # write
            s.flush()
            return live

        assert await ctx.db(read_then_write) == []
        assert other_done.wait(15)
        assert errors == []
        with Session(engine) as s:
            assert sorted(s.scalars(select(Sidecar.id))) == ["sidecar-a", "sidecar-b"]
    finally:
        engine.dispose()

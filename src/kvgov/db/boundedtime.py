"""Timestamps Python cannot hold, read as the edge of its range instead of an error.

The runtime database role (every sidecar's) may INSERT ``ledger_events``, ``purge_jobs`` and
``purge_steps`` rows. Postgres's ``timestamptz`` holds ``infinity``, ``-infinity`` and years
up to 294276, Python's :class:`~datetime.datetime` only years 1 to 9999: psycopg raises
:class:`psycopg.DataError` on every read of such a row, an error no reader expected. One
forged ``purge:step`` event dated ``infinity`` naming a job kept that job from ever finishing
(its receipt reads every event naming it), and broke the purge list and ``audit verify``
(review r14, found beside F1/F2). As :mod:`kvgov.boundedjson` does for JSON, every Postgres
connection of :func:`kvgov.db.engine.make_engine` reads timestamps through the loaders below:
a value past the end of Python's range reads as :data:`FAR_FUTURE`, one before its start as
:data:`FAR_PAST`. Decoding never raises. Such a value is not the one stored, so a ledger row
holding it fails the chain's hash check (its ``occurred_at`` is hashed) and proves nothing;
``audit verify`` names it.

SQLite keeps timestamps as text no other role writes (whoever can write the file owns it all),
so only Postgres connections get these loaders.
"""

from __future__ import annotations

import struct
from datetime import UTC, datetime
from typing import Any

import psycopg
from psycopg import abc
from psycopg.adapt import Buffer, Loader
from psycopg.pq import Format

#: what a timestamp after year 9999 (or ``infinity``) reads as
FAR_FUTURE = datetime.max.replace(tzinfo=UTC)
#: what a timestamp before year 1 (or ``-infinity``) reads as
FAR_PAST = datetime.min.replace(tzinfo=UTC)

_INT8 = struct.Struct("!q")
#: the Postgres types these loaders read, ``timestamp`` (naive) and ``timestamptz``
_TYPES = ("timestamp", "timestamptz")


def _before_year_one(data: Buffer, binary: bool) -> bool:
    """Whether an unreadable timestamp lies before the start of Python's range: negative
    microseconds in the binary format; ``-infinity`` or an era ``BC`` in the text one."""
    raw = bytes(data)
    if binary:
        return bool(_INT8.unpack(raw[:8])[0] < 0)
    return raw.startswith(b"-") or raw.rstrip().endswith(b"BC")


def _bounded(base: type[abc.Loader]) -> type[Loader]:
    """A loader that reads as ``base`` does (psycopg's own, its C one where psycopg has it: a
    final type, so wrapped, not subclassed), answering :data:`FAR_FUTURE` or :data:`FAR_PAST`
    where ``base`` would raise ``DataError``."""
    binary = base.format == Format.BINARY
    naive = "Timestamptz" not in base.__name__

    class Bounded(Loader):
        format = base.format

        def __init__(self, oid: int, context: Any = None) -> None:
            super().__init__(oid, context)
            self._inner = base(oid, context)

        def load(self, data: Buffer) -> Any:
            try:
                return self._inner.load(data)
            except psycopg.DataError:
                edge = FAR_PAST if _before_year_one(data, binary) else FAR_FUTURE
                return edge.replace(tzinfo=None) if naive else edge

    Bounded.__name__ = Bounded.__qualname__ = f"Bounded{base.__name__}"
    return Bounded


def install(conn: psycopg.Connection[Any]) -> None:
    """Read ``conn``'s timestamps through the bounded loaders (text and binary formats)."""
    adapters = conn.adapters
    for name in _TYPES:
        oid = adapters.types[name].oid
        for fmt in (Format.TEXT, Format.BINARY):
            base = adapters.get_loader(oid, fmt)
            if base is not None and not base.__name__.startswith("Bounded"):
                adapters.register_loader(oid, _bounded(base))

"""One key of a ledger event's ``attrs`` as text, in SQL, the way an expression index names it:
``(attrs ->> 'key')`` on Postgres, ``json_extract(attrs, '$.key')`` on SQLite (kvgov's two
dialects; elsewhere it renders as a call the database will not know). NULL where there is none.

Each indexed key is a subclass naming its key (:class:`~kvgov.db.purge_index.purge_id_of`,
:class:`~kvgov.db.token_index.token_id_of`): a class per key keeps SQLAlchemy's statement
cache apart for each, and the index's and the queries' SQL come from one place.
"""

from __future__ import annotations

from typing import ClassVar

from sqlalchemy import String
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement


class AttrText(FunctionElement[str]):
    """``attrs``' :attr:`attr_key` as text (a subclass names the key)."""

    attr_key: ClassVar[str]
    type = String()
    inherit_cache = True


def _attrs(element: AttrText, compiler: SQLCompiler, **kw: object) -> str:
    (attrs,) = element.clauses
    return compiler.process(attrs, **kw)


@compiles(AttrText, "postgresql")
def _postgresql(element: AttrText, compiler: SQLCompiler, **kw: object) -> str:
    return f"({_attrs(element, compiler, **kw)} ->> '{element.attr_key}')"


@compiles(AttrText, "sqlite")
def _sqlite(element: AttrText, compiler: SQLCompiler, **kw: object) -> str:
    return f"json_extract({_attrs(element, compiler, **kw)}, '$.{element.attr_key}')"

"""The fleet's pseudonym key, pinned in the ledger database (table ``key_pins``).

Every pseudonym in the ledger is an HMAC under the fleet's one pseudonym key. A process holding
another key (a mis-mounted Secret, a key some tool generated) would record users under
pseudonyms nobody else can compute, and a purge run with the real key would complete, signed,
without finding them. So the ledger records the key's id
(:attr:`kvgov.ledger.pseudonym.Pseudonymizer.key_id`, keyed and one-way) the first time a
process uses it, and every later sidecar start and CLI command that computes pseudonyms compares
its own key's id first and refuses on a mismatch, before it records or looks up anyone.

The pin is insert-if-absent, then read back: two first starts racing on a fresh ledger agree on
one row, and the loser with another key is refused like any later one. The runtime role may only
insert and read it; migration 0008's guard refuses UPDATE and DELETE (``docs/ledger.md``).
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import Connection, Engine, select
from sqlalchemy.exc import SQLAlchemyError

from kvgov.config import Settings
from kvgov.db.engine import error_reason, make_engine, redact_url, utcnow
from kvgov.db.models import KeyPin
from kvgov.errors import ConfigError, LedgerError
from kvgov.ledger.indexes import dialect_insert
from kvgov.ledger.pseudonym import Pseudonymizer

#: ``key_pins.name`` of the pseudonym key's row
PSEUDONYM = "pseudonym"

MISMATCH_HINT = (
    "every sidecar and CLI host of a fleet must mount the same pseudonym key: fix the mount (or"
    " the path) to the fleet's key, never generate another one; a key cannot be swapped without"
    " rewriting every pseudonym (docs/ledger.md, 'Pseudonym key pin')"
)


def pin_key(conn: Connection, name: str, key_id: str) -> str:
    """Record ``key_id`` under ``name`` unless a pin is there; return the pinned id (the one
    recorded now or the one found), in the caller's transaction."""
    conn.execute(
        dialect_insert(conn, KeyPin)
        .values(name=name, fingerprint=key_id, pinned_at=utcnow())
        .on_conflict_do_nothing(index_elements=["name"])
    )
    return str(conn.execute(select(KeyPin.fingerprint).where(KeyPin.name == name)).scalar_one())


def check_pseudonym_key(engine: Engine, pseudonymizer: Pseudonymizer) -> None:
    """Pin the pseudonym key's id on a fresh ledger, or compare with the pinned one; raises
    :class:`ConfigError` (naming the setting, never the key or its id) on a mismatch and
    :class:`LedgerError` when the database cannot say. Owns its short transaction."""
    url = engine.url.render_as_string(hide_password=False)
    try:
        with engine.begin() as conn:
            pinned = pin_key(conn, PSEUDONYM, pseudonymizer.key_id)
    except SQLAlchemyError as exc:
        raise LedgerError(
            f"cannot read the pseudonym key pin of {redact_url(url)}: {error_reason(exc, url)}",
            hint="the ledger database must be at this kvgov's revision (`kvgov db upgrade`)",
        ) from None
    if pinned != pseudonymizer.key_id:
        raise ConfigError(
            "ledger.pseudonym_key_path holds a different pseudonym key than the one this ledger"
            " database is pinned to: its pseudonyms would name nobody the fleet's purges can"
            " find",
            hint=MISMATCH_HINT,
        )


def pinned_pseudonymizer(settings: Settings, engine: Engine | None = None) -> Pseudonymizer:
    """The configured pseudonym key (``ledger.pseudonym_key_path``), once the ledger database
    (``engine``, or one made for the check) agrees it is the fleet's: what a CLI command that
    computes pseudonyms uses."""
    pseudonymizer = Pseudonymizer.from_file(settings.pseudonym_key_path)
    own = engine is None
    bind = make_engine(settings.database_url, pool_size=1) if engine is None else engine
    try:
        check_pseudonym_key(bind, pseudonymizer)
    finally:
        if own:
            bind.dispose()
    return pseudonymizer


def pinned_key_id(engine: Engine, name: str = PSEUDONYM) -> str | None:
    """The pinned id under ``name`` (None on a fresh ledger): what ``kvgov init`` compares a key
    with before it would create one."""
    with engine.connect() as conn:
        found = conn.execute(select(KeyPin.fingerprint).where(KeyPin.name == name)).scalar()
    return None if found is None else str(found)


def key_file_id(path: Path) -> str:
    """The id of the pseudonym key in ``path``."""
    return Pseudonymizer.from_file(path).key_id

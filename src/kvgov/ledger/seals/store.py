"""The ``chain_seals`` rows: sign and store a genesis, an open or close, or a foreign seal (in
the caller's transaction), read a chain's seals back (through :mod:`.scan`, bounded), and read
its :class:`Standing`.

A seal's primary key is ``(chain_id, kind, session)``, and the runtime database role may INSERT
into ``chain_seals``: a key the writer computes from what that role can read (the session id in
the signed open, the head) could be taken first by a junk row, and the writer's INSERT then
fail for good (review r11). So every seal is inserted with ``ON CONFLICT DO NOTHING``, and a
key found taken is replaced by one with a random part (:data:`~.notes.KEY_SEP`), logged
(``ledger.seal.key_taken``): a foreign seal always carries one; a close only when its plain key
(the session id) was taken; a genesis falls back to a random ``session`` (its note does not name
it). An open's key is its own fresh random session id, unknown to anyone before it commits.

Checkpoints (table ``checkpoints``, keyed ``(chain_id, seq, nonce)`` since migration 0013) are
stored the same way (:func:`write_checkpoint_row`): the plain nonce ``''`` first, a random one
when a row took that key first (the note does not name it, as a genesis' does not name its
session: a checkpoint of a head says the same under any key)."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from datetime import datetime
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import Connection, Table, select
from sqlalchemy.dialects import postgresql, sqlite

from kvgov.db.engine import utcnow
from kvgov.db.models import Chain, ChainSeal, Checkpoint, table
from kvgov.errors import LedgerSealError
from kvgov.ledger.chain import GENESIS_HASH, public_key_bytes
from kvgov.ledger.checkpoint_scan import verified_checkpoints
from kvgov.ledger.seals.coverage import Standing, judged
from kvgov.ledger.seals.notes import (
    FOREIGN_SEP,
    KEY_SEP,
    Seal,
    SealKind,
    foreign_note,
    genesis_note,
    session_note,
)
from kvgov.ledger.seals.scan import read_valid
from kvgov.logging import get_logger

log = get_logger(__name__)

#: keys tried for one seal before giving up (each after the first with a fresh random part: a
#: second collision means someone guessed 32 random bits, or the table refuses every row)
KEY_TRIES = 4

#: told each time a seal's key was found taken (the writer counts them)
OnTaken = Callable[[], None] | None


def key_part() -> str:
    """The random part of a seal's key: 8 hex characters (a foreign seal's ``session`` is then
    at most 32 + 1 + 8 + 1 + 19 = 61 characters, within the column's 64)."""
    return secrets.token_hex(4)


def _insert_row(conn: Connection, t: Table, values: dict[str, Any]) -> bool:
    """INSERT ``values`` into ``t`` unless their key is taken (nothing written, False). Only
    INSERT (and SELECT, for RETURNING: the driver's rowcount is not told) is needed, which the
    runtime role has."""
    stmt: postgresql.Insert | sqlite.Insert
    if conn.dialect.name == "postgresql":
        stmt = postgresql.insert(t).on_conflict_do_nothing()
    elif conn.dialect.name == "sqlite":
        stmt = sqlite.insert(t).on_conflict_do_nothing()
    else:
        raise LedgerSealError(f"no seal insert for {conn.dialect.name}")
    written = conn.execute(stmt.returning(t.c.chain_id).values(**values)).first()
    return written is not None


def _insert(conn: Connection, seal: Seal) -> bool:
    """INSERT ``seal`` unless its key is taken (nothing written, False)."""
    return _insert_row(
        conn,
        table(ChainSeal),
        {
            "chain_id": seal.chain_id,
            "kind": seal.kind,
            "session": seal.session,
            "seq": seal.seq,
            "head_hash": seal.head_hash,
            "exclusive": seal.exclusive,
            "signed_at": seal.signed_at,
            "signature": seal.signature,
            "public_key": seal.public_key,
        },
    )


def _key_taken(chain_id: str, kind: str, attempt: int, on_taken: OnTaken) -> None:
    """A key of the writer's own seal or checkpoint was taken: nothing of the writer's own
    holds it, so someone inserted it (an alert)."""
    log.error(
        "ledger.seal.key_taken", extra={"chain_id": chain_id, "kind": kind, "attempt": attempt}
    )
    if on_taken is not None:
        on_taken()


def _store(
    conn: Connection, make: Callable[[int], Seal], on_taken: OnTaken, *, tries: int = KEY_TRIES
) -> Seal:
    """Insert ``make(attempt)``, a seal under a fresh key each attempt, until one key is free."""
    seal = make(0)
    for attempt in range(tries):
        if attempt:
            seal = make(attempt)
        if _insert(conn, seal):
            return seal
        _key_taken(seal.chain_id, seal.kind, attempt + 1, on_taken)
    raise LedgerSealError(
        f"could not store a {seal.kind} seal of chain {seal.chain_id!r}: {tries} keys were taken",
        hint="someone with the runtime database role is inserting into chain_seals",
    )


def write_genesis(
    conn: Connection,
    chain_id: str,
    key: Ed25519PrivateKey,
    created_at: datetime,
    *,
    on_taken: OnTaken = None,
) -> Seal:
    """Sign and store the genesis of ``chain_id`` (in the caller's transaction)."""
    public = public_key_bytes(key)
    signed_at = utcnow()
    signature = key.sign(genesis_note(chain_id, public, created_at, signed_at))

    def make(attempt: int) -> Seal:
        # the note does not name the session: a random one when ``''`` is taken (a copy of a
        # valid genesis under another key says the same, so it need not be signed)
        return Seal(
            chain_id=chain_id,
            kind=SealKind.GENESIS,
            session="" if attempt == 0 else key_part(),
            seq=0,
            head_hash=GENESIS_HASH,
            exclusive=False,
            signed_at=signed_at,
            signature=signature,
            public_key=public,
        )

    return _store(conn, make, on_taken)


def write_session_seal(
    conn: Connection,
    chain_id: str,
    key: Ed25519PrivateKey,
    kind: SealKind,
    *,
    session: str,
    head: tuple[int, str],
    exclusive: bool = False,
    on_taken: OnTaken = None,
) -> Seal:
    """Sign and store an open or close of ``session`` at ``head`` (caller's transaction, the
    chain locked). A close whose key (the session id, public since the open) is taken goes
    under ``<session>.<random>``, signed so; an open's key is a fresh random id nobody saw, so
    a taken one is refused (:class:`~kvgov.errors.LedgerSealError`)."""
    public = public_key_bytes(key)
    signed_at = utcnow()
    seq, head_hash = head

    def make(attempt: int) -> Seal:
        token = session if attempt == 0 else f"{session}{KEY_SEP}{key_part()}"
        note = session_note(
            chain_id,
            kind,
            token,
            seq=seq,
            head_hash=head_hash,
            signed_at=signed_at,
            exclusive=exclusive,
        )
        return Seal(
            chain_id=chain_id,
            kind=kind,
            session=token,
            seq=seq,
            head_hash=head_hash,
            exclusive=exclusive,
            signed_at=signed_at,
            signature=key.sign(note),
            public_key=public,
        )

    return _store(conn, make, on_taken, tries=KEY_TRIES if kind == SealKind.CLOSE else 1)


def write_foreign_seal(
    conn: Connection,
    chain_id: str,
    key: Ed25519PrivateKey,
    *,
    session: str,
    first: int,
    head: tuple[int, str],
    on_taken: OnTaken = None,
) -> Seal:
    """Sign and store that positions ``first..head[0]`` were not written by ``session``
    (caller's transaction, the chain locked; ``head``: the last of them and its hash). Its key,
    ``<session>.<random>@<first>``, is not computable from what the runtime role can read; the
    random part is signed (the note names ``<session>.<random>``), and a taken key is retried
    with a fresh one."""
    last, head_hash = head
    signed_at = utcnow()
    public = public_key_bytes(key)

    def make(attempt: int) -> Seal:
        signer = f"{session}{KEY_SEP}{key_part()}"
        note = foreign_note(
            chain_id, signer, first=first, last=last, head_hash=head_hash, signed_at=signed_at
        )
        return Seal(
            chain_id=chain_id,
            kind=SealKind.FOREIGN,
            session=f"{signer}{FOREIGN_SEP}{first}",
            seq=last,
            head_hash=head_hash,
            exclusive=False,
            signed_at=signed_at,
            signature=key.sign(note),
            public_key=public,
        )

    return _store(conn, make, on_taken)


#: the ``kind`` a taken checkpoint key is logged under (``ledger.seal.key_taken``)
CHECKPOINT_KIND = "checkpoint"


def write_checkpoint_row(
    conn: Connection,
    chain_id: str,
    *,
    head: tuple[int, str],
    signed_at: datetime,
    signature: bytes,
    public_key: bytes,
    on_taken: OnTaken = None,
) -> str:
    """Store a signed checkpoint of ``head`` (caller's transaction, the chain locked) under
    ``(chain_id, seq, nonce)``; the nonce it went under. The plain nonce ``''`` first (what a
    build before migration 0013 writes and reads); a row of the runtime role's there (it can
    compute that key from the head) moves it to a random one, logged and counted, so a
    pre-inserted row never takes the honest checkpoint's place."""
    seq, head_hash = head
    values = {
        "chain_id": chain_id,
        "seq": seq,
        "head_hash": head_hash,
        "signed_at": signed_at,
        "signature": signature,
        "public_key": public_key,
    }
    for attempt in range(KEY_TRIES):
        nonce = "" if attempt == 0 else key_part()
        if _insert_row(conn, table(Checkpoint), {**values, "nonce": nonce}):
            return nonce
        _key_taken(chain_id, CHECKPOINT_KIND, attempt + 1, on_taken)
    raise LedgerSealError(
        f"could not store a checkpoint of chain {chain_id!r}: {KEY_TRIES} keys were taken",
        hint="someone with the runtime database role is inserting into checkpoints",
    )


def read_seals(conn: Connection, chain_id: str, public_key: bytes, *, reader: str) -> list[Seal]:
    """The valid opens, closes and foreign seals of ``chain_id`` (``public_key``: the chain's),
    opens and closes at or below its head, in ``(seq, signed_at)`` order: what a judge of who
    covers which positions needs, and no genesis (:func:`~.scan.read_valid`: bounded, raises
    :class:`~kvgov.errors.SealScanCappedError` past its cap of rows that do not verify)."""
    return read_valid(conn, chain_id, public_key, None, reader=reader, genesis=False).valid


def read_standing(
    conn: Connection,
    chain_id: str,
    public_key: bytes,
    *,
    now: datetime | None = None,
    reader: str = "read_standing",
) -> Standing:
    """:func:`standing` of ``chain_id`` from the database (``public_key``: the chain's), judged
    at ``now`` (default: this clock's, read once, so one standing answers alike throughout: a
    neighbour session's lease, :func:`~.coverage.span_of`). Its seals are read through
    :func:`~.scan.read_valid` (bounded: past its cap of rows that do not verify it raises
    :class:`~kvgov.errors.SealScanCappedError`, logged as ``reader``'s, and the caller fails
    closed). Its checkpoints matter only to the legacy rule (no valid genesis: is there a
    checkpoint of the key signed before any valid seal?), so they are read only then, and only
    through :func:`~kvgov.ledger.checkpoint_scan.verified_checkpoints` (at or below the head,
    signed before the first valid seal, bounded): the runtime role may insert any number of
    rows, and a chain with a genesis, every chain a writer registered since seals, reads none."""
    chains = table(Chain)
    created_at = conn.execute(
        select(chains.c.created_at).where(chains.c.chain_id == chain_id)
    ).scalar()
    at = utcnow() if now is None else now
    seals = read_valid(conn, chain_id, public_key, created_at, reader=reader)
    found = judged(seals.valid, seals.invalid, public_key, (), chain_id, now=at)
    if found.genesis == "signed":
        return found
    first_seal = min((s.signed_at for s in found.valid), default=None)
    legacy = verified_checkpoints(
        conn,
        chain_id,
        public_key,
        reader=reader,
        on_chain=False,
        signed_before=first_seal,
    )
    if next(legacy, None) is None:
        return found
    # what judged() decides given that checkpoint, without checking every seal again
    return Standing("legacy", found.valid, found.invalid, at)

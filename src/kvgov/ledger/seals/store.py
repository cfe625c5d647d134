"""The ``chain_seals`` rows: sign and store a genesis, an open or close, or a foreign seal (in
the caller's transaction), read a chain's seals back, and read its :class:`Standing`."""

from __future__ import annotations

from datetime import datetime

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import Connection, select

from kvgov.db.engine import utcnow
from kvgov.db.models import Chain, ChainSeal, Checkpoint, table
from kvgov.ledger.chain import GENESIS_HASH, public_key_bytes
from kvgov.ledger.seals.coverage import Standing, standing
from kvgov.ledger.seals.notes import (
    FOREIGN_SEP,
    Seal,
    SealKind,
    foreign_note,
    genesis_note,
    session_note,
)


def _insert(conn: Connection, seal: Seal) -> None:
    conn.execute(
        table(ChainSeal)
        .insert()
        .values(
            chain_id=seal.chain_id,
            kind=seal.kind,
            session=seal.session,
            seq=seal.seq,
            head_hash=seal.head_hash,
            exclusive=seal.exclusive,
            signed_at=seal.signed_at,
            signature=seal.signature,
            public_key=seal.public_key,
        )
    )


def write_genesis(
    conn: Connection, chain_id: str, key: Ed25519PrivateKey, created_at: datetime
) -> Seal:
    """Sign and store the genesis of ``chain_id`` (in the caller's transaction)."""
    public = public_key_bytes(key)
    signed_at = utcnow()
    signature = key.sign(genesis_note(chain_id, public, created_at, signed_at))
    seal = Seal(
        chain_id=chain_id,
        kind=SealKind.GENESIS,
        session="",
        seq=0,
        head_hash=GENESIS_HASH,
        exclusive=False,
        signed_at=signed_at,
        signature=signature,
        public_key=public,
    )
    _insert(conn, seal)
    return seal


def write_session_seal(
    conn: Connection,
    chain_id: str,
    key: Ed25519PrivateKey,
    kind: SealKind,
    *,
    session: str,
    head: tuple[int, str],
    exclusive: bool = False,
) -> Seal:
    """Sign and store an open or close of ``session`` at ``head`` (caller's transaction, the
    chain locked)."""
    public = public_key_bytes(key)
    signed_at = utcnow()
    seq, head_hash = head
    note = session_note(
        chain_id,
        kind,
        session,
        seq=seq,
        head_hash=head_hash,
        signed_at=signed_at,
        exclusive=exclusive,
    )
    seal = Seal(
        chain_id=chain_id,
        kind=kind,
        session=session,
        seq=seq,
        head_hash=head_hash,
        exclusive=exclusive,
        signed_at=signed_at,
        signature=key.sign(note),
        public_key=public,
    )
    _insert(conn, seal)
    return seal


def write_foreign_seal(
    conn: Connection,
    chain_id: str,
    key: Ed25519PrivateKey,
    *,
    session: str,
    first: int,
    head: tuple[int, str],
) -> Seal:
    """Sign and store that positions ``first..head[0]`` were not written by ``session``
    (caller's transaction, the chain locked; ``head``: the last of them and its hash)."""
    last, head_hash = head
    signed_at = utcnow()
    note = foreign_note(
        chain_id, session, first=first, last=last, head_hash=head_hash, signed_at=signed_at
    )
    seal = Seal(
        chain_id=chain_id,
        kind=SealKind.FOREIGN,
        session=f"{session}{FOREIGN_SEP}{first}",
        seq=last,
        head_hash=head_hash,
        exclusive=False,
        signed_at=signed_at,
        signature=key.sign(note),
        public_key=public_key_bytes(key),
    )
    _insert(conn, seal)
    return seal


def read_seals(conn: Connection, chain_id: str) -> list[Seal]:
    t = table(ChainSeal)
    rows = conn.execute(
        select(t).where(t.c.chain_id == chain_id).order_by(t.c.seq, t.c.signed_at, t.c.kind)
    )
    return [Seal.from_row(r) for r in rows]


def read_standing(conn: Connection, chain_id: str, public_key: bytes) -> Standing:
    """:func:`standing` of ``chain_id`` from the database (``public_key``: the chain's)."""
    chains, cps = table(Chain), table(Checkpoint)
    created_at = conn.execute(
        select(chains.c.created_at).where(chains.c.chain_id == chain_id)
    ).scalar()
    checkpoints = conn.execute(
        select(cps.c.seq, cps.c.head_hash, cps.c.signed_at, cps.c.signature, cps.c.public_key)
        .where(cps.c.chain_id == chain_id)
        .order_by(cps.c.seq)
    ).all()
    rows = [(int(r[0]), str(r[1]), r[2], bytes(r[3]), bytes(r[4])) for r in checkpoints]
    return standing(read_seals(conn, chain_id), public_key, created_at, rows, chain_id)

"""Writing signed checkpoints of a chain head (the signing itself is in :mod:`.chain`), and the
loop that writes them periodically while a sidecar serves."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import Connection, Engine, exc, select

from kvgov.db.engine import SQLITE_BEGIN_IMMEDIATE, utcnow
from kvgov.db.models import Chain, Checkpoint, table
from kvgov.errors import LedgerError
from kvgov.ledger.batch import Head, HeadCheck, read_head
from kvgov.ledger.chain import (
    checkpoint_note,
    key_fingerprint,
    public_key_bytes,
    sign_checkpoint,
    signed_note,
)
from kvgov.ledger.seals import read_standing
from kvgov.logging import get_logger

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    chain_id: str
    seq: int
    head_hash: str
    signed_at: datetime
    signature: bytes
    public_key: bytes

    def note(self) -> str:
        """The checkpoint as a signed note, for handing to an auditor."""
        body = checkpoint_note(self.chain_id, self.seq, self.head_hash, self.signed_at)
        name = f"kvgov-{key_fingerprint(self.public_key)}"
        return signed_note(name, self.public_key, self.signature, body)


def write_checkpoint(
    engine: Engine, chain_id: str, key: Ed25519PrivateKey, *, check: HeadCheck | None = None
) -> CheckpointInfo | None:
    """Sign and store the current head of ``chain_id``. None when the chain is empty or its
    head is already checkpointed. The key must be the chain's own; a head no key holder
    vouches for (no genesis, events after a signed close, events a foreign seal names) is
    refused (:class:`LedgerError`).

    ``check``: the live writer's (:class:`~kvgov.ledger.batch.HeadCheck`): rows it did not
    write are sealed as foreign first, in the same transaction, so its checkpoint never signs
    over them silently; a head inside such rows is then left to the seal, which signs it
    (None)."""
    public = public_key_bytes(key)
    with engine.connect() as plain:
        conn = plain.execution_options(**{SQLITE_BEGIN_IMMEDIATE: True})
        with conn.begin():
            head = _locked_head(conn, chain_id, public)
            disclaimed = check.check(conn, head) if check is not None else []
            info = _sign_head(conn, chain_id, key, head, writer=check is not None)
    if check is not None:
        check.settle(head, disclaimed)
    return info


def _locked_head(conn: Connection, chain_id: str, public: bytes) -> Head:
    """The chain's head, the chain locked against appends; refused when the chain is not
    registered under ``public``."""
    chains = table(Chain)
    chain_key = conn.execute(
        select(chains.c.public_key).where(chains.c.chain_id == chain_id)
    ).scalar()
    if chain_key is None:
        raise LedgerError(f"no chain {chain_id!r} in the ledger")
    if bytes(chain_key) != public:
        raise LedgerError(
            f"chain {chain_id!r} is signed by another key",
            hint="run `kvgov audit checkpoint` on the node that owns the chain",
        )
    return read_head(conn, chain_id)


def _sign_head(
    conn: Connection, chain_id: str, key: Ed25519PrivateKey, head: Head, *, writer: bool
) -> CheckpointInfo | None:
    """Sign ``head`` unless it is empty or signed already (None); ``writer``: the chain's live
    writer, which leaves a head its own foreign seal names unsigned (None) instead of
    refusing it."""
    seq, head_hash = head
    if seq == 0:
        return None
    cps = table(Checkpoint)
    exists = conn.execute(
        select(cps.c.seq).where(cps.c.chain_id == chain_id, cps.c.seq == seq)
    ).first()
    if exists is not None:
        return None
    public = public_key_bytes(key)
    if not _check_signable(conn, chain_id, public, seq, writer=writer):
        return None
    signed_at = utcnow()
    signature = sign_checkpoint(key, chain_id, seq, head_hash, signed_at)
    conn.execute(
        cps.insert().values(
            chain_id=chain_id,
            seq=seq,
            head_hash=head_hash,
            signed_at=signed_at,
            signature=signature,
            public_key=public,
        )
    )
    return CheckpointInfo(chain_id, seq, head_hash, signed_at, signature, public)


def _check_signable(
    conn: Connection, chain_id: str, public: bytes, seq: int, *, writer: bool = False
) -> bool:
    """Refuse to sign a head no key holder vouches for: a chain without a genesis (registered
    by someone without the key), a head appended after the chain's writer closed it (no
    writer session holds the chain open there), or a head a foreign seal names (appended to
    the live chain by someone else; ``kvgov audit checkpoint`` refuses it, its live
    ``writer`` skips it: False)."""
    found = read_standing(conn, chain_id, public)
    if not found.vouched:
        raise LedgerError(
            f"chain {chain_id!r} has no genesis signed by this key: no writer holding the key "
            "registered it, so its head is not signed",
            hint="inspect its events; `kvgov audit checkpoint --adopt CHAIN` vouches for it",
        )
    if found.covers(seq):
        return True
    gap = found.gap(seq)
    disclaimed = found.foreign_at(seq)
    if disclaimed is not None:
        if writer:
            return False
        raise LedgerError(
            f"chain {chain_id!r}: events {disclaimed.first}..{disclaimed.seq} were appended to "
            "it by someone other than its writer (its signed foreign seal names them); their "
            "head is not signed",
            hint="`kvgov audit verify` reports them (foreign_append)",
        )
    span = f" {gap.first}..{gap.last}" if gap is not None else ""
    closed = f" at {gap.closed_at}" if gap is not None else ""
    raise LedgerError(
        f"chain {chain_id!r}: events{span} were appended after its writer closed "
        f"it{closed}; their head is not signed",
        hint="`kvgov audit verify` reports them (after_close)",
    )


def chains_of_key(engine: Engine, key: Ed25519PrivateKey) -> list[str]:
    """Ids of the chains whose checkpoints ``key`` signs."""
    public = public_key_bytes(key)
    chains = table(Chain)
    with engine.connect() as conn:
        rows = conn.execute(select(chains.c.chain_id, chains.c.public_key)).all()
    return sorted(cid for cid, pk in rows if bytes(pk) == public)


class Checkpointer(Protocol):
    """What signs a chain's head on demand (:class:`~kvgov.ledger.writer.LedgerWriter`)."""

    @property
    def chain_id(self) -> str: ...

    async def write_checkpoint(self) -> CheckpointInfo | None: ...


async def periodic_checkpoints(writer: Checkpointer, interval_s: float) -> None:
    """Sign the head every ``interval_s`` seconds until cancelled (``Sidecar.start`` runs this;
    ``Sidecar.stop`` has the writer sign the final head). A failed checkpoint is logged and the
    next one tried: the loop lives as long as the sidecar."""
    while True:
        await asyncio.sleep(interval_s)
        await checkpoint_logged(writer)


async def checkpoint_logged(writer: Checkpointer) -> None:
    try:
        info = await writer.write_checkpoint()
    except (LedgerError, exc.SQLAlchemyError, OSError) as err:
        log.warning(
            "ledger.checkpoint.failed",
            extra={"chain_id": writer.chain_id, "error": type(err).__name__},
        )
        return
    if info is not None:
        log.info("ledger.checkpoint.written", extra={"chain_id": info.chain_id, "seq": info.seq})

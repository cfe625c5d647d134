"""Writing signed checkpoints of a chain head (the signing itself is in :mod:`.chain`), and the
loop that writes them periodically while a sidecar serves.

The runtime database role can INSERT into ``checkpoints``, so a row there proves nothing until
its signature verifies under the chain's key: a junk row under the key the writer's next
checkpoint would take (its head's position) stood in for it, and the head stayed unsigned. A
checkpoint is now keyed ``(chain_id, seq, nonce)`` (migration 0013, the nonce random when the
plain key is taken: :func:`~kvgov.ledger.seals.store.write_checkpoint_row`), a head counts as signed
only by a checkpoint that verifies (:func:`write_checkpoint`), and what names "the chain's
checkpoint" to anyone else (a purge receipt) takes the newest that verifies
(:func:`latest_checkpoint`)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import Connection, Engine, exc, select

from kvgov.db.engine import SQLITE_BEGIN_IMMEDIATE, utcnow
from kvgov.db.models import Chain, table
from kvgov.errors import LedgerError
from kvgov.ledger.batch import Head, HeadCheck, read_head
from kvgov.ledger.chain import (
    checkpoint_note,
    key_fingerprint,
    public_key_bytes,
    sign_checkpoint,
    signed_note,
)
from kvgov.ledger.checkpoint_scan import verified_checkpoints
from kvgov.ledger.seals import read_standing
from kvgov.ledger.seals.store import write_checkpoint_row
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
    head is already checkpointed (by a checkpoint that verifies under the chain's key: a row
    that does not is junk, and the head is signed beside it). The key must be the chain's own;
    a head no key holder vouches for (no genesis, events after a signed close, events a foreign
    seal names) or one a valid checkpoint names another hash for is refused
    (:class:`LedgerError`).

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
            info = _sign_head(conn, chain_id, key, head, check=check)
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
    conn: Connection,
    chain_id: str,
    key: Ed25519PrivateKey,
    head: Head,
    *,
    check: HeadCheck | None,
) -> CheckpointInfo | None:
    """Sign ``head`` unless it is empty or signed already (None); ``check``: the chain's live
    writer's, which leaves a head its own foreign seal names unsigned (None) instead of
    refusing it, and counts a checkpoint key it finds taken."""
    seq, head_hash = head
    if seq == 0:
        return None
    public = public_key_bytes(key)
    if _signed_already(conn, chain_id, public, head):
        return None
    if not _check_signable(conn, chain_id, public, seq, writer=check is not None):
        return None
    signed_at = utcnow()
    signature = sign_checkpoint(key, chain_id, seq, head_hash, signed_at)
    write_checkpoint_row(
        conn,
        chain_id,
        head=head,
        signed_at=signed_at,
        signature=signature,
        public_key=public,
        on_taken=check.key_taken if check is not None else None,
    )
    return CheckpointInfo(chain_id, seq, head_hash, signed_at, signature, public)


def _signed_already(conn: Connection, chain_id: str, public: bytes, head: Head) -> bool:
    """Whether a checkpoint of ``head`` that verifies under the chain's key is stored. Rows
    that do not verify count for nothing (the runtime role can insert any row, under any key a
    checkpoint of that head could take); a valid one naming another hash at that position
    means the events under it were rewritten since it was signed: that head is refused
    (:class:`LedgerError`), never signed over. The rows are read by
    :func:`~kvgov.ledger.checkpoint_scan.verified_checkpoints` (bounded: past its cap the head
    counts as unsigned and is signed again, beside the junk)."""
    seq, head_hash = head
    found = verified_checkpoints(
        conn, chain_id, public, reader="checkpoint", above=seq - 1, upto=seq, on_chain=False
    )
    for row in found:
        if row.head_hash == head_hash:
            return True
        raise LedgerError(
            f"chain {chain_id!r}: its signed checkpoint at {seq} names another head than the "
            "chain holds there (its events were rewritten); the head is not signed",
            hint="`kvgov audit verify` reports it (checkpoint_mismatch)",
        )
    return False


def latest_checkpoint(engine: Engine, chain_id: str) -> CheckpointInfo | None:
    """The newest checkpoint of ``chain_id`` that verifies under the chain's key and names the
    chain's row at its position (None: none does, no such chain, or the lookup stopped at its
    cap). The newest row is not enough: the runtime role can insert a junk one at any position,
    far past the head, and a receipt naming it would name no signed head at all; nor may junk
    rows cost a signature check each (:mod:`~kvgov.ledger.checkpoint_scan`)."""
    chains = table(Chain)
    with engine.connect() as conn:
        key = conn.execute(
            select(chains.c.public_key).where(chains.c.chain_id == chain_id)
        ).scalar()
        if key is None:
            return None
        public = bytes(key)
        found = verified_checkpoints(conn, chain_id, public, reader="latest_checkpoint")
        row = next(found, None)
    if row is None:
        return None
    return CheckpointInfo(
        chain_id, row.seq, row.head_hash, row.signed_at, row.signature, row.public_key
    )


def _check_signable(
    conn: Connection, chain_id: str, public: bytes, seq: int, *, writer: bool = False
) -> bool:
    """Refuse to sign a head no key holder vouches for: a chain without a genesis (registered
    by someone without the key), a head appended after the chain's writer closed it (no
    writer session holds the chain open there), or a head a foreign seal names (appended to
    the live chain by someone else; ``kvgov audit checkpoint`` refuses it, its live
    ``writer`` skips it: False). Seals past their read's cap (:mod:`kvgov.ledger.seals.scan`)
    refuse it too (:class:`~kvgov.errors.SealScanCappedError`): a head is never signed on part of
    them."""
    found = read_standing(conn, chain_id, public, reader="checkpoint")
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

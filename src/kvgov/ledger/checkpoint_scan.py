"""Finding a chain's checkpoints that verify, at a bounded cost: the one reader of
``checkpoints`` rows for every decision that takes a checkpoint's word (a purge's cross-check,
its job document, the purge list, a restart's owed EVICTs, the receipt's named checkpoint, the
writer's "already signed", the legacy genesis rule).

The runtime database role may INSERT into ``checkpoints``, copying the chain's public key (it
can read it) and, since migration 0013's nonce, any number of rows at one position. A reader
that checked each candidate's Ed25519 signature until one verified paid one check per junk row
on every receipt, job view and restore, and its ``OFFSET`` paging grew quadratically (review
r14, F3). So :func:`verified_checkpoints`:

- reads only rows at or below the chain's real head (``max(seq)`` of its ``ledger_events``,
  in the same statement: junk past the head is never read) and, by default, only rows whose
  ``head_hash`` is the chain's row at that position (joined to ``ledger_events`` on
  ``(chain_id, seq)``): a junk row naming another hash costs no signature check;
- pages by key (``seq`` down, ``nonce`` up: the plain nonce ``''`` an honest checkpoint takes
  first comes first at its position), never by ``OFFSET``;
- examines at most :data:`MAX_EXAMINED` rows per lookup. Past that it stops, logs
  ``ledger.checkpoint.scan_capped`` and counts it (:func:`scans_capped`, the
  ``kvgov_ledger_checkpoint_scans_capped`` gauge): the lookup found nothing, so whatever it was
  to prove is not proven (a receipt says ``incomplete``). Loud, never silent, never unbounded;
- remembers what it verified (:func:`_verifies`, a bounded process-wide memo of pure
  signature results): a row read again by the next receipt costs no second check.

A runtime-role attacker who reads the chain's hashes can still place rows that pass the SQL
filters (at positions of the unsigned tail, above the newest honest checkpoint): at most
:data:`MAX_EXAMINED` checks per lookup, then the lookup fails closed as above.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Select, and_, func, or_, select

from kvgov.db.models import Checkpoint, LedgerEvent, table
from kvgov.ledger.chain import checkpoint_signature_ok
from kvgov.ledger.tally import Tally
from kvgov.logging import get_logger

log = get_logger(__name__)

#: rows read at a time, highest position first
PAGE = 64
#: rows one lookup examines at most (an honest lookup needs one or a few: the newest honest
#: checkpoint at or below the bound is read first unless junk rows precede it)
MAX_EXAMINED = 256
#: signature results remembered process-wide (a result is a pure function of the row)
MEMO_SIZE = 4096


@dataclass(frozen=True, slots=True)
class StoredCheckpoint:
    """A ``checkpoints`` row whose signature verifies under the chain's key."""

    chain_id: str
    seq: int
    nonce: str
    head_hash: str
    signed_at: datetime
    signature: bytes
    public_key: bytes


#: How many lookups stopped at :data:`MAX_EXAMINED` since start (the metric's source)
_CAPPED = Tally()


def scans_capped() -> int:
    """Lookups that stopped at :data:`MAX_EXAMINED` rows since the process started (someone
    with the runtime database role is inserting junk into ``checkpoints``)."""
    return _CAPPED.count


@functools.lru_cache(maxsize=MEMO_SIZE)
def _verifies(
    key: bytes, signature: bytes, *, chain_id: str, seq: int, head_hash: str, signed_at: datetime
) -> bool:
    """Whether ``signature`` is ``key``'s over the checkpoint note of these fields: a pure
    result, remembered (the rows are append-only, and the key names every input)."""
    return checkpoint_signature_ok(
        key, signature, chain_id=chain_id, seq=seq, head_hash=head_hash, at=signed_at
    )


def _candidates(
    chain_id: str, above: int, upto: int | None, signed_before: datetime | None
) -> Select[Any]:
    """The rows of ``chain_id`` at ``above < seq <= min(upto, head)``, highest first, with the
    chain's hash at each position (None: no event there)."""
    cps, events = table(Checkpoint), table(LedgerEvent)
    head = select(func.max(events.c.seq)).where(events.c.chain_id == chain_id).scalar_subquery()
    query = (
        select(
            cps.c.seq,
            cps.c.nonce,
            cps.c.head_hash,
            cps.c.signed_at,
            cps.c.signature,
            cps.c.public_key,
            events.c.hash,
        )
        .select_from(
            cps.outerjoin(
                events, and_(events.c.chain_id == cps.c.chain_id, events.c.seq == cps.c.seq)
            )
        )
        .where(cps.c.chain_id == chain_id, cps.c.seq > above, cps.c.seq <= head)
        .order_by(cps.c.seq.desc(), cps.c.nonce)
    )
    if upto is not None:
        query = query.where(cps.c.seq <= upto)
    if signed_before is not None:
        query = query.where(cps.c.signed_at < signed_before)
    return query


def verified_checkpoints(
    conn: Connection,
    chain_id: str,
    key: bytes,
    *,
    reader: str,
    above: int = 0,
    upto: int | None = None,
    on_chain: bool = True,
    signed_before: datetime | None = None,
    accept: Callable[[int, datetime], bool] | None = None,
) -> Iterator[StoredCheckpoint]:
    """The checkpoints of ``chain_id`` at positions ``above < seq <= upto`` (and at or below
    its head) whose signature verifies under ``key`` (the chain's), highest position first.

    ``on_chain``: only rows whose ``head_hash`` is the chain's row at their position (False:
    also the others, for a caller that must see a valid checkpoint naming another head).
    ``signed_before``: only rows signed before then. ``accept(seq, signed_at)``: a cheap test
    a row must pass before its signature is checked. ``reader``: who is asking, for the log
    line when the lookup stops at :data:`MAX_EXAMINED` rows (module docstring: it then yields
    nothing more, and the caller's "none found" fails closed)."""
    cps = table(Checkpoint)
    query = _candidates(chain_id, above, upto, signed_before)
    examined = 0
    while True:
        # one row past the cap tells "more than MAX_EXAMINED" from "exactly that many"
        want = min(PAGE, MAX_EXAMINED - examined + 1)
        rows = conn.execute(query.limit(want)).all()
        for seq, nonce, head_hash, signed_at, signature, public_key, chain_hash in rows:
            if examined == MAX_EXAMINED:
                _capped(chain_id, reader, examined)
                return
            examined += 1
            if bytes(public_key) != key or (on_chain and chain_hash != head_hash):
                continue
            if accept is not None and not accept(int(seq), signed_at):
                continue
            sig, pos, named = bytes(signature), int(seq), str(head_hash)
            ok = _verifies(
                key, sig, chain_id=chain_id, seq=pos, head_hash=named, signed_at=signed_at
            )
            if ok:
                yield StoredCheckpoint(chain_id, pos, str(nonce), named, signed_at, sig, key)
        if len(rows) < want:
            return  # every candidate read
        seq, nonce = int(rows[-1][0]), str(rows[-1][1])
        query = _candidates(chain_id, above, upto, signed_before).where(
            or_(cps.c.seq < seq, and_(cps.c.seq == seq, cps.c.nonce > nonce))
        )


def _capped(chain_id: str, reader: str, examined: int) -> None:
    """Say, loudly, that a lookup stopped at :data:`MAX_EXAMINED` rows."""
    _CAPPED.hit()
    log.warning(
        "ledger.checkpoint.scan_capped",
        extra={
            "chain_id": chain_id,
            "reader": reader,
            "examined": examined,
            "hint": "someone with the runtime database role is inserting junk into "
            "checkpoints; what this lookup was to prove is not counted as signed",
        },
    )

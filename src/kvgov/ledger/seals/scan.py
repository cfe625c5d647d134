"""Reading a chain's seals at a bounded cost: the one reader of ``chain_seals`` rows for every
decision that takes a seal's word (:func:`read_valid`: :func:`~.store.read_standing`, behind a
purge's cross-check, its job document, the purge list, a restart's owed EVICTs, the writer's
start, its checkpoints, its close and each transaction that finds its head moved; the writer's
foreign watch, :mod:`kvgov.ledger.writing.foreign`), and the complete one ``kvgov audit
verify`` reports from (:func:`read_every`).

The runtime database role may INSERT into ``chain_seals`` any number of rows, copying the
chain's public key and hashes (it can read both) and signatures (a garbage one, or one of the
chain's own replayed; a valid genesis copied under another key even verifies, its note names
no key). A reader that read every row of the chain and checked each one's Ed25519 signature
paid one check per junk row on every read, and held them all in memory. Unlike a checkpoint
lookup (:mod:`kvgov.ledger.checkpoint_scan`, which wants the highest valid checkpoint and stops
at it), a judge of coverage needs EVERY valid seal of the chain: a close, an exclusive open or a
foreign seal left unread would let a session cover rows it does not (:mod:`.coverage`). So
:func:`read_valid` never drops a row that could be valid and matter, and bounds the rest:

- it does not read rows that can never verify: another public key than the chain's, a kind
  this build does not know, a signature that is not 64 bytes, a genesis anywhere but at ``seq``
  0 over the genesis hash;
- it reads the genesis rows first, in key order (an honest genesis takes the plain key ``''``,
  which sorts first), and stops at the first that verifies: copies of it are never read;
- once a valid genesis vouches for the chain, it does not read opens and closes past the
  chain's real head (``max(seq)`` of its ``ledger_events``, in the same statement). An honest
  writer signs an open or close at the head it read under the chain lock, in the transaction
  that wrote the rows up to it, so every honest one is at or below the head of any snapshot that
  holds it; and one past the head cannot change what covers a position at or below it (a close
  or exclusive open there ends a session past the head; an open there starts one). Foreign
  seals are read wherever they are: one naming positions across the head (events deleted by
  someone past the append-only guard) still disclaims those below it. Nor is the bound applied
  to a chain without a valid genesis: the legacy rule compares checkpoints with the chain's
  earliest valid seal, wherever it is;
- it reads the rest in one statement (one snapshot: a close committed meanwhile is never half
  seen), streamed, and counts the rows that do not verify: past :data:`MAX_INVALID` of them it
  stops, logs ``ledger.seal.scan_capped`` and counts it (:func:`scans_capped`, the
  ``kvgov_ledger_seal_scans_capped`` gauge), and raises
  :class:`~kvgov.errors.SealScanCappedError`. **It fails closed:** a judgement on part of the
  seals could take a session for open that a close ends, so nothing is judged. Valid rows are
  not capped: only a key holder makes them;
- every signature check goes through the process-wide memo of pure results
  (:func:`.notes._verifies`): a row read again (the next receipt, the writer's next
  transaction) costs no second check.

So one read costs at most :data:`MAX_INVALID` + 1 signature checks of junk (none for a row
checked before), and reads at most that many junk rows beside the chain's honest seals. Unlike
junk checkpoints, which the writer's next signed head leaves behind, junk seals stay (the table
is append-only): a flood past the cap holds every read of that chain refused until an operator
removes the rows (``docs/ledger.md``, "Reading seals at a bounded cost"). What each reader does
then: the receipt's cross-check takes the chain to prove nothing (``incomplete``); the writer's
transaction that found its head moved is retried and alerted on as any failure of its own seals
(``kvgov_ledger_seal_failures``; its events wait, never refused); its checkpoints and its close
fail, logged; a starting writer logs it and opens its session all the same (it never
crash-loops on rows it cannot remove); ``kvgov audit checkpoint`` refuses.

:func:`read_every` (``audit verify``) reads every row of the chain in one streamed statement,
checks each once (a copy of a valid genesis hits the memo), keeps the valid ones and the first
``keep`` that do not verify, and counts the rest: linear in the rows, its report bounded.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Select, func, or_, select

from kvgov.db.models import ChainSeal, LedgerEvent, table
from kvgov.errors import SealScanCappedError
from kvgov.ledger.chain import GENESIS_HASH
from kvgov.ledger.seals.notes import SIGNATURE_BYTES, Seal, SealKind
from kvgov.ledger.tally import Tally
from kvgov.logging import get_logger

log = get_logger(__name__)

#: rows fetched at a time from the streamed statement
PAGE = 64
#: rows that do not verify one read examines at most (an honest chain has none: every one is a
#: row someone inserted with the runtime role)
MAX_INVALID = 256


@dataclass(slots=True)
class SealScan:
    """The seals of one chain, their signatures checked against its key."""

    #: the valid seals (one genesis at most), in ``(seq, signed_at)`` order
    valid: list[Seal] = field(default_factory=list)
    #: rows that do not verify, with why (:meth:`~.notes.Seal.fault`)
    invalid: list[tuple[Seal, str]] = field(default_factory=list)
    #: rows that do not verify beyond those kept in :attr:`invalid` (:func:`read_every`)
    more_invalid: int = 0


#: How many reads stopped at :data:`MAX_INVALID` since start (the metric's source)
_CAPPED = Tally()


def scans_capped() -> int:
    """Seal reads that stopped at :data:`MAX_INVALID` rows that do not verify since the process
    started (someone with the runtime database role is inserting junk into ``chain_seals``)."""
    return _CAPPED.count


@contextmanager
def _stream(conn: Connection, query: Select[Any]) -> Iterator[Iterator[Seal]]:
    """The rows of ``query`` as seals, streamed (a page at a time), closed on exit even after
    a ``break`` or a raise."""
    result = conn.execute(query.execution_options(yield_per=PAGE))
    try:
        yield (Seal.from_row(row) for row in result)
    finally:
        result.close()


def _genesis_rows(chain_id: str, public_key: bytes) -> Select[Any]:
    """The genesis rows of ``chain_id`` that could verify under ``public_key``, in key order
    (the primary key's: no sort)."""
    t = table(ChainSeal)
    return (
        select(t)
        .where(
            t.c.chain_id == chain_id,
            t.c.kind == SealKind.GENESIS.value,
            t.c.seq == 0,
            t.c.head_hash == GENESIS_HASH,
            t.c.public_key == public_key,
            func.length(t.c.signature) == SIGNATURE_BYTES,
        )
        .order_by(t.c.session)
    )


def _session_rows(chain_id: str, public_key: bytes, *, below_head: bool) -> Select[Any]:
    """The opens, closes and foreign seals of ``chain_id`` that could verify under
    ``public_key``; with ``below_head``, opens and closes only at or below the chain's head
    (module docstring). Unordered: every one is read (the caller orders the valid ones)."""
    t, events = table(ChainSeal), table(LedgerEvent)
    kinds = (SealKind.OPEN.value, SealKind.CLOSE.value, SealKind.FOREIGN.value)
    query = select(t).where(
        t.c.chain_id == chain_id,
        t.c.kind.in_(kinds),
        t.c.public_key == public_key,
        func.length(t.c.signature) == SIGNATURE_BYTES,
    )
    if below_head:
        head = (
            select(func.coalesce(func.max(events.c.seq), 0))
            .where(events.c.chain_id == chain_id)
            .scalar_subquery()
        )
        query = query.where(or_(t.c.kind == SealKind.FOREIGN.value, t.c.seq <= head))
    return query


class _Budget:
    """The rows that do not verify, for one read: past :data:`MAX_INVALID` it stops it."""

    def __init__(self, chain_id: str, reader: str) -> None:
        self.chain_id = chain_id
        self.reader = reader
        self.invalid: list[tuple[Seal, str]] = []
        self.examined = 0

    def refuse(self, seal: Seal, why: str) -> None:
        if len(self.invalid) == MAX_INVALID:
            _capped(self.chain_id, self.reader, self.examined)
            raise SealScanCappedError(
                f"the seals of chain {self.chain_id!r} hold more than {MAX_INVALID} rows that "
                "do not verify: not judged",
                hint="someone with the runtime database role is inserting junk into "
                "chain_seals; `kvgov audit verify` names them (docs/ledger.md, 'Reading seals "
                "at a bounded cost')",
            )
        self.invalid.append((seal, why))


def _order(seal: Seal) -> tuple[int, datetime, str, str]:
    return (seal.seq, seal.signed_at, seal.kind, seal.session)


def read_valid(
    conn: Connection,
    chain_id: str,
    public_key: bytes,
    created_at: datetime | None,
    *,
    reader: str,
    genesis: bool = True,
) -> SealScan:
    """The seals of ``chain_id`` that could matter, checked against ``public_key`` (the
    chain's: the caller checks it is trusted) and ``created_at`` (the chain row's, which its
    genesis signs), at a bounded cost (module docstring). ``genesis``: read the genesis too
    (False: only sessions' seals, opens and closes at or below the head: the foreign watch,
    which needs no genesis). ``reader``: who is asking, for the log line when the read stops.

    Raises :class:`~kvgov.errors.SealScanCappedError` past :data:`MAX_INVALID` rows that do not
    verify (logged, counted): the caller fails closed."""
    budget = _Budget(chain_id, reader)
    valid: list[Seal] = []
    if genesis:
        with _stream(conn, _genesis_rows(chain_id, public_key)) as rows:
            for seal in rows:
                budget.examined += 1
                fault = seal.fault(public_key, created_at)
                if fault is None:
                    valid.append(seal)
                    break  # copies of it say the same: never read
                budget.refuse(seal, fault)
    below_head = bool(valid) or not genesis
    with _stream(conn, _session_rows(chain_id, public_key, below_head=below_head)) as rows:
        for seal in rows:
            budget.examined += 1
            fault = seal.fault(public_key, created_at)
            if fault is None:
                valid.append(seal)
            else:
                budget.refuse(seal, fault)
    valid.sort(key=_order)
    return SealScan(valid, budget.invalid)


def read_every(
    conn: Connection,
    chain_id: str,
    public_key: bytes,
    created_at: datetime | None,
    *,
    keep: int,
) -> SealScan:
    """Every row of ``chain_id``'s seals, checked (``audit verify``): the valid ones (a copy
    of the first valid genesis left out: it says the same), the first ``keep`` that do not
    verify, in ``(seq, signed_at)`` order, and how many more do not. One streamed statement,
    each row checked once: linear in the rows, whatever they are."""
    t = table(ChainSeal)
    query = select(t).where(t.c.chain_id == chain_id).order_by(t.c.seq, t.c.signed_at, t.c.kind)
    out = SealScan()
    genesis = False  # a valid genesis kept: its copies are left out
    with _stream(conn, query) as rows:
        for seal in rows:
            fault = seal.fault(public_key, created_at)
            if fault is not None:
                if len(out.invalid) < keep:
                    out.invalid.append((seal, fault))
                else:
                    out.more_invalid += 1
            elif seal.kind != SealKind.GENESIS or not genesis:
                genesis = genesis or seal.kind == SealKind.GENESIS
                out.valid.append(seal)
    return out


def _capped(chain_id: str, reader: str, examined: int) -> None:
    """Say, loudly, that a read stopped at :data:`MAX_INVALID` rows that do not verify."""
    _CAPPED.hit()
    log.error(
        "ledger.seal.scan_capped",
        extra={
            "chain_id": chain_id,
            "reader": reader,
            "examined": examined,
            "invalid": MAX_INVALID + 1,
            "hint": "someone with the runtime database role is inserting junk into "
            "chain_seals; nothing that needs this chain's seals is judged until they are "
            "removed (kvgov audit verify names them)",
        },
    )

"""Chain seals: signed statements of a chain's life, so that only a key holder can start a chain
or write to one that its writer closed.

The runtime database role can INSERT into ``chains`` and ``ledger_events`` and the chain hash
is unkeyed, so the rows alone prove nothing about who wrote them: a chain registered under a
trusted node's public key, or events appended after its writer stopped, would link and hash
correctly. Seals (table ``chain_seals``, append-only) close both doors. Each is an Ed25519
signature by the chain's key over a note::

    kvgov.ledger.seal/v1 <chain_id>          kvgov.ledger.seal/v1 <chain_id>
    genesis                                  <open|close> <session>[ exclusive]
    key <base64 public key>                  <seq>
    created <chains.created_at>              <base64 head hash>
    first 1                                  time <signed_at>
    time <signed_at>

* **genesis** (one per chain, ``seq`` 0): the writer vouches for the chain's row (its id, key
  and creation time) when it registers the chain; a chain registered before seals existed is
  vouched for at its writer's next start (see :func:`adopt_legacy`). Verification fails a chain
  without a valid genesis (``no_genesis``), unless it is a *legacy* chain: one holding a valid
  checkpoint signed before any seal of it (no key holder ever wrote a seal for it, but one
  signed its head before this release);
* **open** (each writer start, a random ``session`` id): the head the session starts on (it
  signs over whatever a crashed predecessor left unsigned). ``exclusive``: the writer holds the
  chain alone (a sidecar holding its journal's lock), so every session opened before it is
  over, crashed or not;
* **close** (each clean writer close): the head the session leaves;
* **foreign** (a live writer that found rows it did not write:
  :mod:`kvgov.ledger.writing.foreign`): the positions ``first..last`` and the hash at
  ``last``; stored with ``seq`` = ``last`` and ``session`` = ``<session>@<first>`` (several
  per session)::

      kvgov.ledger.seal/v1 <chain_id>
      foreign <session>
      <first> <last>
      <base64 hash at last>
      time <signed_at>

A session covers the positions ``(open.seq, end]``, ``end`` being its close or the next
exclusive open after it (open-ended while neither exists: a live or crashed writer). A legacy
chain's positions up to its first open are covered too. No session covers a position a valid
foreign seal names: the writer that signed it had already left out whatever another writer
session of the chain covered (a CLI command beside it), so nobody holding the key wrote it. An
event no session covers fails verification: ``foreign_append`` when a foreign seal names it,
``after_close`` otherwise (written while no writer held the chain open), whatever checkpoints
follow. Closes, opens, foreign seals and checkpoints all sign a head; events after the last of
them are the *unsigned tail*, normal between checkpoints, and a failure (``stale_unsigned``)
once older than a bound (:data:`DEFAULT_MAX_UNSIGNED_AGE`, measured from the later of the first
unsigned event's time and the chain's newest signature) or dated in the future.
"""

from __future__ import annotations

import base64
import contextlib
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from sqlalchemy import Connection, Engine, select

from kvgov.db.engine import SQLITE_BEGIN_IMMEDIATE, utcnow
from kvgov.db.models import Chain, ChainSeal, Checkpoint, LedgerEvent, table
from kvgov.errors import LedgerError
from kvgov.ledger.batch import HeadCheck, read_head
from kvgov.ledger.chain import (
    GENESIS_HASH,
    checkpoint_signature_ok,
    format_time,
    public_key_bytes,
)
from kvgov.logging import get_logger

log = get_logger(__name__)

SEAL_ORIGIN = "kvgov.ledger.seal/v1"
#: an unsigned tail older than this fails verification (the writer died and was never
#: restarted, or the events were appended by someone without the key): sixty times the default
#: checkpoint interval, ample for an orchestrator to restart a crashed sidecar
DEFAULT_MAX_UNSIGNED_AGE = timedelta(hours=1)
#: how far in the future an unsigned event may be dated (clock skew between writer and verifier)
CLOCK_SKEW = timedelta(minutes=5)


class SealKind(StrEnum):
    GENESIS = "genesis"
    OPEN = "open"
    CLOSE = "close"
    #: positions a live writer did not write (a build without it reads the row as a seal
    #: whose signature does not verify: the chain fails, never passes)
    FOREIGN = "foreign"


def new_session() -> str:
    """A writer session's id: 32 random hex characters."""
    return secrets.token_hex(16)


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def _check_chain_id(chain_id: str) -> None:
    if any(c in chain_id for c in "\n\r"):
        raise LedgerError("chain id must not contain line breaks")


def genesis_note(
    chain_id: str, public_key: bytes, created_at: datetime, signed_at: datetime
) -> bytes:
    _check_chain_id(chain_id)
    text = (
        f"{SEAL_ORIGIN} {chain_id}\n{SealKind.GENESIS}\nkey {_b64(public_key)}\n"
        f"created {format_time(created_at)}\nfirst 1\ntime {format_time(signed_at)}\n"
    )
    return text.encode("utf-8")


def session_note(
    chain_id: str,
    kind: SealKind,
    session: str,
    *,
    seq: int,
    head_hash: str,
    signed_at: datetime,
    exclusive: bool,
) -> bytes:
    _check_chain_id(chain_id)
    if kind not in (SealKind.OPEN, SealKind.CLOSE) or not _session_ok(session):
        raise LedgerError("a session seal needs a session id without spaces")
    flag = " exclusive" if exclusive else ""
    head = _b64(bytes.fromhex(head_hash))
    text = (
        f"{SEAL_ORIGIN} {chain_id}\n{kind} {session}{flag}\n{seq}\n{head}\n"
        f"time {format_time(signed_at)}\n"
    )
    return text.encode("utf-8")


def _session_ok(session: str) -> bool:
    return bool(session) and not any(c.isspace() or c == FOREIGN_SEP for c in session)


#: separates a foreign seal's session from its first position in the ``session`` column
FOREIGN_SEP = "@"


def foreign_note(
    chain_id: str, session: str, *, first: int, last: int, head_hash: str, signed_at: datetime
) -> bytes:
    """The note of a foreign seal: positions ``first..last`` of ``chain_id`` were not written by
    the writer session ``session``, and the chain held ``head_hash`` at ``last``. Its second
    and third lines (``foreign ...``, two numbers) are no other seal's and no checkpoint's."""
    _check_chain_id(chain_id)
    if not _session_ok(session):
        raise LedgerError("a foreign seal needs a session id without spaces")
    if not 1 <= first <= last:
        raise LedgerError("a foreign seal names positions 1 <= first <= last")
    head = _b64(bytes.fromhex(head_hash))
    text = (
        f"{SEAL_ORIGIN} {chain_id}\n{SealKind.FOREIGN} {session}\n{first} {last}\n{head}\n"
        f"time {format_time(signed_at)}\n"
    )
    return text.encode("utf-8")


@dataclass(frozen=True, slots=True)
class Seal:
    """One ``chain_seals`` row."""

    chain_id: str
    kind: str
    session: str
    seq: int
    head_hash: str
    exclusive: bool
    signed_at: datetime
    signature: bytes
    public_key: bytes

    @classmethod
    def from_row(cls, row: Any) -> Seal:
        m = row._mapping
        return cls(
            chain_id=m["chain_id"],
            kind=m["kind"],
            session=m["session"],
            seq=int(m["seq"]),
            head_hash=m["head_hash"],
            exclusive=bool(m["exclusive"]),
            signed_at=m["signed_at"],
            signature=bytes(m["signature"]),
            public_key=bytes(m["public_key"]),
        )

    @property
    def name(self) -> str:
        if self.kind == SealKind.GENESIS:
            return "genesis"
        return f"{self.kind} of session {self.signer[:8]}"

    @property
    def signer(self) -> str:
        """The writer session that signed it (a foreign seal's ``session`` also holds its
        first position)."""
        if self.kind == SealKind.FOREIGN:
            return self.session.rpartition(FOREIGN_SEP)[0]
        return self.session

    @property
    def first(self) -> int | None:
        """A foreign seal's first position (None: another kind, or a malformed row)."""
        if self.kind != SealKind.FOREIGN:
            return None
        signer, sep, first = self.session.rpartition(FOREIGN_SEP)
        if not sep or not signer or not first.isdigit() or first != str(int(first)):
            return None
        return int(first) if 1 <= int(first) <= self.seq else None

    def note(self, created_at: datetime | None) -> bytes | None:
        """The text the signature covers (None: a kind this build does not know)."""
        if self.kind == SealKind.GENESIS:
            if created_at is None:
                return None
            return genesis_note(self.chain_id, self.public_key, created_at, self.signed_at)
        if self.kind == SealKind.FOREIGN:
            first = self.first
            if first is None or self.exclusive:
                return None
            return foreign_note(
                self.chain_id,
                self.signer,
                first=first,
                last=self.seq,
                head_hash=self.head_hash,
                signed_at=self.signed_at,
            )
        if self.kind not in (SealKind.OPEN, SealKind.CLOSE):
            return None
        return session_note(
            self.chain_id,
            SealKind(self.kind),
            self.session,
            seq=self.seq,
            head_hash=self.head_hash,
            signed_at=self.signed_at,
            exclusive=self.exclusive,
        )

    def signature_ok(self, public_key: bytes, created_at: datetime | None) -> bool:
        """Signed by ``public_key`` over this row's note (and the row names that key)."""
        if self.public_key != public_key:
            return False
        if self.kind == SealKind.GENESIS and (self.seq != 0 or self.head_hash != GENESIS_HASH):
            return False
        try:
            note = self.note(created_at)
            if note is None:
                return False
            Ed25519PublicKey.from_public_bytes(public_key).verify(self.signature, note)
        except (InvalidSignature, ValueError, LedgerError):
            return False
        return True


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


# -- what the seals say about a chain ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Gap:
    """Positions ``first..last`` that no writer session covers."""

    first: int
    last: int
    #: the covered position just before the gap (where the chain was closed)
    closed_at: int


def session_end(seals: Sequence[Seal], opened: Seal) -> int | None:
    """Where the session ``opened`` (a valid open) stops covering the chain: its close, or the
    first exclusive open signed after it; None while neither exists (live, or crashed)."""
    ends = [
        s.seq
        for s in seals
        if s.kind == SealKind.OPEN
        and s.exclusive
        and s.session != opened.session
        and s.signed_at > opened.signed_at
    ]
    ends += [s.seq for s in seals if s.kind == SealKind.CLOSE and s.session == opened.session]
    return max(min(ends), opened.seq) if ends else None


Range = tuple[int, int | None]


def subtract(ranges: Iterable[Range], cuts: Iterable[tuple[int, int]]) -> list[Range]:
    """``ranges`` of positions ``(start, end]`` (``end`` None: open-ended) less the ``cuts``
    ``(start, end]``; empty pieces dropped."""
    out = list(ranges)
    for lo, hi in cuts:
        pieces: list[Range] = []
        for start, end in out:
            if hi <= start or (end is not None and lo >= end):
                pieces.append((start, end))  # apart
                continue
            if start < lo:
                pieces.append((start, lo))
            if end is None or hi < end:
                pieces.append((hi, end))
        out = pieces
    return out


def foreign_ranges(seals: Sequence[Seal]) -> list[tuple[int, int]]:
    """The positions ``(first - 1, last]`` the foreign ``seals`` among ``seals`` name."""
    return [
        (first - 1, s.seq)
        for s in seals
        if s.kind == SealKind.FOREIGN and (first := s.first) is not None
    ]


def covered(seals: Sequence[Seal]) -> list[Range]:
    """The position ranges ``(start, end]`` the valid open and close ``seals`` cover (``end``
    None: open-ended), less the positions valid foreign seals name (nobody holding the key
    wrote them). Positions up to the first open are covered too (all of them when there is
    none): they predate seals (a legacy chain) or there are none (a new chain opens at 0); the
    caller checks that the chain itself is vouched for."""
    opens = [s for s in seals if s.kind == SealKind.OPEN]
    ranges: list[Range] = [(0, min((s.seq for s in opens), default=None))]
    ranges += [(opened.seq, session_end(seals, opened)) for opened in opens]
    return subtract(ranges, foreign_ranges(seals))


def first_gap(ranges: Iterable[tuple[int, int | None]], head: int) -> Gap | None:
    """The first run of positions ``1..head`` outside ``ranges``."""
    reach = 0
    for start, end in sorted(ranges, key=lambda r: r[0]):
        if start > reach:
            break
        if end is None:
            return None
        reach = max(reach, end)
    if reach >= head:
        return None
    following = [start for start, _ in ranges if start > reach]
    last = min([head, *following])
    return Gap(reach + 1, last, reach)


@dataclass(slots=True)
class Standing:
    """What the valid seals and checkpoints of one chain vouch for."""

    #: "signed" (a valid genesis), "legacy" (a checkpoint older than any seal) or "missing"
    genesis: str
    #: the valid seals, in ``(seq, signed_at)`` order
    valid: list[Seal]
    #: seals that do not verify against the chain's key, with why
    invalid: list[tuple[Seal, str]]

    @property
    def vouched(self) -> bool:
        return self.genesis != "missing"

    def gap(self, head: int) -> Gap | None:
        """The first run of positions ``1..head`` no writer session covers."""
        return first_gap(covered(self.valid), head)

    def covers(self, seq: int) -> bool:
        """Whether a writer session covers position ``seq`` (the chain was open there, and
        its writer did not disclaim it)."""
        return any(
            start < seq and (end is None or seq <= end) for start, end in covered(self.valid)
        )

    def foreign_at(self, seq: int) -> Seal | None:
        """The valid foreign seal naming position ``seq``, if any (the first signed)."""
        named = [
            s
            for s in self.valid
            if s.kind == SealKind.FOREIGN and (first := s.first) is not None
            if first <= seq <= s.seq
        ]
        return min(named, key=lambda s: s.signed_at, default=None)


def standing(
    seals: Sequence[Seal],
    public_key: bytes,
    created_at: datetime | None,
    checkpoints: Iterable[tuple[int, str, datetime, bytes, bytes]],
    chain_id: str,
) -> Standing:
    """Check every seal's signature against ``public_key`` (the chain's own: the caller checks
    that it is trusted) and decide whether the chain is vouched for. ``checkpoints``: ``(seq,
    head_hash, signed_at, signature, public_key)`` rows, for the legacy rule."""
    valid: list[Seal] = []
    invalid: list[tuple[Seal, str]] = []
    for seal in seals:
        if seal.public_key != public_key:
            invalid.append((seal, "signed by another key than the chain's"))
        elif not seal.signature_ok(public_key, created_at):
            invalid.append((seal, "signature does not verify"))
        else:
            valid.append(seal)
    if any(s.kind == SealKind.GENESIS for s in valid):
        return Standing("signed", valid, invalid)
    first_seal = min((s.signed_at for s in valid), default=None)
    for seq, head_hash, signed_at, signature, key in checkpoints:
        if first_seal is not None and signed_at >= first_seal:
            continue
        if bytes(key) == public_key and checkpoint_signature_ok(
            public_key,
            bytes(signature),
            chain_id=chain_id,
            seq=seq,
            head_hash=head_hash,
            at=signed_at,
        ):
            return Standing("legacy", valid, invalid)
    return Standing("missing", valid, invalid)


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


# -- the writer's side ------------------------------------------------------------------------


def open_session(
    conn: Connection,
    chain_id: str,
    key: Ed25519PrivateKey,
    session: str,
    *,
    created: datetime | None,
    exclusive: bool,
) -> tuple[int, str]:
    """At a writer's start, in the transaction that registered the chain (``created``: its
    creation time when this transaction registered it): lock the chain, sign its genesis (a new
    chain, or a legacy one: :func:`adopt_legacy`), sign the session's open at the head, and
    return the head. Events no session covers are logged (verification reports them)."""
    head = read_head(conn, chain_id)  # locks the chain
    public = public_key_bytes(key)
    if created is not None:
        write_genesis(conn, chain_id, key, created)
    else:
        found = read_standing(conn, chain_id, public)
        for seal, why in found.invalid:
            log.error(
                "ledger.seal.invalid",
                extra={"chain_id": chain_id, "seal": seal.name, "error": why},
            )
        if found.genesis != "signed":
            adopt_legacy(conn, chain_id, key, found, head)
        gap = found.gap(head[0])
        if gap is not None and found.vouched:
            log.error(
                "ledger.chain.appended_after_close",
                extra={
                    "chain_id": chain_id,
                    "first_seq": gap.first,
                    "last_seq": gap.last,
                    "closed_at": gap.closed_at,
                },
            )
    write_session_seal(
        conn, chain_id, key, SealKind.OPEN, session=session, head=head, exclusive=exclusive
    )
    return head


def adopt_legacy(
    conn: Connection,
    chain_id: str,
    key: Ed25519PrivateKey,
    found: Standing,
    head: tuple[int, str],
) -> bool:
    """Sign the genesis of a chain registered before seals existed, if this key's holder
    provably wrote it: it is empty, or holds a checkpoint older than any seal (``legacy``). A
    chain with events and no such proof is left unvouched (anyone with the runtime role can
    register a chain under a public key): logged, and verification fails it."""
    if found.genesis == "signed":
        return False
    if found.genesis == "missing" and head[0] > 0:
        log.error(
            "ledger.chain.unvouched",
            extra={
                "chain_id": chain_id,
                "head_seq": head[0],
                "hint": "no genesis and no checkpoint by this key: not registered by a writer "
                "holding it; inspect it, then `kvgov audit checkpoint --adopt` vouches for it",
            },
        )
        return False
    created_at = conn.execute(
        select(table(Chain).c.created_at).where(table(Chain).c.chain_id == chain_id)
    ).scalar_one()
    write_genesis(conn, chain_id, key, created_at)
    log.info("ledger.chain.genesis_signed", extra={"chain_id": chain_id, "legacy": True})
    return True


def keep_open(conn: Connection, chain_id: str, key: Ed25519PrivateKey, session: str) -> str:
    """The live writer's session, still covering the chain (caller's transaction, the chain
    locked). Another writer's exclusive open ends every session opened before it: a writer that
    is still alive then (its lock lost with its connection, or another process claiming the
    chain) opens a new session where the old one stopped covering, so its own events stay
    covered. Returns the session id to use from now on."""
    found = read_standing(conn, chain_id, public_key_bytes(key))
    mine = next((s for s in found.valid if s.kind == SealKind.OPEN and s.session == session), None)
    if mine is None:
        return session
    end = session_end(found.valid, mine)
    if end is None:
        return session
    head_hash = GENESIS_HASH
    if end > 0:
        events = table(LedgerEvent)
        head_hash = conn.execute(
            select(events.c.hash).where(events.c.chain_id == chain_id, events.c.seq == end)
        ).scalar_one()
    resumed = new_session()
    write_session_seal(conn, chain_id, key, SealKind.OPEN, session=resumed, head=(end, head_hash))
    log.warning(
        "ledger.session.resumed",
        extra={"chain_id": chain_id, "session": resumed, "from_seq": end},
    )
    return resumed


def resume(engine: Engine, chain_id: str, key: Ed25519PrivateKey, session: str) -> str:
    """:func:`keep_open` in a transaction of its own (before a live writer's checkpoint)."""
    with engine.connect() as plain:
        conn = plain.execution_options(**{SQLITE_BEGIN_IMMEDIATE: True})
        with conn.begin():
            read_head(conn, chain_id)  # locks the chain
            return keep_open(conn, chain_id, key, session)


def close_session(
    engine: Engine,
    chain_id: str,
    key: Ed25519PrivateKey,
    session: str,
    *,
    check: HeadCheck | None = None,
) -> Seal:
    """At a writer's clean close: sign the session's close at the chain's head. With the live
    writer's ``check``, rows it did not write are sealed as foreign first (same transaction),
    so the close never signs over them silently."""
    with engine.connect() as plain:
        conn = plain.execution_options(**{SQLITE_BEGIN_IMMEDIATE: True})
        with conn.begin():
            head = read_head(conn, chain_id)
            disclaimed = check.check(conn, head) if check is not None else []
            session = keep_open(conn, chain_id, key, session)
            seal = write_session_seal(
                conn, chain_id, key, SealKind.CLOSE, session=session, head=head
            )
    if check is not None:
        check.settle(head, disclaimed)
    return seal


#: class (first key) of the session-level advisory lock a live writer holds on its chain (the
#: bytes ``kvwr``; the second key is the chain id's ``hashtext``): a writer that takes it holds
#: the chain alone, so its open may end every earlier session (:func:`claim_chain`)
WRITER_LOCK_CLASS = int.from_bytes(b"kvwr", "big")


class Claim:
    """A live writer's hold on its chain: on Postgres, a connection holding a session-level
    advisory lock for the writer's life (released at close; a crashed process's connection
    ends and the lock with it). ``held``: this writer took it, so no other writer of the chain
    is alive."""

    def __init__(self, conn: Connection | None, *, held: bool) -> None:
        self._conn = conn
        self.held = held

    def abandon(self) -> None:
        """Close the lock's connection without a word to the server (the writer object was
        dropped without closing: the lock ends with the connection)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.invalidate()
                conn.close()

    def release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            conn.exec_driver_sql("SELECT pg_advisory_unlock_all()")
            conn.commit()
            conn.close()
        except Exception:  # noqa: BLE001 - a lock must never stay on a pooled connection
            conn.invalidate()
            conn.close()


def claim_chain(engine: Engine, chain_id: str) -> Claim:
    """Try to hold ``chain_id`` alone (Postgres; elsewhere nothing is held)."""
    if engine.dialect.name != "postgresql":
        return Claim(None, held=False)
    conn = engine.connect()
    try:
        held = bool(
            conn.exec_driver_sql(
                f"SELECT pg_try_advisory_lock({WRITER_LOCK_CLASS}, hashtext(%s))", (chain_id,)
            ).scalar()
        )
        conn.commit()  # the lock is the session's: the pool must not see an open transaction
    except Exception:
        conn.invalidate()
        conn.close()
        raise
    if not held:
        conn.close()
        return Claim(None, held=False)
    return Claim(conn, held=True)


def sign_genesis(engine: Engine, chain_id: str, key: Ed25519PrivateKey) -> bool:
    """``kvgov audit checkpoint --adopt``: vouch for ``chain_id`` (the operator inspected it).
    False when it already has a valid genesis. The key must be the chain's own."""
    public = public_key_bytes(key)
    with engine.connect() as plain:
        conn = plain.execution_options(**{SQLITE_BEGIN_IMMEDIATE: True})
        with conn.begin():
            chains = table(Chain)
            row = conn.execute(
                select(chains.c.public_key, chains.c.created_at).where(
                    chains.c.chain_id == chain_id
                )
            ).first()
            if row is None:
                raise LedgerError(f"no chain {chain_id!r} in the ledger")
            if bytes(row[0]) != public:
                raise LedgerError(f"chain {chain_id!r} is signed by another key")
            read_head(conn, chain_id)  # locks the chain
            if read_standing(conn, chain_id, public).genesis == "signed":
                return False
            write_genesis(conn, chain_id, key, row[1])
            return True

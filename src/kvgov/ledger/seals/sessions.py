"""The writer's side of the seals, the operations that lock the chain and sign: a session's
open at start (with the genesis of a new chain, or a legacy chain's adoption), keeping a live
session covering the chain, its close, and the operator's ``kvgov audit checkpoint --adopt``
(:func:`sign_genesis`); and a live writer's hold on its chain (:class:`Claim`)."""

from __future__ import annotations

import contextlib
import secrets
from datetime import datetime

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import Connection, Engine, select

from kvgov.db.engine import SQLITE_BEGIN_IMMEDIATE, utcnow
from kvgov.db.models import Chain, LedgerEvent, table
from kvgov.errors import LedgerError, SealScanCappedError
from kvgov.ledger.batch import Disclaimed, Head, HeadCheck, read_head
from kvgov.ledger.chain import GENESIS_HASH, link_target, public_key_bytes
from kvgov.ledger.seals.coverage import Standing, span_of
from kvgov.ledger.seals.notes import Seal, SealKind, neighbour_id
from kvgov.ledger.seals.store import read_standing, write_genesis, write_session_seal
from kvgov.logging import get_logger

log = get_logger(__name__)


def new_session(lease_s: int | None = None) -> str:
    """A writer session's id: 32 random hex characters; with ``lease_s``, a neighbour
    session's (a CLI command beside the chain's own writer), whose open explains rows for that
    many seconds at most unless it closes over them (:func:`~.notes.neighbour_id`)."""
    if lease_s is None:
        return secrets.token_hex(16)
    return neighbour_id(lease_s, secrets.token_hex(12))


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
    return the head. Events no session covers are logged (verification reports them). A head
    whose stored hash is malformed (:func:`~kvgov.ledger.batch.read_head`: logged
    ``ledger.chain.malformed_head``) is opened on as its
    :func:`~kvgov.ledger.chain.link_target`: the writer starts, and does not crash-loop on a
    row it cannot remove (review r13, F2). Nor on junk seals past their read's cap
    (:mod:`.scan`: logged ``ledger.seal.scan_capped``): the chain is not judged (no legacy
    adoption, no gap logged) and the session opens all the same."""
    head = read_head(conn, chain_id)  # locks the chain
    if created is not None:
        write_genesis(conn, chain_id, key, created)
    else:
        with contextlib.suppress(SealScanCappedError):  # logged and counted by the read
            _judge_at_start(conn, chain_id, key, head)
    write_session_seal(
        conn, chain_id, key, SealKind.OPEN, session=session, head=head, exclusive=exclusive
    )
    return head


def _judge_at_start(conn: Connection, chain_id: str, key: Ed25519PrivateKey, head: Head) -> None:
    """What a writer's start finds of an existing chain: seals that do not verify and events
    appended after a close are logged (verification reports them), a legacy chain adopted."""
    found = read_standing(conn, chain_id, public_key_bytes(key), reader="open_session")
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


def keep_open(
    conn: Connection,
    chain_id: str,
    key: Ed25519PrivateKey,
    session: str,
    head: Head,
    *,
    lease_s: int | None = None,
) -> str:
    """The live writer's session, still covering the chain (caller's transaction, the chain
    locked, ``head`` its head as read under that lock). Another writer's exclusive open ends
    every session opened before it: a writer that is still alive then (its lock lost with its
    connection, or another process claiming the chain) opens a new session where the old one
    stopped covering, so its own events stay covered. Returns the session id to use from now on.

    A neighbour writer (``lease_s``: the CLI's) keeps its session from lapsing
    (:func:`~.coverage.span_of`): once half its lease has passed it signs its close at
    ``head`` and opens a fresh one there (``ledger.session.renewed``). One that lapsed anyway
    (the command stalled past its lease) is re-opened at ``head``, not where it stopped
    covering: rows appended since are not its to vouch for."""
    now = utcnow()
    found = read_standing(conn, chain_id, public_key_bytes(key), now=now, reader="keep_open")
    mine = next((s for s in found.valid if s.kind == SealKind.OPEN and s.session == session), None)
    if mine is None:
        return session
    span = span_of(found.valid, mine, now=now)
    if span.end is None:
        if lease_s is None or mine.lease is None or now - mine.signed_at <= mine.lease / 2:
            return session
        write_session_seal(conn, chain_id, key, SealKind.CLOSE, session=session, head=head)
        return _reopen(conn, chain_id, key, head, lease_s=lease_s, why="ledger.session.renewed")
    if span.lapsed:
        return _reopen(conn, chain_id, key, head, lease_s=lease_s, why="ledger.session.lapsed")
    end = span.end
    head_hash = GENESIS_HASH
    if end > 0:
        events = table(LedgerEvent)
        stored = conn.execute(
            select(events.c.hash).where(events.c.chain_id == chain_id, events.c.seq == end)
        ).scalar_one()
        head_hash = link_target(str(stored))  # a malformed hash: what read_head gives for it
    return _reopen(
        conn, chain_id, key, (end, head_hash), lease_s=lease_s, why="ledger.session.resumed"
    )


def _reopen(
    conn: Connection,
    chain_id: str,
    key: Ed25519PrivateKey,
    at: Head,
    *,
    lease_s: int | None,
    why: str,
) -> str:
    """Open a new session of the live writer at ``at`` (:func:`keep_open`); its id."""
    resumed = new_session(lease_s)
    write_session_seal(conn, chain_id, key, SealKind.OPEN, session=resumed, head=at)
    level = log.info if why == "ledger.session.renewed" else log.warning
    level(why, extra={"chain_id": chain_id, "session": resumed, "from_seq": at[0]})
    return resumed


def resume(
    engine: Engine,
    chain_id: str,
    key: Ed25519PrivateKey,
    session: str,
    *,
    lease_s: int | None = None,
) -> str:
    """:func:`keep_open` in a transaction of its own (before a live writer's checkpoint)."""
    with engine.connect() as plain:
        conn = plain.execution_options(**{SQLITE_BEGIN_IMMEDIATE: True})
        with conn.begin():
            head = read_head(conn, chain_id)  # locks the chain
            return keep_open(conn, chain_id, key, session, head, lease_s=lease_s)


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
    so the close never signs over them silently. A close whose plain key someone took goes
    under a key with a random part (:func:`~.store.write_session_seal`): the session still
    ends here."""
    with engine.connect() as plain:
        conn = plain.execution_options(**{SQLITE_BEGIN_IMMEDIATE: True})
        with conn.begin():
            head = read_head(conn, chain_id)
            disclaimed: Disclaimed = []
            if check is not None:
                disclaimed = check.check(conn, head)
                session = check.session or session  # the check may have resumed it
            session = keep_open(
                conn,
                chain_id,
                key,
                session,
                head,
                lease_s=check.lease_s if check is not None else None,
            )
            seal = write_session_seal(
                conn,
                chain_id,
                key,
                SealKind.CLOSE,
                session=session,
                head=head,
                on_taken=check.key_taken if check is not None else None,
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
            if read_standing(conn, chain_id, public, reader="adopt").genesis == "signed":
                return False
            write_genesis(conn, chain_id, key, row[1])
            return True

"""Re-verification of the whole ledger: every chain, every checkpoint, every kept payload.

``verify(engine)`` streams each chain in ``seq`` order, recomputes every hash from the row's
columns, checks each link, checks each checkpoint's Ed25519 signature and that it matches the
chain, re-hashes every payload that has not been erased and checks that every other payload
row is a complete erasure (not a payload stripped of its salt). For each chain it reports either
``ok`` or the problems found, the first bad position first, with what kind of tampering the
evidence points to. The walk stops at the first row that does not verify, but for a row whose
hash is not a chain hash at all (``malformed``: no writer wrote it): the writer chains on, and
signs, that hash's :func:`~kvgov.ledger.chain.link_target`, so the rows after it are checked
against that.

Each chain's seals (:mod:`kvgov.ledger.seals`) are checked too (signature, key, head). Given
trusted keys (what :func:`kvgov.ledger.trust.verify_trusted` passes), verification also checks
who wrote each chain: it needs a genesis signed by its key (``no_genesis``: anyone with the
runtime role can register a chain under a public key), events written while no writer session
held the chain open fail (``after_close``: appended after a writer's signed close), so do events
a live writer's signed foreign seal says it did not write (``foreign_append``: appended to its
chain by someone else, e.g. with the runtime role), and an unsigned tail (events after the
newest signed head: checkpoint, open, close or foreign seal) fails once older than
``max_unsigned_age`` or dated in the future (``stale_unsigned``).

A seal or checkpoint row no key of the chain signed (``key_mismatch``, ``bad_signature``: the
runtime role can insert one at will) is reported and verification goes on: the checks after it
(a signed head past the chain's end, events no writer session covers, the unsigned tail) still
run, so one junk row cannot hide tampering after it. Only a checkpoint that verifies signs a
head. Every seal row is read, in one streamed statement, and checked once
(:func:`kvgov.ledger.seals.read_every`, through the seals' memo of signature results): linear in
the rows, however many junk ones there are; the first :data:`REPORTED_INVALID` that do not
verify are reported by name, the rest in one finding that counts them.

What this can and cannot see: a row changed, removed, inserted or moved anywhere is found; the
newest events after the last checkpoint can be cut off or rewritten (with recomputed hashes) by
someone who can bypass the append-only guard, so checkpoints should be frequent and copied
somewhere the database administrator cannot write. Events appended to the chain of a live writer
by someone without the key are named by its next transaction (a batch, a checkpoint, its close)
in a foreign seal; those appended to a crashed writer's chain before its restart are signed
over by the restart: the unsigned-tail bound limits how long that can wait.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from sqlalchemy import Engine, Row, select

from kvgov.boundedjson import is_undecodable
from kvgov.db.engine import utcnow
from kvgov.db.models import Chain, Checkpoint, EventPayload, LedgerEvent, table
from kvgov.ledger.chain import (
    ENCODING_VERSION,
    GENESIS_HASH,
    ChainedFields,
    checkpoint_signature_ok,
    is_chain_hash,
    key_fingerprint,
    link,
    link_target,
    payload_digest,
)
from kvgov.ledger.seals import (
    CLOCK_SKEW,
    DEFAULT_MAX_UNSIGNED_AGE,
    MAX_INVALID,
    OTHER_KEY,
    SealKind,
    SealScan,
    Standing,
    judged,
    read_every,
)

_STREAM_ROWS = 5000
#: seal rows that do not verify reported by name per chain; the rest are counted in one
#: finding (a flood of junk rows makes a bounded report, still failing the chain)
REPORTED_INVALID = 100


class Problem(StrEnum):
    MODIFIED = "modified"  # a row's content does not match its hash
    DELETED = "deleted"  # a gap in the sequence
    INSERTED = "inserted"  # a row that links into the chain but was not written by the writer
    REORDERED = "reordered"  # a genuine row at the wrong position
    BROKEN_LINK = "broken_link"  # a row whose prev_hash matches nothing
    BAD_ENCODING = "bad_encoding"  # an encoding version this build does not know
    BAD_SIGNATURE = "bad_signature"  # a checkpoint whose signature fails
    CHECKPOINT_MISMATCH = "checkpoint_mismatch"  # a checkpoint naming another head than the chain
    KEY_MISMATCH = "key_mismatch"  # a checkpoint signed with a key other than the chain's
    UNTRUSTED_KEY = "untrusted_key"  # the chain's key is not among the trusted ones
    PAYLOAD_MISMATCH = "payload_mismatch"  # a payload not matching its digest, or half-erased
    MISSING_CHAIN = "missing_chain"  # a chain the ledger or the fleet names but does not hold
    UNSIGNED = "unsigned"  # events no checkpoint covers (a failure only when asked for)
    NO_GENESIS = "no_genesis"  # a chain no key holder vouched for (no signed genesis)
    AFTER_CLOSE = "after_close"  # events written while no writer session held the chain open
    FOREIGN_APPEND = "foreign_append"  # events the live writer's foreign seal says it did not write
    STALE_UNSIGNED = "stale_unsigned"  # an unsigned tail older than the bound, or future-dated
    MALFORMED = "malformed"  # a row whose hash is not a chain hash: no writer wrote it


@dataclass(frozen=True, slots=True)
class Finding:
    problem: Problem
    seq: int
    detail: str


@dataclass(slots=True)
class ChainReport:
    chain_id: str
    key_fingerprint: str
    events: int = 0
    head_seq: int = 0
    head_hash: str = GENESIS_HASH
    checkpoints: int = 0
    last_checkpoint_seq: int | None = None
    #: events after the last signed head that verified (a checkpoint, or a writer session's
    #: open or close seal): only as good as the database, and bounded by ``max_unsigned_age``
    unsigned_events: int = 0
    #: when the first unsigned event says it happened (None: no unsigned event)
    unsigned_since: datetime | None = None
    #: "signed" (a valid genesis seal), "legacy" (a checkpoint older than any seal: the chain
    #: predates seals) or "missing" (a failure: ``no_genesis``)
    genesis: str = "missing"
    #: writer sessions that opened the chain (signed opens)
    sessions: int = 0
    #: no writer session holds the chain open at its head (its last writer closed it):
    #: anything appended now fails
    closed: bool = False
    findings: list[Finding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.findings

    @property
    def first_bad(self) -> Finding | None:
        return min(self.findings, key=lambda f: f.seq) if self.findings else None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["ok"] = self.ok
        first = self.first_bad
        out["first_bad"] = asdict(first) if first else None
        return out


@dataclass(slots=True)
class VerifyReport:
    chains: list[ChainReport] = field(default_factory=list)
    #: problems of the ledger as a whole (it was emptied: :mod:`kvgov.ledger.trust`)
    problems: list[str] = field(default_factory=list)
    #: fingerprints of the keys chains were checked against (None: any key, integrity only)
    trusted: list[str] | None = None

    @property
    def ok(self) -> bool:
        return not self.problems and all(c.ok for c in self.chains)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "problems": self.problems,
            "trusted_keys": self.trusted,
            "chains": [c.to_dict() for c in self.chains],
        }


def verify(
    engine: Engine,
    *,
    trusted_keys: Collection[bytes] | None = None,
    max_unsigned_age: timedelta | None = DEFAULT_MAX_UNSIGNED_AGE,
    now: datetime | None = None,
) -> VerifyReport:
    """Recompute every chain and check every checkpoint and seal (read-only). Without
    ``trusted_keys`` this checks integrity only: a chain re-signed with a fresh key passes, and
    so does a chain no key holder vouched for or events appended after a writer's close. With
    them it also checks who wrote each chain: its key is trusted, it has a genesis signed by
    that key (``no_genesis``), no event was written while no writer session held it open
    (``after_close``) or named by its live writer's foreign seal (``foreign_append``), and its
    unsigned tail is younger than ``max_unsigned_age`` (None: no bound; ``stale_unsigned``).
    The CLI, the API and the dashboard call :func:`kvgov.ledger.trust.verify_trusted`."""
    report = VerifyReport()
    if trusted_keys is not None:
        report.trusted = sorted(key_fingerprint(k) for k in trusted_keys)
    limits = _TailLimits(trusted_keys is not None, max_unsigned_age, now or utcnow())
    # the chain list first, its connection given back before the walks: verification needs one
    # connection at a time (the API runs it on a pool of one, never the sidecar's own)
    with engine.connect() as conn:
        chains = conn.execute(
            select(Chain.chain_id, Chain.public_key, Chain.created_at).order_by(Chain.chain_id)
        ).all()
    for chain_id, public_key, created_at in chains:
        chain = ChainReport(chain_id=chain_id, key_fingerprint=key_fingerprint(public_key))
        if trusted_keys is not None and bytes(public_key) not in trusted_keys:
            chain.findings.append(
                Finding(Problem.UNTRUSTED_KEY, 0, "chain key is not among the trusted keys")
            )
        _verify_chain(engine, chain, bytes(public_key), created_at, limits)
        report.chains.append(chain)
    return report


@dataclass(frozen=True, slots=True)
class _TailLimits:
    #: check who wrote each chain (genesis, sessions, the tail's age), not only integrity
    authenticate: bool
    max_age: timedelta | None
    now: datetime


@contextmanager
def _events(engine: Engine, chain_id: str) -> Iterator[Iterator[Row[Any]]]:
    """The chain's rows in ``seq`` order, streamed; closed on exit even after a ``break``."""
    t = table(LedgerEvent)
    query = select(t).where(t.c.chain_id == chain_id).order_by(t.c.seq)
    with engine.connect() as conn:
        result = conn.execution_options(yield_per=_STREAM_ROWS).execute(query)
        try:
            yield iter(result)
        finally:
            result.close()


def row_fields(row: Row[Any], seq: int | None = None) -> ChainedFields:
    """What a ``ledger_events`` row (a Core row) chains: the fields its hash covers."""
    m = row._mapping
    return ChainedFields(
        chain_id=m["chain_id"],
        seq=m["seq"] if seq is None else seq,
        prev_hash=m["prev_hash"],
        occurred_at=m["occurred_at"],
        kind=m["kind"],
        tenant=m["tenant"],
        actor=m["actor"],
        request_id=m["request_id"],
        key_digest=m["key_digest"],
        tier=m["tier"],
        nbytes=m["nbytes"],
        outcome=m["outcome"],
        reason=m["reason"],
        decision_id=m["decision_id"],
        policy_revision=m["policy_revision"],
        principal=m["principal"],
        attrs=m["attrs"] if m["attrs"] is not None else {},
        payload_digest=m["payload_digest"],
        encoding_version=m["encoding_version"],
    )


def _seq_of_hash(engine: Engine, chain_id: str, digest: str) -> int | None:
    """Position of the row whose hash is ``digest`` (a slow scan, only after a failure)."""
    t = table(LedgerEvent)
    with engine.connect() as conn:
        found = conn.execute(
            select(t.c.seq).where(t.c.chain_id == chain_id, t.c.hash == digest).limit(1)
        ).scalar()
    return int(found) if found is not None else None


def _verify_chain(
    engine: Engine,
    chain: ChainReport,
    public_key: bytes,
    created_at: datetime | None,
    limits: _TailLimits,
) -> None:
    checkpoints = _checkpoints(engine, chain.chain_id)
    seals = _seals(engine, chain.chain_id, public_key, created_at)
    wanted = {cp.seq for cp in checkpoints} | {s.seq for s in seals.valid}
    hashes_at: dict[int, str] = {}
    digests: dict[int, str] = {}
    expected, prev, before_prev = 1, GENESIS_HASH, GENESIS_HASH
    #: the row the walk stopped at, to diagnose (and what it was checked against)
    suspect: tuple[Row[Any], ChainedFields, str, str, str] | None = None
    with _events(engine, chain.chain_id) as rows:
        for row in rows:
            m = row._mapping
            seq, stored = m["seq"], m["hash"]
            if seq != expected:
                chain.findings.append(
                    Finding(Problem.DELETED, expected, f"events {expected}..{seq - 1} are missing")
                )
                break
            if m["encoding_version"] != ENCODING_VERSION:
                chain.findings.append(
                    Finding(Problem.BAD_ENCODING, seq, f"encoding v{m['encoding_version']}")
                )
                break
            if is_undecodable(m["attrs"]):
                chain.findings.append(_undecodable(seq))
                break
            fields = row_fields(row)
            computed = link(fields)
            if m["prev_hash"] != prev or computed != stored:
                if m["prev_hash"] != prev or is_chain_hash(stored):
                    # diagnosed once the stream's connection is back (it may look a hash up)
                    suspect = (row, fields, computed, prev, before_prev)
                    break
                chain.findings.append(_malformed(seq))
                # the rows after it link to its stand-in (what a writer chains on and signs)
                stored = link_target(str(stored))
            if m["payload_digest"] is not None:
                digests[seq] = m["payload_digest"]
            if seq in wanted:
                hashes_at[seq] = stored
            before_prev, prev = prev, stored
            chain.events += 1
            chain.head_seq, chain.head_hash = seq, stored
            expected += 1
    if suspect is not None:
        bad, bad_fields, bad_hash, bad_prev, bad_before = suspect
        chain.findings.append(
            _diagnose(engine, bad, bad_fields, bad_hash, prev=bad_prev, before_prev=bad_before)
        )
    verified_to = chain.head_seq
    signed_to = 0
    #: when the newest signature that verified was made
    newest: datetime | None = None
    for cp in checkpoints:
        chain.checkpoints += 1
        chain.last_checkpoint_seq = cp.seq
        if bytes(cp.public_key) != public_key:
            chain.findings.append(
                Finding(Problem.KEY_MISMATCH, cp.seq, "checkpoint signed by another key")
            )
        elif not checkpoint_signature_ok(
            public_key,
            bytes(cp.signature),
            chain_id=chain.chain_id,
            seq=cp.seq,
            head_hash=cp.head_hash,
            at=cp.signed_at,
        ):
            chain.findings.append(
                Finding(Problem.BAD_SIGNATURE, cp.seq, "checkpoint signature does not verify")
            )
        elif cp.seq > verified_to and _only_junk(chain):
            chain.findings.append(
                Finding(
                    Problem.CHECKPOINT_MISMATCH,
                    verified_to + 1,
                    f"signed checkpoint at {cp.seq} but the chain ends at {verified_to}: "
                    "events were removed",
                )
            )
        elif cp.seq in hashes_at and hashes_at[cp.seq] != cp.head_hash:
            chain.findings.append(
                Finding(Problem.CHECKPOINT_MISMATCH, cp.seq, "chain head differs from checkpoint")
            )
        elif cp.seq <= verified_to:
            signed_to = max(signed_to, cp.seq)
            newest = cp.signed_at if newest is None else max(newest, cp.signed_at)
    signed_heads = [
        (cp.seq, cp.head_hash, cp.signed_at, bytes(cp.signature), bytes(cp.public_key))
        for cp in checkpoints
    ]
    found = judged(
        seals.valid, seals.invalid, public_key, signed_heads, chain.chain_id, now=limits.now
    )
    sealed_to, sealed_at = _check_seals(chain, found, hashes_at, verified_to, seals.more_invalid)
    signed_to = max(signed_to, sealed_to)
    if sealed_at is not None:
        newest = sealed_at if newest is None else max(newest, sealed_at)
    chain.unsigned_events = chain.head_seq - signed_to
    if chain.unsigned_events:
        chain.unsigned_since = _occurred_at(engine, chain.chain_id, signed_to + 1)
    if not found.vouched and limits.authenticate:
        chain.findings.append(
            Finding(
                Problem.NO_GENESIS,
                1 if chain.events else 0,
                "no genesis signed by the chain's key and no checkpoint older than its seals: "
                "no writer holding the key registered this chain (the runtime database role "
                "can register a chain under any public key)",
            )
        )
    elif found.vouched:
        after = found.gap(verified_to + 1)
        chain.closed = after is not None and after.first == verified_to + 1
        if _only_junk(chain) and limits.authenticate:
            _check_tail(chain, found, verified_to, newest, limits)
    _verify_payloads(engine, chain, digests)


#: findings about a row no key of the chain signed (a junk seal or checkpoint, which the runtime
#: role can always insert): reported, but they say nothing about the events
_JUNK = frozenset({Problem.KEY_MISMATCH, Problem.BAD_SIGNATURE})


def _only_junk(chain: ChainReport) -> bool:
    """Whether the chain's findings so far are all junk rows: then the checks that need a
    sound chain (a signed head past the end, events no writer session covers, the unsigned
    tail's age) still run, so one junk row cannot hide later tampering. After any other finding
    (the chain itself is broken: its stream stopped there, a signed head contradicts it, its
    key is not trusted) they are left out, as before: they would repeat it."""
    return all(f.problem in _JUNK for f in chain.findings)


def _check_seals(
    chain: ChainReport,
    found: Standing,
    hashes_at: dict[int, str],
    verified_to: int,
    more_invalid: int = 0,
) -> tuple[int, datetime | None]:
    """Report the seals that fail (the first :data:`REPORTED_INVALID` by name, then how many
    more) and check the valid ones against the chain; the highest position they sign and when
    the newest of them was signed."""
    chain.genesis = found.genesis
    chain.sessions = sum(s.kind == SealKind.OPEN for s in found.valid)
    for seal, why in found.invalid:
        problem = Problem.KEY_MISMATCH if why == OTHER_KEY else Problem.BAD_SIGNATURE
        chain.findings.append(Finding(problem, seal.seq, f"{seal.name} seal: {why}"))
    if more_invalid:
        last = max((seal.seq for seal, _ in found.invalid), default=0)
        chain.findings.append(
            Finding(
                Problem.BAD_SIGNATURE,
                last,
                f"{more_invalid} more seal rows do not verify under the chain's key (junk: "
                "someone with the runtime database role is inserting into chain_seals; "
                "receipts, the writer and checkpoints refuse to judge this chain while more "
                f"than {MAX_INVALID} are there)",
            )
        )
    signed_to, newest = 0, None
    for seal in found.valid:
        if seal.kind == SealKind.GENESIS:
            continue
        if seal.seq > verified_to:
            if _only_junk(chain):
                chain.findings.append(
                    Finding(
                        Problem.CHECKPOINT_MISMATCH,
                        verified_to + 1,
                        f"{seal.name} seal signed at {seal.seq} but the chain ends at "
                        f"{verified_to}: events were removed",
                    )
                )
        elif seal.seq in hashes_at and hashes_at[seal.seq] != seal.head_hash:
            chain.findings.append(
                Finding(
                    Problem.CHECKPOINT_MISMATCH,
                    seal.seq,
                    f"chain head differs from the {seal.name} seal",
                )
            )
        else:
            signed_to = max(signed_to, seal.seq)
            newest = seal.signed_at if newest is None else max(newest, seal.signed_at)
    return signed_to, newest


def _check_tail(
    chain: ChainReport,
    found: Standing,
    verified_to: int,
    newest: datetime | None,
    limits: _TailLimits,
) -> None:
    """Events no writer session covers, and the unsigned tail's age (a vouched chain)."""
    gap = found.gap(verified_to)
    disclaimed = found.foreign_at(gap.first) if gap is not None else None
    if gap is not None and disclaimed is not None:
        last = min(gap.last, disclaimed.seq)
        chain.findings.append(
            Finding(
                Problem.FOREIGN_APPEND,
                gap.first,
                f"events {gap.first}..{last} were appended to the chain while its writer held "
                f"it open, but not by that writer: its signed foreign seal (session "
                f"{disclaimed.signer[:8]}) names them and no other writer session covers them",
            )
        )
        return
    if gap is not None:
        chain.findings.append(
            Finding(
                Problem.AFTER_CLOSE,
                gap.first,
                f"events {gap.first}..{gap.last} were appended after the chain's writer closed "
                f"it at {gap.closed_at} (signed close, or a neighbour session's lease ran "
                "out, and no writer session open since): not written by a writer holding the key",
            )
        )
        return
    since = chain.unsigned_since
    if not chain.unsigned_events or since is None or limits.max_age is None:
        return
    first = chain.head_seq - chain.unsigned_events + 1
    if since > limits.now + CLOCK_SKEW:
        chain.findings.append(
            Finding(
                Problem.STALE_UNSIGNED,
                first,
                f"{chain.unsigned_events} unsigned events after the last signed head, the "
                f"first dated {since.isoformat()}, in the future",
            )
        )
        return
    age = limits.now - max(since, newest or since)
    if age > limits.max_age:
        chain.findings.append(
            Finding(
                Problem.STALE_UNSIGNED,
                first,
                f"{chain.unsigned_events} events after the last signed head have been unsigned "
                f"for {_duration(age)} (bound {_duration(limits.max_age)}): their writer died "
                "and never restarted, or they were appended by someone without the key "
                "(`kvgov audit checkpoint` on the node holding the key signs them after review)",
            )
        )


def _duration(delta: timedelta) -> str:
    seconds = int(delta.total_seconds())
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}min"
    return f"{seconds // 3600}h"


def _occurred_at(engine: Engine, chain_id: str, seq: int) -> datetime | None:
    t = table(LedgerEvent)
    with engine.connect() as conn:
        found: datetime | None = conn.execute(
            select(t.c.occurred_at).where(t.c.chain_id == chain_id, t.c.seq == seq)
        ).scalar()
    return found


def _seals(
    engine: Engine, chain_id: str, public_key: bytes, created_at: datetime | None
) -> SealScan:
    """Every seal row of the chain, checked once each (:func:`~kvgov.ledger.seals.read_every`:
    streamed, linear; the junk past the first :data:`REPORTED_INVALID` rows counted)."""
    with engine.connect() as conn:
        return read_every(conn, chain_id, public_key, created_at, keep=REPORTED_INVALID)


def _malformed(seq: int) -> Finding:
    """A row that links in but whose hash is not a chain hash (64 lowercase hex characters):
    no writer wrote it (someone with the runtime role, before migration 0014 refused such
    rows). Named, and the rows after it still checked: they link to the hash's
    :func:`~kvgov.ledger.chain.link_target`, as a writer chains on it (review r13, F2)."""
    return Finding(
        Problem.MALFORMED,
        seq,
        "the row's hash is not a SHA-256 hex digest: no writer wrote it (inserted with the "
        "database's runtime role); the rows after it are checked against its stand-in",
    )


def _undecodable(seq: int) -> Finding:
    """A row whose ``attrs`` are not JSON, nested too deep or too large to decode
    (:mod:`kvgov.boundedjson`): no writer wrote it (the writer refuses such attrs), and its
    hash cannot be checked; the walk stops there as at any other modified row (review r14)."""
    return Finding(
        Problem.MODIFIED,
        seq,
        "the row's attrs are not JSON, or nested too deep or too large to decode: no writer "
        "wrote it, and its hash cannot be checked",
    )


def _diagnose(
    engine: Engine,
    row: Row[Any],
    fields: ChainedFields,
    computed: str,
    *,
    prev: str,
    before_prev: str,
) -> Finding:
    m = row._mapping
    seq = m["seq"]
    if m["prev_hash"] == prev:
        return Finding(Problem.MODIFIED, seq, "row content does not match its hash")
    if m["prev_hash"] == before_prev and fields.seq > 1:
        original = fields.seq - 1
        if link(row_fields(row, original)) == m["hash"]:
            return Finding(
                Problem.INSERTED,
                seq - 1,
                f"a row was inserted before {seq} (the row at {seq} links past it)",
            )
    pred = _seq_of_hash(engine, fields.chain_id, m["prev_hash"])
    if pred is not None and pred + 1 != seq and link(row_fields(row, pred + 1)) == m["hash"]:
        return Finding(Problem.REORDERED, seq, f"the row written at {pred + 1} sits at {seq}")
    if computed == m["hash"]:
        return Finding(
            Problem.INSERTED, seq, "a self-consistent row that does not link to its predecessor"
        )
    if pred is None and m["prev_hash"] != prev:
        return Finding(Problem.BROKEN_LINK, seq, "prev_hash links to no row of the chain")
    return Finding(Problem.MODIFIED, seq, "row content does not match its hash")


def _checkpoints(engine: Engine, chain_id: str) -> list[Any]:
    t = table(Checkpoint)
    with engine.connect() as conn:
        return list(conn.execute(select(t).where(t.c.chain_id == chain_id).order_by(t.c.seq)))


def _verify_payloads(engine: Engine, chain: ChainReport, digests: dict[int, str]) -> None:
    """Check every payload row of the chain up to its verified head. A row is consistent in one
    of two shapes only: kept (payload and salt present, not erased, hashing to the chained
    digest) or erased (no payload, ``erased_at`` stamped). Any other shape (a payload without
    its salt, a payload or salt left unstamped without the other, an erased row still holding a
    payload) cannot be checked against the chain and is reported: the runtime role may erase,
    never rewrite. Details name the position only, never the payload."""
    t = table(EventPayload)
    query = (
        select(t.c.seq, t.c.salt, t.c.payload, t.c.payload.is_(None), t.c.erased_at)
        .where(t.c.chain_id == chain.chain_id)
        .order_by(t.c.seq)
    )
    with engine.connect() as conn:
        result = conn.execution_options(yield_per=_STREAM_ROWS).execute(query)
        try:
            for seq, salt, payload, payload_null, erased_at in result:
                if seq > chain.head_seq:
                    break
                problem = _payload_problem(
                    digests.get(seq), salt, payload, bool(payload_null), erased_at is not None
                )
                if problem is not None:
                    chain.findings.append(Finding(Problem.PAYLOAD_MISMATCH, seq, problem))
                    break
        finally:
            result.close()


def _payload_problem(
    digest: str | None, salt: Any, payload: Any, payload_null: bool, erased: bool
) -> str | None:
    """What is wrong with one payload row (None: consistent). ``payload_null`` is SQL NULL,
    told apart from a stored JSON ``null``."""
    if digest is None:
        return "payload row for an event that commits to no payload"
    if erased:
        # a salt left behind is a weaker erasure, not a rewrite: there is no payload to forge
        if not payload_null:
            return "payload marked erased but still present"
        return None
    if payload_null and salt is None:
        return "payload and salt missing but not marked erased"
    if payload_null:
        return "payload missing (salt kept) but not marked erased"
    if salt is None:
        return "payload kept without its salt: it cannot be checked against its digest"
    if is_undecodable(payload):
        return "payload is not JSON, or nested too deep or too large to decode"
    if payload is None or digest != payload_digest(bytes(salt), payload):
        return "payload does not match its digest"
    return None

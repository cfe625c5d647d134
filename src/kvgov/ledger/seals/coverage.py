"""What the valid seals say about a chain, without a database: the positions its writer
sessions cover (:func:`covered`, :func:`subtract`, :func:`foreign_ranges`), each session's
:class:`Span` (:func:`span_of`, the one rule of what a session holds, a neighbour session's
lease included, and :func:`spans`: which heads were signed while it held its positions), the
first run no session covers (:func:`first_gap`), and :func:`standing`, which checks each seal's
signature and whether the chain is vouched for at all. The bounds on an unsigned tail live
here too."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from kvgov.ledger.chain import checkpoint_signature_ok
from kvgov.ledger.seals.notes import Seal, SealKind

#: an unsigned tail older than this fails verification (the writer died and was never
#: restarted, or the events were appended by someone without the key): sixty times the default
#: checkpoint interval, ample for an orchestrator to restart a crashed sidecar
DEFAULT_MAX_UNSIGNED_AGE = timedelta(hours=1)
#: how far in the future an unsigned event may be dated (clock skew between writer and verifier)
CLOCK_SKEW = timedelta(minutes=5)


@dataclass(frozen=True, slots=True)
class Gap:
    """Positions ``first..last`` that no writer session covers."""

    first: int
    last: int
    #: the covered position just before the gap (where the chain was closed)
    closed_at: int


def ending_seal(seals: Sequence[Seal], opened: Seal) -> Seal | None:
    """The seal that ends the session ``opened`` (a valid open): its close, or the first
    exclusive open of another session signed after it (the lowest; a close before an open at
    the same position); None while neither exists (live, or crashed)."""
    ends = [
        s
        for s in seals
        if s.kind == SealKind.OPEN
        and s.exclusive
        and s.session != opened.session
        and s.signed_at > opened.signed_at
    ]
    # a close names its session, with a random part when its plain key was taken (the
    # runtime role can read the session id from the open and insert a row under that key)
    ends += [s for s in seals if s.kind == SealKind.CLOSE and s.writer_session == opened.session]
    return min(ends, key=lambda s: (s.seq, s.kind != SealKind.CLOSE), default=None)


def session_end(seals: Sequence[Seal], opened: Seal, *, now: datetime | None = None) -> int | None:
    """Where the session ``opened`` (a valid open) stops covering the chain: its close, the
    first exclusive open signed after it, or, for a neighbour session, where its lease left it
    (:func:`span_of`); None while none of these exists (live, or crashed)."""
    return span_of(seals, opened, now=now).end


@dataclass(frozen=True, slots=True)
class Span:
    """The positions ``(start, end]`` one writer session held (``end`` None: not ended: live,
    or crashed and never restarted), and what tells the heads signed while it held them from
    those signed over its tail by whoever came after.

    A crashed session's unsigned tail is signed over by the exclusive open that ends it (a
    restart) and by anything that session signs later: that is how ``audit verify`` accepts
    it, but it is no key holder's word that the rows are the crashed writer's. A head counts
    for a span (:meth:`signed_within`) only when the span's own session signed it (its close,
    its foreign seals) or a checkpoint signed it before the span ended."""

    start: int
    end: int | None
    #: the session (None: the positions before the chain's first open, a legacy chain's)
    session: str | None
    #: when it stopped holding ``end``, when not by its own close: the signed time of the
    #: other session's open that ended it, or a neighbour session's lease end (None: its own
    #: close ended it, or nothing has): a checkpoint at ``end`` signed from then on is not its
    ended_at: datetime | None
    #: a neighbour session whose lease ended before anything else ended it (``end``: what was
    #: provably on the chain by then; ``ended_at``: its lease's end)
    lapsed: bool = False

    def holds(self, seq: int) -> bool:
        return self.start < seq and (self.end is None or seq <= self.end)

    def signed_within(self, seq: int, signed_at: datetime) -> bool:
        """Whether a checkpoint of position ``seq`` signed at ``signed_at`` was signed while
        this span's session held the chain there (a checkpoint below ``end`` was: the head
        had moved past it before the session ended, and a checkpoint signs the head)."""
        if not self.holds(seq):
            return False
        late = self.ended_at is not None and signed_at >= self.ended_at
        return not (seq == self.end and late)


def span_of(seals: Sequence[Seal], opened: Seal, *, now: datetime | None = None) -> Span:
    """The positions the session ``opened`` (a valid open among the valid ``seals``) holds as
    of ``now`` (default: this clock's now): the one rule every judge of coverage uses (a live
    writer's foreign watch, ``audit verify``, ``kvgov audit checkpoint``, the purge receipt).

    ``(open.seq, end]``: ``end`` is its close, or the first exclusive open signed after it; it
    is open-ended while neither exists. A neighbour session (a CLI command: its id signs a
    lease, :attr:`Seal.lease`) that has no close of its own holds open-ended only until its
    lease ends (``open.signed_at + lease``): from then on it holds what was provably on the
    chain by then, up to the highest head a valid seal signed within its lease (at least its
    open's), unless an exclusive open signed within its lease ended it first. So a command
    killed before its close does not explain, for ever, rows nobody holding the key wrote."""
    ender = ending_seal(seals, opened)
    end = None if ender is None else max(ender.seq, opened.seq)
    ended_at = ender.signed_at if ender is not None and ender.kind == SealKind.OPEN else None
    lease = opened.lease
    if lease is None or (ender is not None and ender.kind == SealKind.CLOSE):
        return Span(opened.seq, end, opened.session, ended_at)
    lapse = opened.signed_at + lease
    if ender is not None and ender.signed_at <= lapse:
        return Span(opened.seq, end, opened.session, ended_at)  # ended within its lease
    if ender is None and (now if now is not None else datetime.now(UTC)) <= lapse:
        return Span(opened.seq, None, opened.session, None)  # still within its lease
    reach = max(
        (
            s.seq
            for s in seals
            if s.kind != SealKind.GENESIS and opened.signed_at <= s.signed_at <= lapse
        ),
        default=opened.seq,
    )
    reach = max(reach, opened.seq) if end is None else min(max(reach, opened.seq), end)
    return Span(opened.seq, reach, opened.session, lapse, lapsed=True)


def spans(seals: Sequence[Seal], *, now: datetime | None = None) -> list[Span]:
    """The span of each valid open among ``seals`` (:func:`span_of`), and the legacy span
    before the first."""
    opens = [s for s in seals if s.kind == SealKind.OPEN]
    first = min(opens, key=lambda s: (s.seq, s.signed_at), default=None)
    out = [
        Span(0, None, None, None) if first is None else Span(0, first.seq, None, first.signed_at)
    ]
    out += [span_of(seals, opened, now=now) for opened in opens]
    return out


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


def covered(seals: Sequence[Seal], *, now: datetime | None = None) -> list[Range]:
    """The position ranges ``(start, end]`` the valid open and close ``seals`` cover as of
    ``now`` (``end`` None: open-ended; :func:`span_of`), less the positions valid foreign seals
    name (nobody holding the key wrote them). Positions up to the first open are covered too
    (all of them when there is none): they predate seals (a legacy chain) or there are none (a
    new chain opens at 0); the caller checks that the chain itself is vouched for."""
    opens = [s for s in seals if s.kind == SealKind.OPEN]
    ranges: list[Range] = [(0, min((s.seq for s in opens), default=None))]
    ranges += [(opened.seq, session_end(seals, opened, now=now)) for opened in opens]
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
    #: the time coverage is judged at (a neighbour session's lease: :func:`span_of`); None:
    #: this clock's now, each time it is asked
    now: datetime | None = None

    @property
    def vouched(self) -> bool:
        return self.genesis != "missing"

    def gap(self, head: int) -> Gap | None:
        """The first run of positions ``1..head`` no writer session covers."""
        return first_gap(covered(self.valid, now=self.now), head)

    def covers(self, seq: int) -> bool:
        """Whether a writer session covers position ``seq`` (the chain was open there, and
        its writer did not disclaim it)."""
        return any(
            start < seq and (end is None or seq <= end)
            for start, end in covered(self.valid, now=self.now)
        )

    def spans_at(self, seq: int) -> list[Span]:
        """The writer sessions' spans that hold position ``seq`` (:class:`Span`)."""
        return [span for span in spans(self.valid, now=self.now) if span.holds(seq)]

    def own_heads(self, span: Span) -> list[Seal]:
        """The heads ``span``'s own session signed inside it (its close, its foreign seals),
        highest first."""
        own = [
            s
            for s in self.valid
            if s.kind in (SealKind.CLOSE, SealKind.FOREIGN)
            and span.session is not None
            and s.writer_session == span.session
            and span.holds(s.seq)
        ]
        return sorted(own, key=lambda s: s.seq, reverse=True)

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
    *,
    now: datetime | None = None,
) -> Standing:
    """Check every seal's signature against ``public_key`` (the chain's own: the caller checks
    that it is trusted) and decide whether the chain is vouched for. ``checkpoints``: ``(seq,
    head_hash, signed_at, signature, public_key)`` rows, for the legacy rule. ``now``: the time
    coverage is judged at (:attr:`Standing.now`). Seals read from the database come checked
    already (:mod:`.scan`, bounded): :func:`judged` takes them."""
    valid: list[Seal] = []
    invalid: list[tuple[Seal, str]] = []
    for seal in seals:
        fault = seal.fault(public_key, created_at)
        if fault is None:
            valid.append(seal)
        else:
            invalid.append((seal, fault))
    return judged(valid, invalid, public_key, checkpoints, chain_id, now=now)


def judged(
    valid: list[Seal],
    invalid: list[tuple[Seal, str]],
    public_key: bytes,
    checkpoints: Iterable[tuple[int, str, datetime, bytes, bytes]],
    chain_id: str,
    *,
    now: datetime | None = None,
) -> Standing:
    """:func:`standing` of seals whose signatures were checked already (``valid``, in ``(seq,
    signed_at)`` order, and ``invalid``, with why): whether the chain is vouched for."""
    if any(s.kind == SealKind.GENESIS for s in valid):
        return Standing("signed", valid, invalid, now)
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
            return Standing("legacy", valid, invalid, now)
    return Standing("missing", valid, invalid, now)

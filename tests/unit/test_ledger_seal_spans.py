"""Writer sessions' spans without a database (review r13, F1): which heads were signed while the
session holding a position was live, the rule the purge receipt counts events by
(:mod:`kvgov.ledger.purge_trail`). A crashed session's tail is signed over by the exclusive open
that ends it (a restart) and by whatever comes after; neither is the crashed writer's word."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from kvgov.ledger.chain import GENESIS_HASH
from kvgov.ledger.seals import Seal, SealKind, Span, genesis_note, session_end, standing
from kvgov.ledger.seals.coverage import ending_seal, spans
from tests.unit.test_ledger_foreign_seals import KEY, PUB, T0, _foreign, _session


def _at(seconds: int) -> datetime:
    return T0 + timedelta(seconds=seconds)


def _genesis() -> Seal:
    note = genesis_note("c", PUB, T0, T0)
    return Seal("c", SealKind.GENESIS, "", 0, GENESIS_HASH, False, T0, KEY.sign(note), PUB)


def test_a_crashed_session_spans_every_later_position() -> None:
    s1 = _session(SealKind.OPEN, "s1", 0, 1, exclusive=True)
    (legacy, span) = spans([s1])
    assert legacy == Span(0, 0, None, s1.signed_at)  # holds nothing: a new chain
    assert span == Span(0, None, "s1", None)
    assert span.holds(10**9)
    assert span.signed_within(5, _at(3600))  # a checkpoint while it holds the chain


def test_a_restart_ends_the_crashed_session_and_does_not_sign_for_it() -> None:
    s1 = _session(SealKind.OPEN, "s1", 0, 1, exclusive=True)
    s2 = _session(SealKind.OPEN, "s2", 4, 10, exclusive=True)  # over s1's tail 3..4
    crashed = next(s for s in spans([s1, s2]) if s.session == "s1")
    assert crashed == Span(0, 4, "s1", s2.signed_at)
    assert ending_seal([s1, s2], s1) is s2 and session_end([s1, s2], s1) == 4
    assert crashed.signed_within(2, _at(5))  # s1's own checkpoint before it crashed
    assert crashed.signed_within(4, _at(9))  # at the end, signed before the restart
    assert not crashed.signed_within(4, _at(10))  # the restart's (or later) checkpoint
    assert not crashed.signed_within(5, _at(5))  # past its end: the restart's positions


def test_a_close_is_the_sessions_own_end() -> None:
    s1 = _session(SealKind.OPEN, "s1", 0, 1, exclusive=True)
    close = _session(SealKind.CLOSE, "s1", 6, 5)
    s2 = _session(SealKind.OPEN, "s2", 6, 10, exclusive=True)
    closed = next(s for s in spans([s1, close, s2]) if s.session == "s1")
    assert closed == Span(0, 6, "s1", None)  # its close, before the open at the same head
    assert closed.signed_within(6, _at(11))
    found = standing([_genesis(), s1, close, s2], PUB, T0, [], "c")
    assert [s.seq for s in found.own_heads(closed)] == [6]


def test_own_heads_are_the_sessions_closes_and_foreign_seals_inside_its_span() -> None:
    s1 = _session(SealKind.OPEN, "s1", 0, 1, exclusive=True)
    foreign = _foreign("s1", 3, 4, 2)
    other = _foreign("s9", 7, 8, 3)  # another session's: not s1's word
    found = standing([_genesis(), s1, foreign, other], PUB, T0, [], "c")
    assert found.vouched
    (span,) = found.spans_at(2)
    assert span.session == "s1"
    assert [s.seq for s in found.own_heads(span)] == [4]
    assert not found.covers(3)  # what the foreign seal names stays refused
    assert found.spans_at(10) == [span]


def test_before_the_first_open_positions_are_the_legacy_span() -> None:
    s1 = _session(SealKind.OPEN, "s1", 5, 10)
    legacy = spans([s1])[0]
    assert legacy == Span(0, 5, None, s1.signed_at)
    assert legacy.signed_within(3, datetime(2020, 1, 1, tzinfo=UTC))
    assert not legacy.signed_within(5, _at(10))  # the adopting open's own head

"""Writer sessions' spans without a database (review r13, F1): which heads were signed while the
session holding a position was live, the rule the purge receipt counts events by
(:mod:`kvgov.ledger.purge_trail`). A crashed session's tail is signed over by the exclusive open
that ends it (a restart) and by whatever comes after; neither is the crashed writer's word."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from kvgov.errors import LedgerError
from kvgov.ledger.chain import GENESIS_HASH
from kvgov.ledger.seals import (
    MAX_LEASE_S,
    Seal,
    SealKind,
    Span,
    genesis_note,
    neighbour_id,
    new_session,
    session_end,
    session_lease,
    span_of,
    standing,
)
from kvgov.ledger.seals.coverage import ending_seal, spans
from kvgov.ledger.writing.foreign import unexplained
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


# -- a neighbour session's lease (a killed CLI command beside a live sidecar) ----------------

LEASE = timedelta(seconds=300)
CLI = "n300-" + "c" * 24  # a CLI command's session id: it signs a 300 s lease


def test_a_neighbour_sessions_id_signs_its_lease() -> None:
    assert neighbour_id(300, "ab" * 12) == "n300-" + "ab" * 12
    assert session_lease(CLI) == LEASE
    assert _session(SealKind.OPEN, CLI, 3, 0).lease == LEASE
    assert _session(SealKind.CLOSE, CLI, 3, 0).lease is None  # only an open holds
    for plain in ("ab" * 16, "s1", "n0-" + "c" * 24, "n030-" + "c" * 24, "n300-xyz", "n300"):
        assert session_lease(plain) is None, plain
    assert session_lease(f"n{MAX_LEASE_S + 1}-" + "c" * 24) is None
    for bad_lease in (0, -5, MAX_LEASE_S + 1):
        with pytest.raises(LedgerError, match="lease"):
            neighbour_id(bad_lease, "ab" * 12)
    with pytest.raises(LedgerError, match="random part"):
        neighbour_id(300, "zz" * 12)
    assert len(new_session(MAX_LEASE_S)) <= 32 and session_lease(new_session(7)) == timedelta(
        seconds=7
    )


def test_a_neighbour_session_is_open_ended_only_within_its_lease() -> None:
    sidecar = _session(SealKind.OPEN, "s1", 0, 0, exclusive=True)
    cli = _session(SealKind.OPEN, CLI, 2, 10)
    seals = [sidecar, cli]
    assert span_of(seals, cli, now=_at(10) + LEASE) == Span(2, None, CLI, None)
    lapsed = span_of(seals, cli, now=_at(11) + LEASE)
    assert lapsed == Span(2, 2, CLI, _at(10) + LEASE, lapsed=True)  # its open's head alone
    assert session_end(seals, cli, now=_at(11) + LEASE) == 2
    # what a seal signed within the lease proves was on the chain by then stays its
    foreign = _foreign("s1", 9, 9, 200)
    late = _foreign("s1", 12, 12, 400)  # signed after the lease: proves nothing for it
    assert span_of([*seals, foreign, late], cli, now=_at(500)).end == 9
    # the sidecar's own session is no neighbour's: open-ended for as long as it lives
    assert span_of(seals, sidecar, now=_at(10**6)).end is None


def test_a_neighbour_sessions_close_ends_it_whenever_signed() -> None:
    cli = _session(SealKind.OPEN, CLI, 2, 10)
    close = _session(SealKind.CLOSE, CLI, 8, 900)  # a command alive past its lease
    assert span_of([cli, close], cli, now=_at(10**6)) == Span(2, 8, CLI, None)


def test_an_exclusive_open_ends_a_neighbour_session_as_before_within_its_lease() -> None:
    cli = _session(SealKind.OPEN, CLI, 2, 10)
    restart = _session(SealKind.OPEN, "s2", 5, 100, exclusive=True)
    assert span_of([cli, restart], cli, now=_at(10**6)) == Span(2, 5, CLI, restart.signed_at)
    # signed after the lease: the restart's head is no proof the rows were there within it
    late = _session(SealKind.OPEN, "s2", 5, 400, exclusive=True)
    assert span_of([cli, late], cli, now=_at(10**6)) == Span(
        2, 2, CLI, _at(10) + LEASE, lapsed=True
    )


def test_readers_and_the_live_writer_judge_a_lapsed_neighbour_alike() -> None:
    sidecar = _session(SealKind.OPEN, "s1", 0, 0, exclusive=True)
    cli = _session(SealKind.OPEN, CLI, 2, 10)
    closed = _session(SealKind.CLOSE, "s1", 4, 100)  # the sidecar stops cleanly
    seals = [_genesis(), sidecar, cli, closed]
    within, after = _at(20), _at(10) + LEASE + timedelta(seconds=1)
    # the live sidecar (before its close) judging rows 3..6 it did not write
    assert unexplained([sidecar, cli], PUB, {"s1"}, 2, 6, now=within) == []
    assert unexplained([sidecar, cli], PUB, {"s1"}, 2, 6, now=after) == [(3, 6)]
    # audit verify and the purge receipt: rows after the sidecar's close
    assert standing(seals, PUB, T0, [], "c", now=within).gap(6) is None
    found = standing(seals, PUB, T0, [], "c", now=after)
    gap = found.gap(6)
    assert gap is not None and (gap.first, gap.last) == (5, 6)
    assert not found.covers(5) and found.covers(4)
    assert [s.session for s in found.spans_at(5)] == []

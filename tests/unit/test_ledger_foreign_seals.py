"""Foreign seals without a database: their note is no other seal's or a checkpoint's, a
malformed row never verifies, the positions they name are covered by no session, and what the
live writer counts as explained by another session (``kvgov.ledger.writing.foreign``)."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kvgov.ledger.chain import checkpoint_signature_ok, public_key_bytes
from kvgov.ledger.seals import (
    Seal,
    SealKind,
    covered,
    first_gap,
    foreign_note,
    session_note,
    standing,
    subtract,
)
from kvgov.ledger.writing.foreign import unexplained

KEY = Ed25519PrivateKey.generate()
PUB = public_key_bytes(KEY)
T0 = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)
HASH = "ab" * 32


def _session(kind: SealKind, session: str, seq: int, at: int, *, exclusive: bool = False) -> Seal:
    signed_at = T0 + timedelta(seconds=at)
    note = session_note(
        "c", kind, session, seq=seq, head_hash=HASH, signed_at=signed_at, exclusive=exclusive
    )
    return Seal("c", kind, session, seq, HASH, exclusive, signed_at, KEY.sign(note), PUB)


def _foreign(session: str, first: int, last: int, at: int) -> Seal:
    signed_at = T0 + timedelta(seconds=at)
    note = foreign_note("c", session, first=first, last=last, head_hash=HASH, signed_at=signed_at)
    return Seal(
        "c",
        SealKind.FOREIGN,
        f"{session}@{first}",
        last,
        HASH,
        False,
        signed_at,
        KEY.sign(note),
        PUB,
    )


def test_a_foreign_seal_verifies_and_names_its_positions() -> None:
    seal = _foreign("s1", 4, 6, 10)
    assert seal.signature_ok(PUB, None)
    assert (seal.signer, seal.first, seal.seq) == ("s1", 4, 6)
    assert seal.name == "foreign of session s1"
    assert standing([seal], PUB, None, [], "c").valid == [seal]


def test_its_note_is_no_other_seals_nor_a_checkpoints() -> None:
    seal = _foreign("s1", 4, 6, 10)
    for kind in (SealKind.OPEN, SealKind.CLOSE):
        for session in ("s1", "s1@4"):
            forged = dataclasses.replace(seal, kind=kind, session=session)
            assert not forged.signature_ok(PUB, None), (kind, session)
    assert not checkpoint_signature_ok(
        PUB, seal.signature, chain_id="c", seq=6, head_hash=HASH, at=seal.signed_at
    )
    # and an open's signature does not make a foreign seal
    opened = _session(SealKind.OPEN, "s1", 6, 10)
    assert not dataclasses.replace(opened, kind=SealKind.FOREIGN, session="s1@6").signature_ok(
        PUB, None
    )


@pytest.mark.parametrize(
    "change",
    [
        {"session": "s1"},  # no first position
        {"session": "s1@x"},
        {"session": "s1@04"},  # not the form that was signed
        {"session": "@4"},
        {"session": "s1@7"},  # first after last
        {"session": "s1@0"},
        {"seq": 7},  # another last position
        {"head_hash": "cd" * 32},
        {"exclusive": True},
        {"chain_id": "d"},
    ],
)
def test_a_changed_foreign_row_does_not_verify(change: dict[str, object]) -> None:
    seal = dataclasses.replace(_foreign("s1", 4, 6, 10), **change)  # type: ignore[arg-type]
    assert not seal.signature_ok(PUB, None)


def test_an_unknown_seal_kind_never_verifies() -> None:
    """What a build without foreign seals made of one: a seal that fails (the chain fails)."""
    seal = dataclasses.replace(_foreign("s1", 4, 6, 10), kind="foreign-v2")
    assert seal.note(None) is None and not seal.signature_ok(PUB, None)


def test_subtract() -> None:
    assert subtract([(0, None)], [(3, 5)]) == [(0, 3), (5, None)]
    assert subtract([(0, 10), (2, None)], [(3, 5), (7, 12)]) == [
        (0, 3),
        (5, 7),
        (2, 3),
        (5, 7),
        (12, None),
    ]
    assert subtract([(0, 3)], [(3, 5)]) == [(0, 3)]
    assert subtract([(4, 5)], [(3, 5)]) == []


def test_no_session_covers_what_a_foreign_seal_names() -> None:
    seals = [
        _session(SealKind.OPEN, "s1", 0, 0, exclusive=True),
        _session(SealKind.OPEN, "cli", 5, 2),  # another session beside it, later closed
        _session(SealKind.CLOSE, "cli", 8, 3),
        _foreign("s1", 3, 4, 1),
        _foreign("s1", 9, 9, 4),
    ]
    found = standing(seals, PUB, None, [], "c")
    assert [p for p in range(1, 12) if not found.covers(p)] == [3, 4, 9]
    gap = first_gap(covered(found.valid), 11)
    assert gap is not None and (gap.first, gap.last) == (3, 4)
    assert found.foreign_at(4) is seals[3] and found.foreign_at(5) is None


def test_what_the_live_writer_counts_as_explained() -> None:
    mine = {"s1", "s1-resumed"}
    seals = [
        _session(SealKind.OPEN, "s1", 0, 0, exclusive=True),
        _session(SealKind.OPEN, "cli-a", 5, 1),  # closed at 7: explains 6..7 only
        _session(SealKind.CLOSE, "cli-a", 7, 2),
        _session(SealKind.OPEN, "cli-b", 10, 3),  # still open: explains up to the head
        _session(SealKind.OPEN, "s1-resumed", 3, 4),  # this writer's own: explains nothing
    ]
    assert unexplained(seals, PUB, mine, 4, 14) == [(5, 5), (8, 10)]
    assert unexplained(seals, PUB, mine, 10, 14) == []
    # a session another key signed, or a tampered one, explains nothing
    other = Ed25519PrivateKey.generate()
    bad = dataclasses.replace(seals[3], signature=other.sign(b"x"))
    assert unexplained([*seals[:3], bad], PUB, mine, 4, 14) == [(5, 5), (8, 14)]
    # nor what that session's own foreign seal disclaims
    disclaimed = _foreign("cli-b", 12, 13, 5)
    assert unexplained([*seals, disclaimed], PUB, mine, 10, 14) == [(12, 13)]


# -- seal keys with a random part (review r11, F1; ``docs/ledger.md``, "Seal keys") ---------


def test_a_foreign_seals_random_key_part_is_signed() -> None:
    """The key ``<session>.<random>@<first>``: the random part is in the note (the signer
    token), so a copy under another random part does not verify; the writer session is the
    part before it."""
    seal = _foreign("s1.0a1b2c3d", 4, 6, 10)
    assert seal.signature_ok(PUB, None)
    assert (seal.signer, seal.writer_session, seal.first) == ("s1.0a1b2c3d", "s1", 4)
    assert seal.name == "foreign of session s1"
    for session in ("s1.deadbeef@4", "s1@4", "s1.0a1b2c3d@5"):
        assert not dataclasses.replace(seal, session=session).signature_ok(PUB, None), session


def test_a_close_under_a_key_with_a_random_part_ends_its_session() -> None:
    """A close whose plain key was taken goes under ``<session>.<random>``, signed so: it
    still ends the session it names; the junk row under the plain key counts for nothing."""
    opened = _session(SealKind.OPEN, "s1", 0, 0)
    closed = _session(SealKind.CLOSE, "s1.0a1b2c3d", 3, 5)
    assert closed.signature_ok(PUB, None) and closed.writer_session == "s1"
    assert covered([opened, closed]) == [(0, 0), (0, 3)]
    assert first_gap(covered([opened, closed]), 4) is not None
    # the random part is signed: the same signature under another does not verify
    swapped = dataclasses.replace(closed, session="s1.deadbeef")
    assert not swapped.signature_ok(PUB, None)
    # an open's session is never split: a valid open ``s1.x`` is its own session
    other = _session(SealKind.OPEN, "s1.0a1b2c3d", 3, 6)
    assert other.writer_session == "s1.0a1b2c3d"

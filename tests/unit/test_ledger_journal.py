"""The ledger's local journal on real files: records round trip across a reopen, a torn tail
is cut off, damage before the end stops start-up, applied segments are deleted, one process
per journal, write failures leave it broken; events survive their JSON encoding."""

from __future__ import annotations

import dataclasses
import errno
import logging
import marshal
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from kvgov.errors import LedgerError
from kvgov.ledger.events import EVENT_TEXT_FIELDS, EntryChange, Event
from kvgov.ledger.journal import (
    MAGIC,
    EntryRecord,
    EventRecord,
    Journal,
    decode_event,
    encode_event,
    encode_record,
)
from kvgov.types import EntryState, EventKind, Outcome, Scope, Sensitivity


def segments(d: Path) -> list[Path]:
    return sorted(d.glob("journal-*.log"))


def written(d: Path, payloads: list[bytes], segment_bytes: int = 64 << 20) -> Journal:
    j = Journal(d, segment_bytes=segment_bytes)
    assert j.open(0) == []
    for p in payloads:
        j.append(p)
    assert j.sync() == len(payloads)
    return j


def test_records_come_back_after_the_mark_and_positions_go_on(tmp_path: Path) -> None:
    j = written(tmp_path, [b"one", b"two", b"three"])
    j.close(applied_upto=1)  # the chain holds record 1 only: the files stay
    again = Journal(tmp_path)
    assert again.open(1) == [(2, b"two"), (3, b"three")]
    assert again.append(b"four") == 4
    assert again.sync() == 4
    again.close(applied_upto=1)
    third = Journal(tmp_path)
    assert [p for _, p in third.open(0)] == [b"one", b"two", b"three", b"four"]
    third.close(applied_upto=4)  # everything applied: a clean stop leaves no segment
    assert segments(tmp_path) == []


def test_a_torn_tail_is_cut_off_and_writing_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    written(tmp_path, [b"a", b"b"]).close(applied_upto=0)
    (seg,) = segments(tmp_path)
    good = seg.stat().st_size
    with seg.open("ab") as f:  # a crash in the middle of writing record 3
        f.write(encode_record(3, b"never acknowledged")[:11])
    j = Journal(tmp_path)
    with caplog.at_level(logging.WARNING):
        assert j.open(0) == [(1, b"a"), (2, b"b")]
    assert "ledger.journal.truncated" in caplog.text
    assert seg.stat().st_size == good
    assert j.append(b"c") == 3
    j.sync()
    j.close(applied_upto=0)
    assert [p for _, p in Journal(tmp_path).open(0)] == [b"a", b"b", b"c"]


def test_a_last_record_failing_its_checksum_is_cut_off(tmp_path: Path) -> None:
    written(tmp_path, [b"first", b"second"]).close(applied_upto=0)
    (seg,) = segments(tmp_path)
    data = bytearray(seg.read_bytes())
    data[-1] ^= 0xFF
    seg.write_bytes(bytes(data))
    assert Journal(tmp_path).open(0) == [(1, b"first")]


def test_damage_before_the_last_segment_stops_start_up(tmp_path: Path) -> None:
    payload = b"x" * 1500
    j = written(tmp_path, [payload], segment_bytes=4096)
    for _ in range(6):  # one sync per record: a new segment every ~2 records
        j.append(payload)
        j.sync()
    j.close(applied_upto=0)
    segs = segments(tmp_path)
    assert len(segs) >= 3
    data = bytearray(segs[0].read_bytes())
    data[len(MAGIC) + 40] ^= 0x01  # inside the first record's payload
    segs[0].write_bytes(bytes(data))
    with pytest.raises(LedgerError, match="damaged") as caught:
        Journal(tmp_path).open(0)
    assert segs[0].name in str(caught.value)
    assert caught.value.hint is not None and "move it" in caught.value.hint


def test_a_gap_in_positions_is_damage(tmp_path: Path) -> None:
    written(tmp_path, [b"a"]).close(applied_upto=0)
    (seg,) = segments(tmp_path)
    with seg.open("ab") as f:
        f.write(encode_record(5, b"from nowhere"))  # 2 was due
    assert Journal(tmp_path).open(0) == [(1, b"a")]  # the last segment: cut off there


def test_segments_the_chain_holds_are_deleted(tmp_path: Path) -> None:
    j = written(tmp_path, [b"y" * 3000], segment_bytes=4096)
    for _ in range(5):  # a segment is closed once past 4096 bytes: two records each
        j.append(b"y" * 3000)
        j.sync()
    assert [s.name[8:-4].lstrip("0") for s in segments(tmp_path)] == ["1", "3", "5"]
    j.trim(3)  # records 1-2 are held; 3 is, 4 not yet
    assert [s.name[8:-4].lstrip("0") for s in segments(tmp_path)] == ["3", "5"]
    j.trim(6)
    assert segments(tmp_path) == []  # the one being written too: nothing applied lingers
    assert j.append(b"next") == 7
    j.sync()  # into a new segment
    assert [s.name[8:-4].lstrip("0") for s in segments(tmp_path)] == ["7"]
    j.close(applied_upto=6)
    assert Journal(tmp_path).open(6) == [(7, b"next")]


def test_reopening_deletes_what_the_mark_covers(tmp_path: Path) -> None:
    j = written(tmp_path, [b"z" * 3000], segment_bytes=4096)
    for _ in range(3):
        j.append(b"z" * 3000)
        j.sync()
    j.close(applied_upto=0)
    again = Journal(tmp_path, segment_bytes=4096)
    assert [pos for pos, _ in again.open(3)] == [4]
    assert len(segments(tmp_path)) == 1
    assert again.append(b"next") == 5  # positions never restart


def test_positions_go_on_after_the_mark_when_the_journal_was_emptied(tmp_path: Path) -> None:
    j = Journal(tmp_path)
    assert j.open(41) == []  # the chain holds 41 records; the directory is new
    assert j.append(b"p") == 42


def test_one_process_per_journal(tmp_path: Path) -> None:
    first = Journal(tmp_path)
    first.open(0)
    with pytest.raises(LedgerError, match="in use by another process"):
        Journal(tmp_path).open(0)
    first.close(applied_upto=0)
    Journal(tmp_path).open(0)  # free again


def test_another_chains_journal_is_refused_while_it_holds_records(tmp_path: Path) -> None:
    j = Journal(tmp_path)
    j.open(0, chain_id="node-a")
    j.append(b"a's event")
    j.sync()
    j.close(applied_upto=0)  # a crash: the record is not in node-a's chain yet
    with pytest.raises(LedgerError, match="belongs to chain 'node-a'") as caught:
        Journal(tmp_path).open(0, chain_id="node-b")
    assert caught.value.hint is not None and "journal_dir" in caught.value.hint
    again = Journal(tmp_path)
    assert again.open(0, chain_id="node-a") == [(1, b"a's event")]  # still there for node-a
    again.close(applied_upto=1)  # committed: the directory is empty
    assert Journal(tmp_path).open(0, chain_id="node-b") == []  # and free for another chain


def test_an_unusable_directory_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(LedgerError, match="cannot open the ledger journal") as caught:
        Journal(blocker / "journal").open(0)
    assert caught.value.hint is not None and "journal_dir" in caught.value.hint


def test_a_failed_sync_leaves_the_journal_broken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    j = written(tmp_path, [b"ok"])
    j.append(b"lost")

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fdatasync", full)
    with pytest.raises(OSError):
        j.sync()
    assert j.broken is not None and "No space" in j.broken
    assert j.durable == 1
    j.append(b"after")
    with pytest.raises(OSError):
        j.sync()


def test_an_oversize_record_is_refused(tmp_path: Path) -> None:
    j = Journal(tmp_path)
    j.open(0)
    with pytest.raises(LedgerError, match="too large"):
        j.append(b"x" * (2 << 20))


def test_a_tiny_segment_size_is_refused(tmp_path: Path) -> None:
    with pytest.raises(LedgerError, match="4096"):
        Journal(tmp_path, segment_bytes=100)


# -- the event codec ---------------------------------------------------------------------------


def full_event() -> Event:
    when = datetime(2026, 11, 21, 16, 30, 1, 123456, tzinfo=UTC)
    return Event(
        kind=EventKind.KV_PUT,
        tenant="acme",
        actor="a" * 32,
        request_id="req-ü-1",
        key_digest="d" * 64,
        tier="memory",
        nbytes=1 << 40,
        outcome=Outcome.ALLOW,
        reason="because\ttabs and\nnewlines",
        decision_id="dec-1",
        policy_revision="rev-7",
        principal="engine:vllm-0",
        attrs={"ratio": 0.1, "nested": {"list": [1, "two", None, True]}, "n": -3},
        payload={"note": "erasable", "k": [1.5]},
        entry=EntryChange(
            key_digest="d" * 64,
            state=EntryState.LIVE,
            tenant="acme",
            owner="a" * 32,
            scope_user="b" * 32,
            scope=Scope.USER,
            sensitivity=Sensitivity.PHI,
            model="llama",
            size=4 << 20,
            tiers=("memory", "filesystem"),
            key_id="k1",
            key_version=3,
            expires_at=when + timedelta(hours=1),
            request_id="req-ü-1",
            decision_id="dec-1",
            policy_revision="rev-7",
        ),
        occurred_at=when,
    )


@pytest.mark.parametrize(
    "event",
    [full_event(), Event(kind=EventKind.SIDECAR_STARTED)],
    ids=["every-field", "kind-only"],
)
def test_events_survive_the_journal_encoding(event: Event) -> None:
    back = decode_event(encode_event(event))
    assert back == event
    assert back.occurred_at.tzinfo is not None
    assert back.occurred_at.utcoffset() == timedelta(0)


def test_what_the_journal_cannot_carry_is_refused() -> None:
    with pytest.raises(LedgerError, match="cannot be journaled"):
        encode_event(Event(kind=EventKind.KV_GET, attrs={"x": object()}))  # type: ignore[dict-item]


def test_subclasses_of_plain_values_travel_as_the_plain_values() -> None:
    class Label(str):
        pass

    event = Event(kind=EventKind.KV_GET, reason=Label("quota"), attrs={"k": [Label("v"), 2]})
    back = decode_event(encode_event(event))
    assert back == event
    assert type(back.reason) is str


def _marshalled(fields: tuple[Any, ...]) -> bytes:
    return marshal.dumps(fields)


def _good_fields() -> list[object]:
    return list(marshal.loads(encode_event(full_event())))


def _with(i: int, value: object) -> bytes:
    fields = _good_fields()
    fields[i] = value
    return _marshalled(tuple(fields))


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(b"not an event", id="garbage"),
        pytest.param(b"", id="empty"),
        pytest.param(_marshalled((1, "kv:put")), id="short"),
        pytest.param(_with(0, 2), id="unknown-version"),
        pytest.param(_with(1, "no:such"), id="unknown-kind"),
        pytest.param(_with(3, 42), id="tenant-not-text"),
        pytest.param(_with(12, "1024"), id="nbytes-not-int"),
        pytest.param(_with(14, [1, 2]), id="attrs-not-a-map"),
        pytest.param(_with(16, ("d" * 64,)), id="entry-short"),
        pytest.param(marshal.dumps(compile("1", "x", "eval")), id="code-object"),
    ],
)
def test_a_record_that_is_not_an_event_is_refused(payload: bytes) -> None:
    with pytest.raises(LedgerError, match="not a ledger event"):
        decode_event(payload)


# -- the codec's named layout, and compatibility with journals already on disk ----------------

#: ``encode_event(full_event())`` and of a kind-only event at the same time, as the codec wrote
#: them before it read named fields (version 1, the 17-tuple by position): journals on disk
#: today must replay after any change to the codec
V1_FULL = bytes.fromhex(
    "a911e901000000fa066b763a7075746c040000008076953e2f033300da0461636d65da20616161616161"
    "6161616161616161616161616161616161616161616161616161f5080000007265712dc3bc2d31da4064"
    "646464646464646464646464646464646464646464646464646464646464646464646464646464646464"
    "646464646464646464646464646464646464646464da066d656d6f7279fa196265636175736509746162"
    "7320616e640a6e65776c696e6573fa056465632d31fa057265762d37fa0d656e67696e653a766c6c6d2d"
    "30ec03000000000000000004da05616c6c6f777bda05726174696fe79a9999999999b93fda066e657374"
    "6564fbda046c6973745b040000007201000000da0374776f4e5430da016ee9fdffffff307bda046e6f74"
    "65da086572617361626c65da016bdb01000000e7000000000000f83f30a9107206000000da046c697665"
    "72030000007204000000da20626262626262626262626262626262626262626262626262626262626262"
    "6262da056c6c616d61da026b3172050000007209000000720a000000da0475736572da03706869e90000"
    "4000e903000000a9027207000000da0a66696c6573797374656d6c04000000801abd6b32033300"
)
V1_KIND_ONLY = bytes.fromhex(
    "a911e901000000fa0f736964656361723a737461727465646c040000008076953e2f0333004e4e4e4e4e"
    "4e4e4e4e4e4e4e4e4e"
)


def test_journals_written_by_the_positional_codec_still_decode() -> None:
    assert decode_event(V1_FULL) == full_event()
    at = full_event().occurred_at
    assert decode_event(V1_KIND_ONLY) == Event(kind=EventKind.SIDECAR_STARTED, occurred_at=at)
    # and the codec writes the same layout (marshal's bytes may differ in its reference flags)
    assert marshal.loads(encode_event(full_event())) == marshal.loads(V1_FULL)


def test_each_field_is_written_under_its_name() -> None:
    e = full_event()
    c = e.entry
    assert c is not None
    record = EventRecord.read(marshal.loads(encode_event(e)))
    assert record.version == 1
    assert (record.kind, record.outcome) == (e.kind.value, "allow")
    assert record.occurred_us == int(e.occurred_at.timestamp()) * 1_000_000 + 123456
    for name in (*EVENT_TEXT_FIELDS, "nbytes"):
        assert getattr(record, name) == getattr(e, name), name
    assert (record.attrs, record.payload) == (e.attrs, e.payload)
    assert record.entry is not None
    entry = EntryRecord.read(record.entry)
    for name in EntryRecord._fields:
        if name not in {"state", "scope", "sensitivity", "expires_us"}:
            assert getattr(entry, name) == getattr(c, name), name
    assert (entry.state, entry.scope, entry.sensitivity) == ("live", "user", "phi")
    assert entry.expires_us == record.occurred_us + 3600 * 1_000_000


def test_the_records_carry_every_field_of_an_event() -> None:
    """A field added to Event or EntryChange must be added to the journal's record too (or
    the journal would drop it on replay)."""
    renamed = {"occurred_at": "occurred_us", "expires_at": "expires_us"}
    event_fields = {renamed.get(f.name, f.name) for f in dataclasses.fields(Event)}
    assert event_fields == set(EventRecord._fields) - {"version"}
    entry_fields = {renamed.get(f.name, f.name) for f in dataclasses.fields(EntryChange)}
    assert entry_fields == set(EntryRecord._fields)

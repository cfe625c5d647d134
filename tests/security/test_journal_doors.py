"""Attack: records planted in a journal directory others can write, replayed into the chain.

docs/threat-model.md promises the journal is "0600 files in a 0700 directory", so that a writer
there could already read the KEK beside it. ``Journal.open`` created the directory 0700 but
never checked an existing one's mode or owner, nor its segments': a pre-existing world-writable
journal directory (an emptyDir is 0777, a shared host path, ``ledger.journal_dir`` under /tmp)
was accepted, and a record planted in it was chained as an acknowledged event, with its
``cache_entries`` row and its entry in the index. Now the journal refuses a directory or a
segment that is not the process's own or that group or others may write, or a segment that is
not a regular file, and the sidecar does not start.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from kvgov.db.models import CacheEntry, LedgerEvent
from kvgov.errors import KvgovError
from kvgov.ledger.events import EntryChange, Event
from kvgov.ledger.journal import MAGIC, Journal, encode_event, encode_record
from kvgov.proxy.app import build_sidecar
from kvgov.types import EntryState, EventKind, Outcome, Scope
from tests.security import doors

CHAIN = "audit-chain-1"
FORGED_DIGEST = "f" * 64


def _forged_segment(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o777)  # world-writable, as an emptyDir or a shared dir is
    (directory / "chain").write_text(CHAIN)
    forged = Event(
        kind=EventKind.KV_PUT,
        tenant="acme",
        key_digest=FORGED_DIGEST,
        principal="engine:vllm-acme",
        outcome=Outcome.ALLOW,
        reason="forged by a local user",
        entry=EntryChange(
            key_digest=FORGED_DIGEST,
            state=EntryState.LIVE,
            tenant="acme",
            scope=Scope.TENANT,
            size=1,
            tiers=("memory",),
        ),
    )
    seg = directory / f"journal-{1:020d}.log"
    seg.write_bytes(MAGIC + encode_record(1, encode_event(forged)))
    seg.chmod(0o666)


def test_journal_open_refuses_a_world_writable_directory(tmp_path: Path) -> None:
    d = tmp_path / "journal"
    _forged_segment(d)
    assert stat.S_IMODE(d.stat().st_mode) == 0o777
    j = Journal(d)
    try:
        with pytest.raises(KvgovError):
            replay = j.open(0, chain_id=CHAIN)
            # what actually happens: the forged record is handed back for replay
            pytest.fail(f"loose journal dir accepted; {len(replay)} record(s) to replay")
    finally:
        j.close(applied_upto=-1)


async def test_a_sidecar_does_not_start_on_a_journal_others_can_write(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    base = doors.settings(tmp_path, prod_db)
    s = base.model_copy(update={"ledger": base.ledger.model_copy(update={"chain_id": CHAIN})})
    _forged_segment(s.journal_path)
    sc = None
    try:
        sc = await build_sidecar(s)
        await sc.start()
    except KvgovError as exc:
        assert "could forge ledger events" in str(exc)
        if sc is not None:
            with contextlib.suppress(Exception):
                await sc.stop()
        return
    try:
        assert sc.writer is not None
        await sc.writer.flush()
        with Session(sc.engine) as db:
            forged = db.scalars(
                select(LedgerEvent).where(LedgerEvent.key_digest == FORGED_DIGEST)
            ).all()
            entry = db.get(CacheEntry, FORGED_DIGEST)
        in_index = sc.pipeline.index.get(FORGED_DIGEST) is not None
    finally:
        await sc.stop()
    pytest.fail(
        f"started on a 0777 journal dir: a planted record was chained as {len(forged)}"
        f" event(s), cache_entries row={entry is not None}, in entry index={in_index}"
    )


def _refused(d: Path) -> str:
    j = Journal(d)
    try:
        with pytest.raises(KvgovError) as info:
            j.open(0, chain_id=CHAIN)
    finally:
        j.close(applied_upto=-1)
    return str(info.value)


def test_journal_open_refuses_a_segment_others_can_write(tmp_path: Path) -> None:
    d = tmp_path / "journal"
    _forged_segment(d)
    d.chmod(0o700)
    assert "segment" in _refused(d)
    next(d.glob("journal-*.log")).chmod(0o620)  # group-writable is as bad
    assert "segment" in _refused(d)
    next(d.glob("journal-*.log")).chmod(0o600)  # its own and private: replayed
    j = Journal(d)
    try:
        assert [pos for pos, _ in j.open(0, chain_id=CHAIN)] == [1]
    finally:
        j.close(applied_upto=-1)


def test_journal_open_refuses_a_segment_that_is_a_symlink(tmp_path: Path) -> None:
    d = tmp_path / "journal"
    _forged_segment(tmp_path / "elsewhere")
    d.mkdir(mode=0o700)
    (d / "chain").write_text(CHAIN)
    seg = next((tmp_path / "elsewhere").glob("journal-*.log"))
    seg.chmod(0o600)
    (d / seg.name).symlink_to(seg)
    assert "segment" in _refused(d)


def _swap_for_symlink(d: Path, elsewhere: Path) -> Path:
    """What someone who can write the journal directory's parent does once the sidecar has
    checked and opened it: rename it away and put a symlink to a directory of theirs in its
    place. Returns where the real directory went."""
    moved = d.with_name(d.name + "-moved")
    d.rename(moved)
    elsewhere.mkdir(mode=0o700, exist_ok=True)
    d.symlink_to(elsewhere)
    return moved


def test_segments_written_after_the_directory_was_swapped_stay_in_the_real_one(
    tmp_path: Path,
) -> None:
    """The journal used to name every file by path: a segment started after the swap (the
    writer starts one after each trim, and when one is full) was created in the symlink's
    target, so acknowledged events went to a directory someone else chose (and, at the next
    start, were replayed from wherever the path pointed then). Now every file is opened
    relative to the directory the journal checked and holds open."""
    d = tmp_path / "journal"
    j = Journal(d, segment_bytes=4096)
    try:
        assert j.open(0, chain_id=CHAIN) == []
        first = j.append(b"before")
        j.sync()
        moved = _swap_for_symlink(d, tmp_path / "theirs")
        j.trim(first)  # the writer's committer: that segment is in the chain now
        last = 0
        for i in range(40):  # past segment_bytes: a second new segment
            last = j.append(b"after %d " % i + b"x" * 200)
            j.sync()
        assert list((tmp_path / "theirs").iterdir()) == [], "segments written into theirs"
        names = sorted(p.name for p in moved.glob("journal-*.log"))
        assert len(names) >= 2, names
    finally:
        j.close(applied_upto=-1)
    j2 = Journal(moved)
    try:
        assert [pos for pos, _ in j2.open(first, chain_id=CHAIN)] == list(range(2, last + 1))
    finally:
        j2.close(applied_upto=-1)


def test_a_trim_after_the_swap_deletes_nothing_of_theirs(tmp_path: Path) -> None:
    """Trimming unlinked ``<path>/journal-<n>.log``: through a swapped-in symlink, a file of
    that name in the target went, and the real segment stayed."""
    d = tmp_path / "journal"
    j = Journal(d)
    try:
        j.open(0, chain_id=CHAIN)
        pos = j.append(b"event")
        j.sync()
        [seg] = [p.name for p in d.glob("journal-*.log")]
        theirs = tmp_path / "theirs"
        moved = _swap_for_symlink(d, theirs)
        (theirs / seg).write_bytes(b"someone else's file")
        j.trim(pos)
        assert (theirs / seg).read_bytes() == b"someone else's file"
        assert not (moved / seg).exists(), "the applied segment was left behind"
    finally:
        j.close(applied_upto=-1)


def test_a_fifo_planted_as_a_segment_is_refused_without_hanging(tmp_path: Path) -> None:
    d = tmp_path / "journal"
    d.mkdir(mode=0o700)
    (d / "chain").write_text(CHAIN)
    os.mkfifo(d / f"journal-{1:020d}.log", 0o600)
    assert "segment" in _refused(d)

"""The journal against a model, on real files (hypothesis stateful testing): any sequence of
appends, syncs, commits (the chain's mark moving, segments trimmed), clean stops and crashes,
including a crash that tears the write in progress. Always: what the files hold after the mark
is exactly the acknowledged records after it; a reopen returns those, in order; positions never
repeat; after a commit no segment holds only records the chain has."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvgov.ledger.journal import Journal, encode_record, inspect_journal

CHAIN = "model-chain"
SEGMENT = 4096


class JournalModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="kvgov-journal-model-"))
        self.journal = Journal(self.dir, segment_bytes=SEGMENT)
        assert self.journal.open(0, chain_id=CHAIN) == []
        #: records on disk (acknowledged once synced), and those appended since the last sync
        self.durable: dict[int, bytes] = {}
        self.unsynced: list[tuple[int, bytes]] = []
        #: the chain's mark (what the database holds)
        self.mark = 0
        self.last_pos = 0

    def teardown(self) -> None:
        self.journal.close(applied_upto=-1)
        shutil.rmtree(self.dir, ignore_errors=True)

    def after_mark(self) -> list[tuple[int, bytes]]:
        return sorted((p, b) for p, b in self.durable.items() if p > self.mark)

    @rule(payload=st.binary(min_size=0, max_size=1500))
    def append(self, payload: bytes) -> None:
        pos = self.journal.append(payload)
        assert pos == self.last_pos + 1  # positions never repeat, never skip
        self.last_pos = pos
        self.unsynced.append((pos, payload))

    @rule()
    def sync(self) -> None:
        assert self.journal.sync() == self.last_pos
        self.durable.update(self.unsynced)
        self.unsynced = []

    @precondition(lambda self: any(p > self.mark for p in self.durable))
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        """The writer committed a prefix of the acknowledged records: mark, then trim."""
        top = max(self.durable)
        self.mark = data.draw(st.integers(self.mark + 1, top), label="commit upto")
        self.journal.trim(self.mark)
        for seg in inspect_journal(self.dir).segments:
            assert seg.last > self.mark, f"{seg.name} holds only applied records"

    @rule()
    def clean_stop(self) -> None:
        self.sync()
        self.journal.close(applied_upto=self.mark)
        if self.mark >= self.last_pos:
            assert list(self.dir.glob("journal-*.log")) == []  # a clean stop leaves nothing
        self.reopen()

    @rule(cut=st.integers(min_value=1, max_value=3000))
    def crash_mid_write(self, cut: int) -> None:
        """The process dies while writing what was appended since the last sync: a prefix of
        it reaches the last segment (never acknowledged: any of it may be lost)."""
        data = b"".join(encode_record(p, b) for p, b in self.unsynced)
        segs = sorted(self.dir.glob("journal-*.log"))
        written = data[: max(0, len(data) - cut)]
        if written and segs:
            with segs[-1].open("ab") as f:
                f.write(written)
            # records written whole read back (and are replayed: the event did happen)
            off = 0
            for p, b in self.unsynced:
                end = off + len(encode_record(p, b))
                if end > len(written):
                    break
                self.durable[p] = b
                off = end
        self.unsynced = []
        self.journal.close(applied_upto=-1)  # releases the lock, deletes nothing
        self.reopen()

    def reopen(self) -> None:
        self.journal = Journal(self.dir, segment_bytes=SEGMENT)
        assert self.journal.open(self.mark, chain_id=CHAIN) == self.after_mark()
        self.last_pos = max([*self.durable, self.mark])
        self.unsynced = []

    @invariant()
    def the_files_hold_exactly_the_acknowledged_records_after_the_mark(self) -> None:
        report = inspect_journal(self.dir)
        on_disk = [p for p in report.records if p > self.mark]
        assert on_disk == [p for p, _ in self.after_mark()]
        assert not report.blocks_start


JournalModel.TestCase.settings = settings(max_examples=75, stateful_step_count=30, deadline=None)
test_journal_against_its_model = JournalModel.TestCase

"""Sequencing: the ledger writer's chain head, and each batch's seqs and hashes.

The :class:`Sequencer` runs on one thread of its own (the chain's only sequencer). It prepares
a batch's events (refusing, one by one, what the database could never store) and chains them
on top of the head it expects: the head the previous batch ended on, or, after the committer
had to re-chain a batch on the database's real head (a refused event, another writer), that
head (:meth:`Sequencer.follow`). On Postgres it also formats the rows as COPY text, so the
committer thread does not have to. Hashing the next batch thus overlaps the database writing
the previous one; the committer checks, under the chain's lock, that the head it expected is
the database's.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from kvgov.errors import LedgerError
from kvgov.ledger.batch import Head, Prepared, Rows, chain_rows, prepare
from kvgov.ledger.events import Appended, Event

#: what became of one event: where it landed, or why it was not written
Result = Appended | LedgerError

#: the sequencer yields the GIL (``time.sleep(0)``) after this many events. Without it, each
#: time the committer's database call returns it waits for the CPU-bound sequencer to be
#: preempted (``sys.getswitchinterval()``, 5 ms): a GIL convoy that cost a batch of 2,000
#: events tens of milliseconds, a third of the writer's throughput
YIELD_EVERY = 128


@dataclass(slots=True)
class Chained:
    """A batch as the sequencer hands it to the committer."""

    results: list[Result | None]  # per event; preset for events refused by ``prepare``
    ready: list[tuple[int, Prepared]]
    expected: Head
    rows: Rows
    #: the journal position of each ready event (0: not journaled)
    positions: list[int]
    #: the rows as COPY text (Postgres), formatted here rather than by the committer
    copy: str | None = None


class Sequencer:
    """Chains batches of one chain, in order, on the head the previous batch ended on."""

    def __init__(self, chain_id: str, *, copy: bool) -> None:
        self.chain_id = chain_id
        #: Postgres: format each batch as COPY text too
        self._copy = copy
        self._lock = threading.Lock()
        self._head: Head = (0, "")
        #: a head the committer chained on (it re-chained a batch): the next batch follows it
        self._reset: Head | None = None

    def start(self, head: Head) -> None:
        """Start from the chain's head as the database has it."""
        self._head = head

    def follow(self, head: Head) -> None:
        """The committer re-chained a batch and the chain now ends on ``head``: chain the next
        batch on it (any thread)."""
        with self._lock:
            self._reset = head

    def sequence(self, events: list[Event | Prepared], positions: list[int]) -> Chained:
        """Sequencer thread: prepare and chain a batch on top of the head it expects. Events
        already :class:`Prepared` (journaled: prepared when they were queued) are taken as
        they are; ``positions`` are their journal positions (0: not journaled)."""
        results: list[Result | None] = [None] * len(events)
        ready: list[tuple[int, Prepared]] = []
        ready_positions: list[int] = []
        for i, event in enumerate(events):
            if i % YIELD_EVERY == YIELD_EVERY - 1:
                time.sleep(0)
            if isinstance(event, Prepared):
                ready.append((i, event))
                ready_positions.append(positions[i])
                continue
            try:
                ready.append((i, prepare(event)))
                ready_positions.append(positions[i])
            except LedgerError as err:
                results[i] = err
        lines: list[str] | None = [] if self._copy else None
        with self._lock:
            if self._reset is not None:
                self._head, self._reset = self._reset, None
            expected = head = self._head
            batch = [p for _, p in ready]
            rows: Rows = []
            for start in range(0, len(batch), YIELD_EVERY):
                part, head = chain_rows(
                    self.chain_id, head, batch[start : start + YIELD_EVERY], lines
                )
                rows.extend(part)
                time.sleep(0)
            self._head = head
        copy = None
        if lines is not None:
            lines.append("")
            copy = "\n".join(lines)
        return Chained(results, ready, expected, rows, ready_positions, copy)

"""The ledger writer's counters, shared by its parts and read by the sidecar's metrics."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class WriterStats:
    """Counters for metrics."""

    events_written: int = 0
    events_failed: int = 0
    batches_committed: int = 0
    batch_retries: int = 0
    backpressure_rejections: int = 0
    last_batch_size: int = 0
    last_commit_s: float = 0.0
    journal_replayed: int = 0
    journal_failures: int = 0
    #: journal syncs (``fdatasync``) since start: with puts per second, how many share one
    journal_syncs: int = 0
    #: positions of the chain found written by someone else while this writer held it, and
    #: the foreign seals that name them (:mod:`~kvgov.ledger.writing.foreign`)
    foreign_appends: int = 0
    foreign_seals: int = 0
    #: keys of the writer's own seals found taken by a row it did not write (the seal went
    #: under a fresh key), and transactions retried because a seal of its own could not be
    #: written (``kvgov.errors.LedgerSealError``): each an alert, never a refused event
    seal_keys_taken: int = 0
    seal_failures: int = 0

    def summary(self) -> dict[str, float | int]:
        """What the writer logs when it closes."""
        return {
            "events_written": self.events_written,
            "events_failed": self.events_failed,
            "batches_committed": self.batches_committed,
            "batch_retries": self.batch_retries,
            "foreign_appends": self.foreign_appends,
            "seal_keys_taken": self.seal_keys_taken,
            "seal_failures": self.seal_failures,
        }

"""A process-wide count that threads bump: how many bounded reads stopped at their cap
(:mod:`kvgov.ledger.checkpoint_scan`, :mod:`kvgov.ledger.seals.scan`), read by a metric."""

from __future__ import annotations

import threading


class Tally:
    """A count since the process started; :meth:`hit` from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0

    def hit(self) -> None:
        with self._lock:
            self.count += 1

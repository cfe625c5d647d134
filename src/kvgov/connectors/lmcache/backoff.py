"""A small circuit breaker: after a connection failure, skip the sidecar for a while (stdlib).

While the sidecar is down every LMCache operation would otherwise wait for a connect timeout;
with the breaker open they return a miss at once, and the first call after the pause tries
again. The pause doubles on each consecutive failure up to a maximum and resets on success.
"""

from __future__ import annotations

import threading
import time


class Backoff:
    def __init__(self, initial_s: float, maximum_s: float) -> None:
        self._initial = initial_s
        self._maximum = max(maximum_s, initial_s)
        self._delay = 0.0
        self._until = 0.0
        self._lock = threading.Lock()
        self.failures = 0

    def allow(self) -> bool:
        """True when a call may try the sidecar now."""
        return time.monotonic() >= self._until

    @property
    def open(self) -> bool:
        return not self.allow()

    def failure(self) -> None:
        with self._lock:
            self.failures += 1
            self._delay = min(max(self._delay * 2, self._initial), self._maximum)
            self._until = time.monotonic() + self._delay

    def success(self) -> None:
        if self._delay or self._until:
            with self._lock:
                self._delay = 0.0
                self._until = 0.0

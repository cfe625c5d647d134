"""Follow a file-backed source while the process runs: the policy's sources
(:mod:`kvgov.policy.watch`) and the engine token file (:class:`kvgov.proxy.app.Sidecar`).

A mounted ConfigMap or Secret changes under a running pod (the kubelet swaps its files in one
step); a sidecar that read it at start only kept what it had read. :func:`follow` looks at the
files every interval (their identities and times: a few ``stat`` calls, in a worker thread)
and, when they changed, runs ``apply``, which reads and takes the new content. What ``apply``
raises never ends the loop: a refusal (the content is invalid: ``refused`` errors, whose
messages name what is wrong and never a secret) is logged once per distinct message and waits
for the next change; anything else is logged by its type only (its message could quote the
file) and is tried again next time (a file swapped mid-read).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

#: one file's (path, inode, size, mtime in ns); (path, -1, -1, -1) when it cannot be read
Stamp = tuple[tuple[str, int, int, int], ...]


def file_stamp(paths: Iterable[Path]) -> Stamp:
    """The identities and times of ``paths`` (symlinks followed: a ConfigMap's or Secret's
    swapped files count). Different whenever one of them was replaced, grown, touched, removed
    or created; the same, cheaply, while nothing changed."""
    out: list[tuple[str, int, int, int]] = []
    for path in paths:
        try:
            st = path.stat()
        except OSError:
            out.append((str(path), -1, -1, -1))
            continue
        out.append((str(path), st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


async def follow(
    stamp: Callable[[], object],
    apply: Callable[[], Awaitable[None]],
    interval_s: float,
    *,
    log: logging.Logger,
    event: str,
    refused: type[Exception],
    level: int = logging.WARNING,
) -> None:
    """Every ``interval_s``, run ``apply`` when ``stamp()`` changed (the first look always
    runs it: a change since start counts); runs until cancelled. Failures are logged as
    ``event`` at ``level`` (see the module docstring)."""
    last: object = None
    failed: str | None = None
    while True:
        await asyncio.sleep(interval_s)
        now = await asyncio.to_thread(stamp)
        if now == last:
            continue
        last = now
        try:
            await apply()
        except Exception as exc:  # noqa: BLE001 - a dead loop would keep what was revoked
            error = str(exc) if isinstance(exc, refused) else type(exc).__name__
            if error != failed:  # once per distinct error, not every interval
                failed = error
                log.log(level, event, extra={"error": error[:500]})
            if not isinstance(exc, refused):
                last = None  # a passing fault: look again next time
            continue
        failed = None

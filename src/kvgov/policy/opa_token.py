"""OPA's bearer token from ``policy.opa_token_file``, followed while the sidecar runs.

The file is a mounted Secret (``kvgov-opa-token``), which Kubernetes rotates in place: the
kubelet writes the new content beside the old and swaps the volume's ``..data`` symlink. A
sidecar that read the file once kept sending the old token, and once OPA held the new one
every decision was a 401: every put and get denied until the pod restarted.

:class:`OpaTokenFile` holds the token in force and looks at the file when the OPA engine asks
(:meth:`~OpaTokenFile.look`): on the decision path at most every
``policy.opa_token_reload_interval_s`` (:meth:`~OpaTokenFile.due`), at once when OPA refuses
the token (401/403), and on every decision while the file's content is refused. A look is a
``stat`` of the file, symlinks followed (:func:`kvgov.follow.file_stamp`: inode, size, mtime);
only a changed file is read, with every check of start-up
(:meth:`kvgov.config.Settings.read_opa_token_file`: trimmed, not empty, one printable word, in
production one the shipped authz policy admits). Looks in flight are shared: a burst of 401s
stats the file once.

A changed file whose content is refused leaves no token at all (:attr:`~OpaTokenFile.token`
is None; the engine sends nothing and denies ``opa_token_invalid``): not the old token, which
the operator replaced. The refusal is logged once per change (``policy.opa_token_refused``),
naming the file and what is wrong with it; no log line carries the token.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

from kvgov.errors import ConfigError
from kvgov.follow import Stamp, file_stamp
from kvgov.logging import get_logger

__all__ = ["OpaTokenFile"]

log = get_logger(__name__)


class OpaTokenFile:
    """The token of ``path``, read by ``read`` (which raises :class:`ConfigError` naming the
    file, never the token) now and after each change of the file."""

    def __init__(
        self,
        path: Path,
        read: Callable[[], str],
        *,
        interval_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self.interval_s = interval_s
        self._read = read
        self._clock = clock
        # stamped before the read: a change in between is seen (and read) at the next look
        self._stamp: Stamp | None = file_stamp([path])
        self._token: str | None = read()  # at start-up a refusal stops the sidecar
        self._looked_at = clock()
        self._look: asyncio.Task[None] | None = None
        self._refused: str | None = None  # the last refusal logged
        #: changes taken, and changes refused, since start (the denies they cause are counted
        #: by reason in the data plane's metrics)
        self.reloads = 0
        self.refusals = 0

    @property
    def token(self) -> str | None:
        """The token to send; None: the file's latest content was refused (send nothing)."""
        return self._token

    def due(self) -> bool:
        """Whether a decision should look at the file before asking OPA: the interval is up,
        or there is no token to send (a fixed file must be taken without a 401 to prompt)."""
        if self._token is None:
            return True
        return self.interval_s > 0 and self._clock() - self._looked_at >= self.interval_s

    async def look(self) -> str | None:
        """Look at the file now (joining a look in flight); the token in force after it. A
        caller cancelled while waiting leaves the look to finish for the others."""
        task = self._look
        if task is None or task.done():
            task = self._look = asyncio.create_task(self._look_once())
        await asyncio.shield(task)
        return self._token

    async def _look_once(self) -> None:
        self._looked_at = self._clock()
        try:
            stamp = await asyncio.to_thread(file_stamp, [self.path])
            if stamp == self._stamp:
                return
            self._stamp = stamp
            token = await asyncio.to_thread(self._read)
        except ConfigError as exc:  # names the file and what is wrong, never the token
            self._refuse(exc.message, exc.hint)
            return
        except Exception as exc:  # noqa: BLE001 - fail closed; the message could quote it
            self._stamp = None  # a passing fault: read it again at the next look
            error = f"cannot read policy.opa_token_file {self.path}: {type(exc).__name__}"
            self._refuse(error, None, repeated=error == self._refused)
            return
        self._refused = None
        if token == self._token:
            return  # touched, or written again with the same token
        self._token = token
        self.reloads += 1
        log.info("policy.opa_token_reloaded", extra={"path": str(self.path)})

    def _refuse(self, error: str, hint: str | None, *, repeated: bool = False) -> None:
        """No token from now on; logged once per change of the file (``repeated``: the same
        passing fault again, already logged)."""
        self._token = None
        self._refused = error
        if repeated:
            return
        self.refusals += 1
        log.error(
            "policy.opa_token_refused",
            extra={
                "path": str(self.path),
                "error": error[:500],
                "effect": "nothing is sent to OPA: every decision denies opa_token_invalid"
                " until the file holds a token again",
                "hint": hint or "put OPA's token back in Secret kvgov-opa-token",
                "docs": "docs/policy.md, Rotating OPA's token",
            },
        )

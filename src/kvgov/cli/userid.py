"""``--user-file``: a user id read from a file or standard input, not from the command line.

A raw user id on the command line is personal data where the platform keeps command lines: run
through ``kubectl exec`` (as ``docs/deploy.md`` shows for the CLI), it is in the Kubernetes API
server's audit log (the exec request's URI holds the command), and while the command runs it
is in ``/proc/<pid>/cmdline`` for every local user. ``--user-file -`` reads it from standard
input (``printf %s "$id" | kubectl exec -i ... -- kvgov purge --user-file - ...``), which
neither keeps.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

UserFileOpt = Annotated[
    str | None,
    typer.Option(
        "--user-file",
        help=(
            "Read the user id from this file ('-': standard input) instead of --user, so it"
            " stays out of command lines and audit logs."
        ),
    ),
]


def user_id(user: str | None, user_file: str | None) -> str | None:
    """The user id from ``--user`` or ``--user-file`` (at most one of them); None for neither.
    Raises :class:`typer.BadParameter` for both, or for a file that holds no id or more than
    one line."""
    if user_file is None:
        return user
    if user is not None:
        raise typer.BadParameter("give --user or --user-file, not both")
    try:
        text = sys.stdin.read() if user_file == "-" else Path(user_file).read_text("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise typer.BadParameter(f"cannot read the user id: {exc}") from None
    if text.endswith("\n"):
        text = text[:-1].removesuffix("\r")
    if not text or "\n" in text or "\r" in text:
        raise typer.BadParameter("the user id file must hold one id on one line")
    return text

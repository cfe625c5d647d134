"""``kvgov health``: ask this host's sidecar whether it is ready (the image's HEALTHCHECK).

Standard library only, and no ledger or policy is touched: it reads the control plane's
address from the settings and GETs ``/readyz`` (``--live``: ``/healthz``). Exit 0 when the
answer is 200, 1 otherwise (not ready, draining, nothing listening).
"""

from __future__ import annotations

from typing import Annotated

import typer

#: addresses a server binds to that mean "every address": the probe asks loopback instead
_ANY = frozenset({"", "0.0.0.0", "::", "[::]"})  # noqa: S104 - compared, never bound


def probe_url(host: str, port: int, *, live: bool = False) -> str:
    """The URL of this host's control plane probe for a server bound to ``host:port``."""
    host = "127.0.0.1" if host in _ANY else host
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}/{'healthz' if live else 'readyz'}"


def check(url: str, timeout_s: float) -> tuple[bool, str]:
    """GET ``url`` with no proxy; (ready, what was seen)."""
    import urllib.error
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout_s) as reply:
            return reply.status == 200, f"{reply.status}"
    except urllib.error.HTTPError as exc:
        return False, f"{exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return False, f"unreachable ({reason})"


def register(app: typer.Typer) -> None:
    @app.command()
    def health(
        ctx: typer.Context,
        live: Annotated[
            bool, typer.Option("--live", help="Ask /healthz (alive) instead of /readyz.")
        ] = False,
        url: Annotated[
            str | None, typer.Option("--url", help="Probe this URL instead of the settings'.")
        ] = None,
        timeout: Annotated[float, typer.Option("--timeout", help="Seconds to wait.")] = 2.0,
    ) -> None:
        """Exit 0 if this host's sidecar answers /readyz (or /healthz) with 200."""
        if url is None:
            from kvgov.cli._common import settings

            api = settings(ctx).api
            url = probe_url(api.host, api.port, live=live)
        ok, seen = check(url, timeout)
        typer.echo(f"{url}: {seen}", err=not ok)
        raise typer.Exit(0 if ok else 1)

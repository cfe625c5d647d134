"""``kvgov serve``: run the sidecar (data plane, ``lm://`` listener, control plane) until
SIGTERM/SIGINT, then stop accepting, drain in-flight puts and flush the ledger."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    @app.command()
    def serve(ctx: typer.Context) -> None:
        """Run the kvgov sidecar."""
        import asyncio

        from kvgov.cli._common import settings
        from kvgov.logging import configure_logging
        from kvgov.proxy.app import run_sidecar

        cfg = settings(ctx)
        configure_logging(cfg.log_level, json_output=cfg.log_json)
        asyncio.run(run_sidecar(cfg))

"""The control plane's FastAPI application factory.

``create_control_app(sidecar)`` serves ``/healthz`` (the process is up), ``/readyz`` (the data
plane accepts requests) and Prometheus ``/metrics`` (the data plane's own registry). Other
modules add their routers to the returned app (``app.include_router``); KV bytes never pass
through it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvgov import __version__

if TYPE_CHECKING:
    from kvgov.proxy.app import Sidecar


def create_control_app(sidecar: Sidecar) -> FastAPI:
    app = FastAPI(title="kvgov control plane", version=__version__)
    app.state.sidecar = sidecar

    @app.get("/healthz", tags=["ops"])
    async def healthz() -> dict[str, str]:
        """The process is alive."""
        return {"status": "ok"}

    @app.get("/readyz", tags=["ops"])
    async def readyz(response: Response) -> dict[str, object]:
        """The data plane is listening and not draining (503 otherwise)."""
        ready = sidecar.ready and not sidecar.server.draining
        if not ready:
            response.status_code = 503
        return {
            "status": "ready" if ready else "not_ready",
            "sidecar": sidecar.sidecar_id,
            "listeners": sidecar.addresses,
            "connections": len(sidecar.server.connections),
            "governance": sidecar.pipeline.governance,
        }

    @app.get("/metrics", tags=["ops"])
    async def metrics() -> Response:
        """Prometheus exposition of the data plane's metrics."""
        return Response(generate_latest(sidecar.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    if sidecar.engine is not None and sidecar.writer is not None:  # the compliance API
        from kvgov.proxy.api.v1 import include_sidecar_api

        include_sidecar_api(app, sidecar.settings, sidecar.engine, sidecar.writer)
        app.state.kvgov_keyring = sidecar.pipeline.keyring  # /v1/keys rotates this one
    if sidecar.purge is not None and getattr(app.state, "kvgov_api", None) is not None:
        from kvgov.proxy.api.v1.purges import include_purges

        include_purges(app, sidecar.purge.service, wake=sidecar.purge.wake)
    return app

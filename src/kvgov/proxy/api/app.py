"""The control plane's FastAPI application factory.

``create_control_app(sidecar)`` serves ``/healthz`` (the process is up) and ``/readyz`` (the
data plane accepts requests) to anyone, with a status and nothing else; Prometheus ``/metrics``
(the data plane's own registry) to a fleet-wide auditor or admin token unless
``api.metrics_public``; the OpenAPI document and pages in development (``api.docs``). Other
modules add their routers to the returned app (``app.include_router``); KV bytes never pass
through it. Every door and who may use it: ``docs/threat-model.md``, "Doors".
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import Depends, FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvgov import __version__
from kvgov.types import Environment

if TYPE_CHECKING:
    from kvgov.proxy.app import Sidecar


def create_control_app(sidecar: Sidecar) -> FastAPI:
    settings = sidecar.settings
    docs = settings.api.docs
    if docs is None:
        docs = settings.environment is Environment.DEVELOPMENT
    app = FastAPI(
        title="kvgov control plane",
        version=__version__,
        openapi_url="/openapi.json" if docs else None,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
    )
    app.state.sidecar = sidecar

    # probes: kubelet sends no token, so they say whether, and nothing else
    @app.get("/healthz", tags=["ops"])
    async def healthz() -> dict[str, str]:
        """The process is alive."""
        return {"status": "ok"}

    @app.get("/readyz", tags=["ops"])
    async def readyz(response: Response) -> dict[str, str]:
        """The data plane is listening and not draining (503 otherwise)."""
        ready = sidecar.ready and not sidecar.server.draining
        if not ready:
            response.status_code = 503
        return {"status": "ready" if ready else "not_ready"}

    api = sidecar.engine is not None and sidecar.writer is not None
    if api:  # the compliance API
        from kvgov.proxy.api.compliance import include_sidecar_api

        include_sidecar_api(app, settings, sidecar.engine, sidecar.writer)
        app.state.kvgov_keyring = sidecar.pipeline.keyring  # /v1/keys rotates this one
    if sidecar.purge is not None and getattr(app.state, "kvgov_api", None) is not None:
        from kvgov.proxy.api.v1.purges import include_purges

        include_purges(app, sidecar.purge.service, wake=sidecar.purge.wake)

    async def metrics() -> Response:
        """Prometheus exposition of the data plane's metrics."""
        return Response(generate_latest(sidecar.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    guards = []
    if api and not settings.api.metrics_public:  # else: open on purpose, or no tokens to check
        from kvgov.proxy.api.auth import require_fleet_reader

        guards.append(Depends(require_fleet_reader))
    app.add_api_route(
        "/metrics",
        metrics,
        methods=["GET"],
        tags=["ops"],
        dependencies=guards,
        description="An auditor or admin token that is not tenant-scoped (the counts move with "
        "every tenant's traffic), unless `api.metrics_public`.",
    )

    return app

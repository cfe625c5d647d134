"""The control plane's FastAPI application factory.

``create_control_app(plane)`` serves ``/healthz`` (the process is up) and ``/readyz`` (the
data plane accepts requests) to anyone, with a status and nothing else; Prometheus ``/metrics``
(the data plane's own registry) to a fleet-wide auditor or admin token unless
``api.metrics_public``; the OpenAPI document and pages in development (``api.docs``). Other
modules add their routers to the returned app (``app.include_router``); KV bytes never pass
through it. Every door and who may use it: ``docs/threat-model.md``, "Doors".

It sees the sidecar only through a :class:`ControlPlane`: what the routes need (readiness, the
metrics registry, the ledger's engine and writer, the keyring, the purge service), never the
sidecar itself (``Sidecar.control_plane()`` builds it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import Depends, FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from kvgov import __version__
from kvgov.config import Settings
from kvgov.types import Environment

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from kvgov.keys.keyring import Keyring
    from kvgov.ledger.events import EventSink
    from kvgov.ledger.pseudonym import Pseudonymizer
    from kvgov.proxy.api.verifier import LedgerVerifier
    from kvgov.services.purge.service import PurgeService


@dataclass(frozen=True, slots=True)
class Ledger:
    """The ledger the compliance API reads and records to."""

    engine: Engine
    sink: EventSink
    #: the pseudonym key the sidecar checked against the ledger's pin at start (None: read
    #: ``ledger.pseudonym_key_path``, for an API without a sidecar)
    pseudonymizer: Pseudonymizer | None = None
    #: runs the API's whole-ledger verifications, one at a time, and keeps their report (the
    #: sidecar's own: one per process however many apps are built); None: one per app
    verifier: LedgerVerifier | None = None


@dataclass(frozen=True, slots=True)
class Purges:
    """The purge service ``POST /v1/purges`` starts jobs on, and what wakes its executor."""

    service: PurgeService
    wake: Callable[[], None] | None = None
    #: counts a creation refused, by reason (the sidecar's ``kvgov_api_purges_refused``)
    refused: Callable[[str], None] | None = None


@dataclass(frozen=True, slots=True)
class ControlPlane:
    """What the control plane needs of a sidecar, and nothing else."""

    settings: Settings
    #: the data plane listens and is not draining
    is_ready: Callable[[], bool]
    metrics: CollectorRegistry
    #: None: no ledger (an ungoverned benchmark sidecar): probes and metrics only
    ledger: Ledger | None = None
    #: the keyring ``/v1/keys`` rotates (the sidecar's own, so rotation takes effect at once)
    keyring: Keyring | None = None
    purges: Purges | None = None


def create_control_app(plane: ControlPlane) -> FastAPI:
    settings = plane.settings
    docs = settings.api.docs
    if docs is None:
        docs = settings.environment is Environment.DEVELOPMENT
    app = FastAPI(
        title="kvgov control plane",
        version=__version__,
        openapi_url="/openapi.json" if docs else None,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        # no 307 to the path without its trailing slash: the redirect's Location echoed the
        # path, a raw user id in it, before any token was looked at (a plain 404 instead)
        redirect_slashes=False,
    )

    # probes: kubelet sends no token, so they say whether, and nothing else
    @app.get("/healthz", tags=["ops"])
    async def healthz() -> dict[str, str]:
        """The process is alive."""
        return {"status": "ok"}

    @app.get("/readyz", tags=["ops"])
    async def readyz(response: Response) -> dict[str, str]:
        """The data plane is listening and not draining (503 otherwise)."""
        ready = plane.is_ready()
        if not ready:
            response.status_code = 503
        return {"status": "ready" if ready else "not_ready"}

    api = plane.ledger is not None
    if plane.ledger is not None:  # the compliance API
        from kvgov.proxy.api.compliance import include_sidecar_api

        include_sidecar_api(
            app,
            settings,
            plane.ledger.engine,
            plane.ledger.sink,
            pseudonymizer=plane.ledger.pseudonymizer,
            verifier=plane.ledger.verifier,
        )
        app.state.kvgov_keyring = plane.keyring  # /v1/keys rotates this one
        if plane.purges is not None:
            from kvgov.proxy.api.v1.purges import include_purges

            include_purges(
                app, plane.purges.service, wake=plane.purges.wake, refused=plane.purges.refused
            )

    async def metrics() -> Response:
        """Prometheus exposition of the data plane's metrics."""
        return Response(generate_latest(plane.metrics), media_type=CONTENT_TYPE_LATEST)

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

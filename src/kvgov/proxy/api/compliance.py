"""Mounting the compliance API: ``/v1`` and ``/dashboard`` on the control-plane app.

The application factory calls :func:`include_sidecar_api` (tests: :func:`include_v1`) once with
an :class:`ApiContext`; nothing is built at import time. It mounts every read route, purges and
keys included; ``POST /v1/purges`` needs the purge service and is mounted by
:func:`kvgov.proxy.api.v1.purges.include_purges`.
"""

from __future__ import annotations

import secrets

from fastapi import FastAPI
from sqlalchemy import Engine

from kvgov.config import Settings
from kvgov.ledger.events import EventSink
from kvgov.ledger.pseudonym import Pseudonymizer
from kvgov.proxy.api import dashboard
from kvgov.proxy.api.auth import ApiContext
from kvgov.proxy.api.problems import install_problem_handlers
from kvgov.proxy.api.v1 import API_DESCRIPTION, OPENAPI_TAGS, v1_router
from kvgov.proxy.api.verifier import LedgerVerifier


def include_v1(app: FastAPI, ctx: ApiContext) -> None:
    """Mount ``/v1`` and ``/dashboard`` on ``app`` and answer its errors as problem+json."""
    app.state.kvgov_api = ctx
    install_problem_handlers(app)
    app.include_router(v1_router())
    dashboard.mount(app)
    app.description = (app.description or "") + API_DESCRIPTION
    app.openapi_tags = [*(app.openapi_tags or []), *OPENAPI_TAGS]
    app.openapi_schema = None


def include_sidecar_api(
    app: FastAPI,
    settings: Settings,
    engine: Engine,
    sink: EventSink,
    *,
    pseudonymizer: Pseudonymizer | None = None,
    verifier: LedgerVerifier | None = None,
) -> None:
    """What the control-plane factory calls: the compliance API over the sidecar's ledger
    engine and writer, pseudonymising with ``pseudonymizer``: the sidecar's, whose key was
    checked against the ledger's pin at start (None: ``ledger.pseudonym_key_path`` read now).
    Read again here, a file replaced since the check would go unchecked. ``verifier``: the
    sidecar's (one per process: :mod:`kvgov.proxy.api.verifier`); None: one of the app's own."""
    from kvgov.ledger.trust import trusted_keys

    trusted_keys(settings)  # a malformed or unreadable trusted key stops start-up
    own_chain = getattr(sink, "chain_id", None)
    ctx = ApiContext(
        settings=settings,
        engine=engine,
        sink=sink,
        pseudonymizer=pseudonymizer or Pseudonymizer.from_file(settings.pseudonym_key_path),
        # dashboard sessions end when the process restarts (sign in again)
        session_secret=secrets.token_bytes(32),
        # read again at each verification (a rotated ConfigMap is picked up)
        expected_chains=(own_chain,) if isinstance(own_chain, str) else (),
        verifier=verifier,
    )
    include_v1(app, ctx)

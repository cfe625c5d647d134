"""A loopback STAND-IN for an OPA server's REST API, evaluating with the real OPA engine.

No OPA server binary can be installed here, so this tiny aiohttp app speaks the part of OPA's
REST API kvgov uses (``PUT /v1/policies/{id}``, ``PUT``/``POST /v1/data/{path}``,
``GET /health``) and evaluates with OPA itself, in process, through
``opa-golib-python-bindings`` (OPA v1.x as a shared library). Like OPA, an undefined document
is HTTP 200 without ``result``. Knobs make it slow, failing or garbled, to test the client's
fail-closed paths.

The helpers here (``golib_engine``, ``OpaStandIn``) are imported by the other policy tests;
the tests in this file check that the stand-in behaves like OPA where kvgov relies on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import socket
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from kvgov.policy.bundle import PolicyBundle, load_bundle
from kvgov.policy.interfaces import (
    Decision,
    PolicyInput,
    PolicyRevision,
    safe_digest,
    validated_document,
)

opa_bindings = pytest.importorskip("opa_bindings", reason="opa-golib-python-bindings not installed")
web = pytest.importorskip("aiohttp.web")


def golib_engine(bundle: PolicyBundle, *, with_tests: bool = False) -> Any:
    """The real OPA engine loaded with a bundle's policies (and tests) and data."""
    engine = opa_bindings.OpaEngine()
    for module in bundle.modules + (bundle.tests if with_tests else ()):
        engine.add_policy(module.name, module.source)
    engine.add_data(bundle.data_document())
    return engine


class GolibPolicyEngine:
    """Test-only adapter: decisions from the real OPA engine, shaped like kvgov's engines."""

    def __init__(self, bundle: PolicyBundle) -> None:
        self.engine = golib_engine(bundle)
        self.revision: PolicyRevision = bundle.revision

    def raw(self, doc: object) -> object:
        try:
            return self.engine.eval_document("kvgov.authz.decision", doc)
        except opa_bindings.OpaUndefinedError:
            return None

    def decide_sync(self, inp: PolicyInput) -> Decision:
        doc, problems = validated_document(inp)
        if doc is None:
            return Decision.deny(*problems, revision=self.revision, input_digest=safe_digest(inp))
        return Decision.from_result(
            self.raw(doc), revision=self.revision, input_digest=safe_digest(inp)
        )


class OpaStandIn:
    """The stand-in server. ``mode``: "ok", "slow", "error" (HTTP 500), "garbage" (not JSON),
    "undefined" (every decision undefined). ``unix=True``: it listens, as the production OPA
    does (``--addr=unix:///run/opa/opa.sock``), on a Unix socket in a fresh directory of its
    own (0700, short path: ``sun_path`` holds 107 bytes); ``url`` is then ``unix:///...``."""

    def __init__(self, *, unix: bool = False) -> None:
        self.unix = unix
        self.socket_path: Path | None = None
        self.engine = opa_bindings.OpaEngine()
        self.mode = "ok"
        self.delay_s = 2.0
        self.requests: list[tuple[str, str]] = []
        self.release = asyncio.Event()
        self.url = ""
        #: aiohttp middlewares run before every route (set before start(): e.g. OPA's
        #: authentication and authorization, tests/security/test_opa_api_authz.py)
        self.middlewares: list[Any] = []
        self._runner: Any = None

    def load(self, bundle: PolicyBundle, *, with_tests: bool = False) -> None:
        self.engine = golib_engine(bundle, with_tests=with_tests)

    async def start(self) -> None:
        app = web.Application(middlewares=self.middlewares)
        app.router.add_get("/health", self._health)
        app.router.add_put("/v1/policies/{id:.+}", self._put_policy)
        app.router.add_put("/v1/data/{path:.*}", self._put_data)
        app.router.add_post("/v1/data/{path:.*}", self._query)
        self._runner = web.AppRunner(app, shutdown_timeout=0.5, handle_signals=False)
        await self._runner.setup()
        if self.unix:
            self.socket_path = Path(tempfile.mkdtemp(prefix="opa-")) / "opa.sock"
            unix_site = web.UnixSite(self._runner, str(self.socket_path))
            await unix_site.start()
            self.url = f"unix://{self.socket_path}"
            return
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        self.release.set()
        if self._runner is not None:
            await self._runner.cleanup()
        if self.socket_path is not None:
            shutil.rmtree(self.socket_path.parent, ignore_errors=True)

    async def _misbehave(self) -> Any:
        if self.mode == "slow":
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.release.wait(), timeout=self.delay_s)
        if self.mode == "error":
            return web.json_response({"code": "internal_error", "message": "boom"}, status=500)
        if self.mode == "garbage":
            return web.Response(text="<html>proxy error</html>", content_type="text/html")
        return None

    async def _health(self, request: Any) -> Any:
        return web.json_response({})

    async def _put_policy(self, request: Any) -> Any:
        self.requests.append(("PUT", request.path))
        source = await request.text()
        try:
            self.engine.add_policy(request.match_info["id"], source)
        except opa_bindings.OpaError as exc:
            return web.json_response(
                {"code": "invalid_parameter", "message": exc.message, "errors": []}, status=400
            )
        return web.json_response({})

    async def _put_data(self, request: Any) -> Any:
        self.requests.append(("PUT", request.path))
        value = await request.json()
        self.engine.add_data(value, request.match_info["path"].strip("/").replace("/", "."))
        return web.Response(status=204)

    async def _query(self, request: Any) -> Any:
        self.requests.append(("POST", request.path))
        bad = await self._misbehave()
        if bad is not None:
            return bad
        body = await request.json()
        path = request.match_info["path"].strip("/").replace("/", ".")
        if self.mode == "undefined":
            return web.json_response({})
        try:
            value = self.engine.eval_document(path, body.get("input"))
        except opa_bindings.OpaUndefinedError:
            return web.json_response({})  # OPA: undefined is 200 without "result"
        return web.json_response({"result": value})


@contextlib.asynccontextmanager
async def running_standin(*, unix: bool = False) -> AsyncIterator[OpaStandIn]:
    server = OpaStandIn(unix=unix)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture
async def opa_standin() -> AsyncIterator[OpaStandIn]:
    async with running_standin() as server:
        yield server


def closed_port_url() -> str:
    """A loopback URL nothing listens on (OPA down)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


# -- the stand-in itself ------------------------------------------------------------------


async def test_standin_answers_like_opa(opa_standin: OpaStandIn) -> None:
    from opa_client import AsyncOpaClient

    opa_standin.load(load_bundle())
    port = int(opa_standin.url.rsplit(":", 1)[1])
    async with AsyncOpaClient(host="127.0.0.1", port=port, retries=0) as client:
        assert await client.check_health()
        body = await client.query_rule({}, "kvgov.authz", "decision")
        assert body["result"]["allowed"] is False
        undefined = await client.query_rule({}, "kvgov.authz", "no_such_rule")
        assert undefined == {}


async def test_standin_rejects_bad_rego_like_opa(opa_standin: OpaStandIn) -> None:
    from opa_client import AsyncOpaClient
    from opa_client.errors import RegoParseError

    port = int(opa_standin.url.rsplit(":", 1)[1])
    async with AsyncOpaClient(host="127.0.0.1", port=port, retries=0) as client:
        with pytest.raises(RegoParseError):
            await client.update_policy_from_string(
                "package x\nimport rego.v1\np if {", "x", rego_compat=False
            )
        assert await client.update_or_create_data({"a": 1}, "x/y")
        assert json.dumps(opa_standin.engine.eval_document("x.y")) == '{"a": 1}'

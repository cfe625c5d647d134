"""OPA's own REST API in the pod is kvgov's alone (review: OPA sidecar unauthenticated).

Attack: the production overlay ran OPA as a sidecar with ``--addr=127.0.0.1:8181`` and no
``--authentication``/``--authorization``. Every container of a pod shares its network
namespace, so the vLLM container (user prompts, model code: the least trusted) could call OPA's
API on loopback: read the policy's data (``GET /v1/data``: tenants, their engines and labels),
the Rego (``GET /v1/policies``), ask any decision, and write policies and data.

Now OPA runs with ``--authentication=token --authorization=basic`` and the ``system.authz``
policy shipped in the overlay (``deploy/kubernetes/overlays/production/opa-authz.rego``):
default deny; ``GET /health`` for the probes; kvgov's decision request with the token of Secret
``kvgov-opa-token`` (OPA's ``KVGOV_OPA_TOKEN``, kvgov's ``policy.opa_token_file``).

Real Rego evaluation of THAT file (read from the overlay, not a copy) with the real OPA engine
(``opa-golib-python-bindings``), on the input OPA's authorizer builds (``server/authorizer``:
``method``, ``path`` as unescaped segments, ``params``, ``headers``, ``identity`` = the bearer
token) and with ``opa.runtime()`` as OPA's container has it. Then kvgov's own OPA client, end to
end, through the OPA stand-in with that authorizer in front. No OPA server can run here: OPA's
own handling of the two flags (the identity it derives from the header, that the policy is
asked at all) is not exercised; the manifests' wiring is checked by
``tests/integration/test_deploy_manifests.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote

import pytest

from kvgov.config import Settings
from kvgov.policy.bundle import load_bundle
from kvgov.policy.factory import build_inner_engine
from kvgov.policy.interfaces import DECISION_RULE, POLICY_PACKAGE
from tests.integration.test_policy_opa_rest import ALLOWED
from tests.integration.test_policy_opa_standin import OpaStandIn

# the Secrets these tests write are their user's alone, as kvgov requires
pytestmark = pytest.mark.usefixtures("private_umask")

opa_bindings = pytest.importorskip("opa_bindings", reason="opa-golib-python-bindings not installed")
web = pytest.importorskip("aiohttp.web")

ROOT = Path(__file__).resolve().parents[2]
AUTHZ_POLICY = ROOT / "deploy/kubernetes/overlays/production/opa-authz.rego"
#: a token as docs/deploy.md makes one (openssl rand -hex 32); a test value, no secret
TOKEN = "9f2c" * 16
#: OPA's runtime as its container has it (the env of Secret kvgov-opa-token)
RUNTIME = {"env": {"KVGOV_OPA_TOKEN": TOKEN}}
#: kvgov's decision request: POST /v1/data/<package>/<rule> (kvgov.policy.opa)
DECISION_PATH = "/v1/data/" + POLICY_PACKAGE.replace(".", "/") + "/" + DECISION_RULE

#: what the vLLM container could do on OPA's loopback address, none of it kvgov's
OTHER_REQUESTS = [
    ("GET", "/v1/data"),
    ("GET", "/v1/data/kvgov/config"),
    ("GET", "/v1/data/kvgov/config/tenants"),
    ("POST", "/v1/data"),
    ("POST", "/v1/data/kvgov/config"),
    ("POST", "/v1/data/kvgov/authz"),
    ("POST", "/v1/data/system/authz/allow"),
    ("GET", DECISION_PATH),
    ("POST", DECISION_PATH + "/"),
    ("POST", "/v1/data/kvgov/authz%2Fdecision"),
    ("PUT", "/v1/data/x"),
    ("PUT", "/v1/data/kvgov/config"),
    ("PATCH", "/v1/data/kvgov/config"),
    ("DELETE", "/v1/data/kvgov"),
    ("GET", "/v1/policies"),
    ("GET", "/v1/policies/kvgov/authz"),
    ("PUT", "/v1/policies/x"),
    ("DELETE", "/v1/policies/kvgov/authz"),
    ("GET", "/v1/query?q=data"),
    ("POST", "/v1/query"),
    ("POST", "/v1/compile"),
    ("GET", "/v1/config"),
    ("GET", "/v1/status"),
    ("POST", "/v0/data/kvgov/authz/decision"),
    ("POST", "/"),
    ("GET", "/metrics"),
    ("GET", "/health/live"),
]


def authz_input(method: str, target: str, identity: str | None = None) -> dict[str, Any]:
    """The input OPA's authorizer builds for a request (``server/authorizer.makeInput``): the
    path split on ``/`` after its leading one, each segment unescaped; ``identity`` only when
    token authentication found a bearer token."""
    path, _, query = target.partition("?")
    doc: dict[str, Any] = {
        "method": method.upper(),
        "path": [unquote(part) for part in path[1:].split("/")],
        "params": parse_qs(query),
        "headers": {"User-Agent": ["python"]},
    }
    if identity is not None:
        doc["identity"] = identity
        doc["headers"]["Authorization"] = [f"Bearer {identity}"]
    return doc


def authz_engine() -> Any:
    """The real OPA engine holding the shipped system.authz policy."""
    engine = opa_bindings.OpaEngine()
    engine.add_policy("opa-authz.rego", AUTHZ_POLICY.read_text(encoding="utf-8"))
    return engine


def allowed(engine: Any, doc: dict[str, Any], runtime: dict[str, Any] | None = None) -> bool:
    """``data.system.authz.allow`` as OPA's authorizer asks it (``opa.runtime()`` = OPA's)."""
    rt = json.dumps(RUNTIME if runtime is None else runtime)
    rows = engine.eval_query(f"allow := data.system.authz.allow with opa.runtime as {rt}", doc)
    assert len(rows) == 1, rows  # default false: always defined
    value = rows[0]["allow"]
    assert isinstance(value, bool)
    return value


@pytest.fixture(scope="module")
def engine() -> Any:
    return authz_engine()


@pytest.mark.parametrize(("method", "target"), [("POST", DECISION_PATH), *OTHER_REQUESTS])
def test_without_a_token_nothing_is_served(engine: Any, method: str, target: str) -> None:
    assert not allowed(engine, authz_input(method, target))


def test_the_probes_need_no_token(engine: Any) -> None:
    """The kubelet's probes (``/health``, ``/health?bundles``) carry no token."""
    assert allowed(engine, authz_input("GET", "/health"))
    assert allowed(engine, authz_input("GET", "/health?bundles"))
    assert not allowed(engine, authz_input("POST", "/health"))


@pytest.mark.parametrize(
    "wrong",
    [
        "",
        "x",
        TOKEN[:-1],
        TOKEN + "0",
        TOKEN.upper(),
        TOKEN[:32],
        "0" * len(TOKEN),
        f"Bearer {TOKEN}",
        f" {TOKEN}",
    ],
    ids=lambda _: "",  # the values are the test's token, altered: not in the test ids
)
def test_a_wrong_token_is_refused_on_kvgovs_decision(engine: Any, wrong: str) -> None:
    assert not allowed(engine, authz_input("POST", DECISION_PATH, wrong))


def test_kvgovs_token_admits_its_decision_and_nothing_else(engine: Any) -> None:
    assert allowed(engine, authz_input("POST", DECISION_PATH, TOKEN))
    for method, target in OTHER_REQUESTS:
        assert not allowed(engine, authz_input(method, target, TOKEN)), (method, target)


@pytest.mark.parametrize(
    "env",
    [{}, {"KVGOV_OPA_TOKEN": ""}, {"KVGOV_OPA_TOKEN": "short-token"}, {"OTHER": TOKEN}],
    ids=["unset", "empty", "short", "other-name"],
)
def test_an_unset_empty_or_short_configured_token_admits_no_one(
    engine: Any, env: dict[str, str]
) -> None:
    """The Secret not mounted (or holding a weak token): kvgov is refused too (it fails closed,
    its decisions deny) rather than OPA serving whoever sends the same empty or short value."""
    runtime = {"env": env}
    for identity in (None, "", env.get("KVGOV_OPA_TOKEN", ""), "short-token", TOKEN):
        doc = authz_input("POST", DECISION_PATH, identity)
        assert not allowed(engine, doc, runtime), (env, identity)


#: the token a rotation replaces TOKEN with (the Secret's key ``next``, then ``token``)
NEXT = "5b6a" * 16


def test_during_a_rotation_the_next_token_is_admitted_too(engine: Any) -> None:
    """Rotation: OPA reads its environment at start only, so the next token reaches every OPA
    first (the Secret's ``next``: ``KVGOV_OPA_TOKEN_NEXT``, a rolling restart), then kvgov (its
    file, no restart), and the old one is dropped last (``next`` removed, a restart). While
    both are set each admits kvgov's decision request, and nothing else; afterwards the old
    one admits nothing."""
    during = {"env": {"KVGOV_OPA_TOKEN": TOKEN, "KVGOV_OPA_TOKEN_NEXT": NEXT + "\n"}}
    for token in (TOKEN, NEXT):
        assert allowed(engine, authz_input("POST", DECISION_PATH, token), during)
        for method, target in OTHER_REQUESTS:
            assert not allowed(engine, authz_input(method, target, token), during), target
    for wrong in (None, "", NEXT[:-1], NEXT + "0", f"Bearer {NEXT}", TOKEN + NEXT):
        assert not allowed(engine, authz_input("POST", DECISION_PATH, wrong), during)
    after = {"env": {"KVGOV_OPA_TOKEN": NEXT}}  # next moved to token, pods restarted
    assert allowed(engine, authz_input("POST", DECISION_PATH, NEXT), after)
    assert not allowed(engine, authz_input("POST", DECISION_PATH, TOKEN), after)


@pytest.mark.parametrize(
    "env",
    [
        {"KVGOV_OPA_TOKEN": TOKEN, "KVGOV_OPA_TOKEN_NEXT": ""},
        {"KVGOV_OPA_TOKEN": TOKEN, "KVGOV_OPA_TOKEN_NEXT": "short-token"},
        {"KVGOV_OPA_TOKEN": TOKEN, "KVGOV_OPA_TOKEN_NEXT": " " * 40},
        {"KVGOV_OPA_TOKEN_NEXT": "short-token"},
        {"KVGOV_OPA_TOKEN": TOKEN, "KVGOV_OPA_TOKEN_PREVIOUS": NEXT},
    ],
    ids=["empty-next", "short-next", "blank-next", "short-next-alone", "other-name"],
)
def test_a_weak_next_token_or_another_variable_admits_no_one(
    engine: Any, env: dict[str, str]
) -> None:
    """Deny by default holds for the second variable too: an empty or short next token admits
    no one (not whoever sends the same empty or short value), and no other variable counts."""
    runtime = {"env": env}
    for identity in (None, "", " " * 40, "short-token", NEXT):
        assert not allowed(engine, authz_input("POST", DECISION_PATH, identity), runtime)
    if "KVGOV_OPA_TOKEN" in env:  # the token in force still admits kvgov
        assert allowed(engine, authz_input("POST", DECISION_PATH, TOKEN), runtime)


def test_the_configured_token_is_in_no_document(engine: Any) -> None:
    """The expected token is a local of the rule, not a document someone allowed to read
    ``data.system`` (a future, wider policy) could fetch."""
    rt = json.dumps({"env": {"KVGOV_OPA_TOKEN": TOKEN, "KVGOV_OPA_TOKEN_NEXT": NEXT}})
    rows = engine.eval_query(f"doc := data.system with opa.runtime as {rt}", {})
    assert TOKEN not in json.dumps(rows)
    assert NEXT not in json.dumps(rows)


# -- kvgov's client through OPA's authorizer ---------------------------------------------


def authorizer(engine: Any) -> Any:
    """OPA's ``--authentication=token --authorization=basic`` in front of the stand-in: the
    identity is the token of an ``Authorization: Bearer`` header; a request the policy does
    not allow is answered 401, as OPA answers it."""

    @web.middleware
    async def middleware(request: Any, handler: Any) -> Any:
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        identity = token if token and scheme.lower() == "bearer" else None
        doc = authz_input(request.method, request.raw_path, identity)
        if not allowed(engine, doc):
            body = {"code": "unauthorized", "message": "request rejected by administrative policy"}
            return web.json_response(body, status=401)
        return await handler(request)

    return middleware


@pytest.mark.parametrize("token", [TOKEN, "wrong-" + TOKEN, None], ids=["right", "wrong", "none"])
async def test_kvgov_asks_opa_with_the_token_of_its_file(
    engine: Any, tmp_path: Path, token: str | None
) -> None:
    """kvgov built from its settings (``policy.opa_token_file``, as the overlay mounts it)
    gets its decisions through the authorizer with the right token; with another one, or none,
    OPA answers 401 and kvgov denies (``opa_bad_status:401``)."""
    policy: dict[str, Any] = {"engine": "opa", "opa_timeout_s": 5.0}
    if token is not None:
        token_file = tmp_path / "token"
        token_file.write_text(token + "\n")  # as `kubectl create secret --from-file` may hold it
        policy["opa_token_file"] = token_file
    opa = OpaStandIn()
    opa.load(load_bundle())
    opa.middlewares.append(authorizer(engine))
    await opa.start()
    try:
        policy["opa_url"] = opa.url
        kvgov = build_inner_engine(Settings(data_dir=tmp_path / "d", policy=policy))
        try:
            decision = await kvgov.decide(ALLOWED)
        finally:
            await kvgov.aclose()
    finally:
        await opa.stop()
    if token == TOKEN:
        assert decision.allowed, decision.reasons
        assert opa.requests == [("POST", DECISION_PATH)]
    else:
        assert not decision.allowed
        assert decision.reasons == ("opa_bad_status:401",)
        assert opa.requests == []  # refused before OPA's handler

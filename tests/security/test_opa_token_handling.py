"""OPA's bearer token, handled so that it never leaves kvgov and OPA's two readers (review r7).

The production OPA admits only kvgov's decision request with the token of Secret
``kvgov-opa-token`` (``opa-authz.rego``); whoever else holds it may ask OPA any decision from
inside the pod. Each test failed before its fix:

* F1: ``kvgov policy test`` (engine opa) printed OPA's bearer token: the production OPA answers
  every test rule 401, and each failure was printed as ``OPA: {exc!r}``, whose aiohttp
  ``RequestInfo`` holds the ``Authorization`` header (48 times in one run).
* F2: ``kvgov policy push --url URL`` sent the production token (``policy.opa_token_file``) to
  whatever URL it named, plain http across the network included.
* F3: a Secret whose value ends in a newline (``--from-file`` of a file written by ``echo``):
  kvgov stripped its file, OPA's ``KVGOV_OPA_TOKEN`` kept the newline, and every decision was
  refused while both sides held "the same" Secret.
* F4: production started with tokens the shipped policy never admits (blank, under 32
  characters), then denied every operation.

The token here is a test value, never printed: assertions report counts, not output.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kvgov.cli.main import build_app
from kvgov.config import Settings

opa_bindings = pytest.importorskip("opa_bindings", reason="opa-golib-python-bindings not installed")

from tests.security.test_opa_api_authz import (  # noqa: E402
    DECISION_PATH,
    allowed,
    authz_engine,
    authz_input,
)

# the Secrets these tests write are their user's alone, as kvgov requires
pytestmark = pytest.mark.usefixtures("private_umask")

#: a test value (openssl rand -hex 32 shaped), no secret
TOKEN = "7e1d" * 16


class _Opa:
    """OPA with ``--authentication=token --authorization=basic`` and the shipped
    ``opa-authz.rego``: a request the policy refuses is a 401, as OPA answers it; an allowed
    one is a 200 ``{}`` (undefined). Records the Authorization headers it was sent."""

    def __init__(self, runtime_env: dict[str, str] | None = None) -> None:
        self.engine = authz_engine()
        self.runtime = {
            "env": runtime_env if runtime_env is not None else {"KVGOV_OPA_TOKEN": TOKEN}
        }
        self.authorizations: list[str] = []
        self.lock = threading.Lock()


@pytest.fixture
def opa() -> Iterator[tuple[_Opa, str]]:
    state = _Opa()

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            header = self.headers.get("Authorization", "")
            scheme, _, token = header.partition(" ")
            identity = token if token and scheme.lower() == "bearer" else None
            with state.lock:
                state.authorizations.append(header)
                ok = allowed(
                    state.engine, authz_input(self.command, self.path, identity), state.runtime
                )
            body = (
                b"{}"
                if ok
                else json.dumps(
                    {"code": "unauthorized", "message": "request rejected by administrative policy"}
                ).encode()
            )
            self.send_response(200 if ok else 401)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = do_PUT = _answer  # noqa: N815

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield state, f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def _env(tmp_path: Path, opa_url: str) -> dict[str, str]:
    token_file = tmp_path / "opa-token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o400)
    return {
        "KVGOV_DATA_DIR": str(tmp_path / "data"),
        "KVGOV_POLICY__ENGINE": "opa",
        "KVGOV_POLICY__OPA_URL": opa_url,
        "KVGOV_POLICY__OPA_TOKEN_FILE": str(token_file),
    }


def test_policy_test_against_the_locked_opa_does_not_print_the_token(
    opa: tuple[_Opa, str], tmp_path: Path
) -> None:
    """``kubectl exec ... kvgov policy test`` in the production pod (its settings already point
    at the sidecar OPA with the token file): every test rule is refused by opa-authz.rego,
    and each FAIL line must not carry the bearer token into the terminal or a CI log."""
    _, url = opa
    run = CliRunner().invoke(build_app(), ["policy", "test"], env=_env(tmp_path, url))
    assert run.exit_code == 1  # the locked OPA refuses the test rules, as docs/policy.md says
    assert "FAIL" in run.output
    leaks = run.output.count(TOKEN)
    assert leaks == 0, f"OPA's bearer token appears {leaks} times in `kvgov policy test` output"


def test_policy_push_to_another_url_does_not_send_the_production_token(
    opa: tuple[_Opa, str], tmp_path: Path
) -> None:
    """``kvgov policy push --url http://my-opa:8181`` (docs/policy.md: "use them against an
    OPA of your own") run where the production settings are: the token of Secret
    kvgov-opa-token must go to policy.opa_url only, not to an arbitrary, possibly cleartext,
    remote URL whose owner then holds the key to every pod's OPA."""
    state, other = opa
    env = _env(tmp_path, "http://127.0.0.1:1")  # policy.opa_url: the pod's own OPA
    CliRunner().invoke(build_app(), ["policy", "push", "--url", other], env=env)
    assert state.authorizations, "the push reached the other OPA"
    sent = sum(TOKEN in header for header in state.authorizations)
    assert sent == 0, f"the production OPA token was sent to --url in {sent} requests"


def test_a_secret_with_a_trailing_newline_still_admits_kvgov(tmp_path: Path) -> None:
    """One Secret, two readers: kvgov strips ``policy.opa_token_file`` (settings.opa_token),
    OPA's env keeps the newline (opa.runtime().env.KVGOV_OPA_TOKEN); the shipped policy then
    refuses kvgov's own decision request."""
    secret_value = TOKEN + "\n"  # `kubectl create secret generic --from-file=token=./token`
    token_file = tmp_path / "token"
    token_file.write_text(secret_value)
    kvgov = Settings(
        data_dir=tmp_path / "d", policy={"engine": "opa", "opa_token_file": token_file}
    ).opa_token
    assert kvgov == TOKEN  # kvgov's side strips it
    runtime = {"env": {"KVGOV_OPA_TOKEN": secret_value}}  # the opa container's env
    admitted = allowed(authz_engine(), authz_input("POST", DECISION_PATH, kvgov), runtime)
    assert admitted, "kvgov's decision request is refused: every operation denied"


def test_production_refuses_an_opa_token_the_shipped_policy_never_admits(
    tmp_path: Path, prod_db: Any
) -> None:
    """The production guard checks only that some token is set; opa-authz.rego admits none
    shorter than 32 characters (and none with whitespace around it). A 'short' or blank
    token passes start-up, then every decision is opa_bad_status:401: a silent, total deny.
    Start-up should say so, as it does for a missing token."""
    from pydantic import ValidationError

    from tests.security import doors
    from tests.security.test_production_guards import _with

    base = doors.settings(tmp_path, prod_db)
    accepted = []
    for weak in ("short-token", "   ", TOKEN[:31]):
        try:
            _with(
                base,
                policy={"engine": "opa", "opa_token": weak, "opa_url": "unix:///run/opa/opa.sock"},
            )
        except ValidationError:
            continue
        accepted.append(len(weak))
    assert not accepted, f"production started with OPA tokens of lengths {accepted}"


@pytest.mark.parametrize("weak", ["short-token\n", "x" * 31])
def test_production_refuses_a_token_file_the_shipped_policy_never_admits(
    tmp_path: Path, weak: str
) -> None:
    """The file is read when the policy engine is built, at start: a weak token stops it."""
    from kvgov.errors import ConfigError

    token_file = tmp_path / "token"
    token_file.write_text(weak)
    policy = {"engine": "opa", "opa_token_file": token_file}
    # the production guards want a whole production deployment; only the file's check is read
    prod = Settings(data_dir=tmp_path / "d", policy=policy).model_copy(
        update={"environment": "production"}
    )
    with pytest.raises(ConfigError, match="not one the production OPA admits") as err:
        _ = prod.opa_token
    assert weak.strip() not in str(err.value)
    assert Settings(data_dir=tmp_path / "d", policy=policy).opa_token == weak.strip()  # dev


# -- an OPA that serves everyone stops a production start --------------------------------
# The guard above proves kvgov holds a token, not that the OPA it asks checks one: an OPA
# started without --authentication=token (an overlay of one's own) ignores it and serves the
# pod's every container. A production sidecar asks it, tokenless, for its policies first.


async def _standin(authz: bool, *, unix: bool = False) -> Any:
    from tests.integration.test_policy_opa_standin import OpaStandIn
    from tests.security.test_opa_api_authz import authorizer

    opa = OpaStandIn(unix=unix)
    if authz:  # OPA's authorizer with the shipped opa-authz.rego
        opa.middlewares.append(authorizer(authz_engine()))
    await opa.start()
    return opa


async def test_the_open_probe_tells_an_open_opa_from_a_locked_one() -> None:
    from kvgov.policy.opa import answers_without_token
    from tests.integration.test_policy_opa_standin import closed_port_url

    for unix in (False, True):  # OPA on loopback TCP (development) or its Unix socket
        for authz, expected in ((False, True), (True, False)):
            opa = await _standin(authz, unix=unix)
            try:
                assert await answers_without_token(opa.url, 5.0) is expected
            finally:
                await opa.stop()
    assert await answers_without_token(closed_port_url(), 1.0) is None


@pytest.mark.postgres
@pytest.mark.parametrize("authz", [False, True], ids=["open-opa", "locked-opa"])
async def test_a_production_sidecar_refuses_an_opa_that_serves_everyone(
    tmp_path: Path, prod_db: Any, authz: bool
) -> None:
    from kvgov.errors import ConfigError
    from kvgov.proxy.app import build_sidecar
    from tests.security import doors
    from tests.security.test_production_guards import _with

    opa = await _standin(authz, unix=True)  # as production runs it: loopback TCP is refused
    try:
        token_file = tmp_path / "opa-token"
        token_file.write_text(TOKEN)
        settings = _with(
            doors.settings(tmp_path, prod_db),
            policy={"engine": "opa", "opa_url": opa.url, "opa_token_file": token_file},
        )
        if not authz:
            with pytest.raises(ConfigError, match="decision request without a token"):
                await build_sidecar(settings)
            return
        sidecar = await build_sidecar(settings)
        await sidecar.start()
        await sidecar.stop()
    finally:
        await opa.stop()

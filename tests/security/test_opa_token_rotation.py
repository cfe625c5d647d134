"""OPA's bearer token is rotated under running sidecars, not by restarting them (review: token
rotation is an outage).

Attack (on availability, and on revocation): kvgov read ``policy.opa_token_file`` once, at
start. Rotating Secret ``kvgov-opa-token`` (the kubelet swaps the ``..data`` symlink of every
mounted copy in place) left each running sidecar sending the old token: once OPA held the new
one (its container restarted: OOM, liveness, a new Secret in its environment), OPA answered
401 and every decision, so every put and get, was denied until the kvgov container restarted
too; and a sidecar kept sending a token that its operator had replaced, until its restart.

Now the sidecar looks at the file (a ``stat``: inode, size, mtime of the resolved path) at most
every ``policy.opa_token_reload_interval_s``, at once when OPA answers 401 or 403, and on every
decision while the file's content is refused; a changed file is read with the checks of start
(trimmed, not empty, one printable word; in production one the shipped authz policy admits).
On a 401/403 a decision is asked again, once, with the new token when it changed. A file that
changed to something unusable sends nothing (not the old token: ``opa_token_invalid``) and is
logged once per change, naming the file and never the token.

Real components: kvgov's OPA client (built from its settings, as the sidecar builds it), real
files laid out as the kubelet lays out a Secret volume (``token -> ..data/token``, ``..data``
swapped by one rename), the OPA STAND-IN (``tests/integration/test_policy_opa_standin.py``:
OPA's REST API in aiohttp, evaluating the kvgov bundle with the real OPA engine) with OPA's
authorizer in front of it evaluating the shipped ``opa-authz.rego`` (real OPA engine, the
environment of OPA's container switchable). No OPA server can run here.

The tokens are test values, never printed: assertions report counts, not values.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

from kvgov.config import Settings
from kvgov.logging import JsonFormatter
from kvgov.policy.bundle import load_bundle
from kvgov.policy.factory import build_inner_engine
from kvgov.policy.interfaces import PolicyEngine
from tests.integration.test_policy_opa_rest import ALLOWED

opa_bindings = pytest.importorskip("opa_bindings", reason="opa-golib-python-bindings not installed")
web = pytest.importorskip("aiohttp.web")

from tests.integration.test_policy_opa_standin import OpaStandIn  # noqa: E402
from tests.security.test_opa_api_authz import (  # noqa: E402
    allowed,
    authz_engine,
    authz_input,
)

#: the token before and after the rotation (openssl rand -hex 32 shaped); test values
OLD = "a1b2" * 16
NEW = "c3d4" * 16


class SecretVolume:
    """A Secret volume as the kubelet writes it (``pkg/volume/util/atomic_writer.go``): each
    key a symlink ``key -> ..data/key``; ``..data`` a symlink to a timestamped directory; an
    update writes a new directory, points ``..data_tmp`` at it, renames that over ``..data``
    (one atomic step) and removes the old directory."""

    def __init__(self, root: Path, token: str) -> None:
        self.root = root
        self.generation = 0
        root.mkdir()
        self.write(token)
        (root / "token").symlink_to("..data/token")

    @property
    def path(self) -> Path:
        return self.root / "token"

    def write(self, content: str | None) -> None:
        """The Secret's key holds ``content`` now (None: the key was removed from it)."""
        self.generation += 1
        new = self.root / f"..2025_01_01_00_00_{self.generation:02d}.{self.generation}"
        new.mkdir()
        if content is not None:
            (new / "token").write_text(content)
            (new / "token").chmod(0o440)
        old = (self.root / "..data").readlink() if (self.root / "..data").is_symlink() else None
        (self.root / "..data_tmp").symlink_to(new.name)
        (self.root / "..data_tmp").replace(self.root / "..data")  # rename(2): one step
        if old is not None:
            shutil.rmtree(self.root / old)


@dataclass
class LockedOpa:
    """OPA with ``--authentication=token --authorization=basic`` and the shipped authz policy:
    the stand-in behind OPA's authorizer, whose ``opa.runtime().env`` (OPA's container
    environment) a test switches. ``seen``: the bearer token of every request, in order."""

    env: dict[str, str]
    status: int = 401
    seen: list[str | None] = field(default_factory=list)
    server: OpaStandIn = field(default_factory=OpaStandIn)

    def middleware(self) -> Any:
        engine = authz_engine()

        @web.middleware
        async def authorize(request: Any, handler: Any) -> Any:
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            identity = token if token and scheme.lower() == "bearer" else None
            self.seen.append(identity)
            doc = authz_input(request.method, request.raw_path, identity)
            if not allowed(engine, doc, {"env": dict(self.env)}):
                body = {"code": "unauthorized", "message": "request rejected by policy"}
                return web.json_response(body, status=self.status)
            return await handler(request)

        return authorize

    def count(self, token: str, since: int = 0) -> int:
        return sum(1 for t in self.seen[since:] if t == token)


@pytest.fixture
async def opa() -> AsyncIterator[LockedOpa]:
    locked = LockedOpa(env={"KVGOV_OPA_TOKEN": OLD})
    locked.server.load(load_bundle())
    locked.server.middlewares.append(locked.middleware())
    await locked.server.start()
    try:
        yield locked
    finally:
        await locked.server.stop()


def kvgov_engine(
    opa: LockedOpa, secret: SecretVolume, *, production: bool = False, **policy: Any
) -> PolicyEngine:
    """kvgov's policy engine as the sidecar builds it from its settings (the token from
    ``policy.opa_token_file``, read at start)."""
    settings = Settings(
        data_dir=secret.root.parent / "data",
        policy={
            "engine": "opa",
            "opa_url": opa.server.url,
            "opa_timeout_s": 5.0,
            "opa_token_file": secret.path,
            **policy,
        },
    )
    if production:  # only the token file's checks are under test, not the whole deployment
        data = resources.files("kvgov.policy").joinpath("rego", "data.json")
        data_file = secret.root.parent / "data.json"
        data_file.write_text(data.read_text("utf-8"))
        settings = settings.model_copy(
            update={
                "environment": "production",
                "policy": settings.policy.model_copy(update={"data_file": data_file}),
            }
        )
    return build_inner_engine(settings)


@pytest.mark.parametrize("status", [401, 403])
async def test_a_rotated_token_is_taken_without_a_restart(
    opa: LockedOpa, tmp_path: Path, status: int
) -> None:
    """The Secret is rotated and OPA holds the new token (its container restarted on it):
    OPA refuses the old one, and the running sidecar's next decision must go through with the
    new one, read from the file the kubelet just swapped, and never send the old one again."""
    opa.status = status
    secret = SecretVolume(tmp_path / "opa-token", OLD)
    kvgov = kvgov_engine(opa, secret)
    try:
        first = await kvgov.decide(ALLOWED)
        assert first.allowed, first.reasons
        secret.write(NEW + "\n")  # kubectl create secret --from-file: a trailing newline
        opa.env = {"KVGOV_OPA_TOKEN": NEW}
        rotated = len(opa.seen)
        after = [await kvgov.decide(ALLOWED) for _ in range(3)]
    finally:
        await kvgov.aclose()
    assert [d.reasons for d in after if not d.allowed] == [], "denied after the rotation"
    # the first decision after the swap still carried the old token (refused), then the new:
    # one retry, and the old token never again
    assert opa.count(OLD, rotated) == 1, "requests with the old token after the rotation"
    assert opa.count(NEW, rotated) == 3


async def test_opa_refusing_an_unchanged_token_is_denied_without_a_retry(
    opa: LockedOpa, tmp_path: Path
) -> None:
    """OPA took a new token that kvgov's file does not hold (yet): the decision fails closed
    as before (``opa_bad_status:401``), after one request: the file is looked at, not asked
    again with the same token."""
    secret = SecretVolume(tmp_path / "opa-token", OLD)
    kvgov = kvgov_engine(opa, secret)
    opa.env = {"KVGOV_OPA_TOKEN": NEW}
    try:
        decision = await kvgov.decide(ALLOWED)
    finally:
        await kvgov.aclose()
    assert not decision.allowed and decision.reasons == ("opa_bad_status:401",)
    assert len(opa.seen) == 1


#: how often the sidecar looks at its token file in the tests below (seconds)
EVERY_S = 0.05


async def test_the_old_token_is_not_sent_once_the_rotation_is_seen(
    opa: LockedOpa, tmp_path: Path
) -> None:
    """The rotation of docs/deploy.md: every OPA admits the old and the next token (the
    Secret's ``next``, a rolling restart); the Secret's ``token`` becomes the next one. The
    running sidecar sends the new token from its next look at the file, with no 401 to prompt
    it, never the old one after that, and keeps working when OPA drops the old one."""
    opa.env = {"KVGOV_OPA_TOKEN": OLD, "KVGOV_OPA_TOKEN_NEXT": NEW}
    secret = SecretVolume(tmp_path / "opa-token", OLD)
    kvgov = kvgov_engine(opa, secret, opa_token_reload_interval_s=EVERY_S)
    try:
        assert (await kvgov.decide(ALLOWED)).allowed
        secret.write(NEW)
        await asyncio.sleep(EVERY_S * 2)
        seen = len(opa.seen)
        during = [await kvgov.decide(ALLOWED) for _ in range(3)]
        opa.env = {"KVGOV_OPA_TOKEN": NEW}  # `next` dropped, OPA restarted: the old refused
        after = await kvgov.decide(ALLOWED)
    finally:
        await kvgov.aclose()
    assert [d.reasons for d in [*during, after] if not d.allowed] == []
    assert opa.count(OLD, seen) == 0, "the old token was sent after the file changed"
    assert opa.count(NEW, seen) == 4


async def test_a_burst_of_refused_decisions_reads_the_file_once_and_all_go_through(
    opa: LockedOpa, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Decisions in flight when OPA takes the new token: each is refused once and asked again
    with the new token; the file is read once for all of them."""
    secret = SecretVolume(tmp_path / "opa-token", OLD)
    kvgov = kvgov_engine(opa, secret)
    try:
        assert (await kvgov.decide(ALLOWED)).allowed
        secret.write(NEW)
        opa.env = {"KVGOV_OPA_TOKEN": NEW}
        with caplog.at_level(logging.INFO, logger="kvgov.policy"):
            burst = await asyncio.gather(*(kvgov.decide(ALLOWED) for _ in range(20)))
        since = len(opa.seen)
        assert (await kvgov.decide(ALLOWED)).allowed
    finally:
        await kvgov.aclose()
    assert [d.reasons for d in burst if not d.allowed] == []
    reloads = [r for r in caplog.records if r.getMessage() == "policy.opa_token_reloaded"]
    assert len(reloads) == 1
    assert opa.count(OLD, since) == 0 and opa.count(NEW, since) == 1


@pytest.mark.parametrize(
    ("content", "production"),
    [
        ("", False),
        ("\n", False),
        (None, False),
        ("a" * 20 + " " + "b" * 20, False),
        ("x" * 31, True),
    ],
    ids=["empty", "newline-only", "key-removed", "two-words", "short-in-production"],
)
async def test_an_unusable_rotated_file_fails_closed_and_never_logs_the_token(
    opa: LockedOpa,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    content: str | None,
    production: bool,
) -> None:
    """The Secret rotated to something kvgov refuses at start (empty, its key gone, not one
    word; in production, shorter than the shipped authz policy admits) while OPA took a new
    token: every decision denies, the first because OPA refused the old token, the next ones
    with nothing sent (``opa_token_invalid``: not the old token); one error names the file
    and what is wrong; no log line carries a token; fixing the file restores decisions."""
    secret = SecretVolume(tmp_path / "opa-token", OLD)
    kvgov = kvgov_engine(opa, secret, production=production)
    with caplog.at_level(logging.DEBUG, logger="kvgov"):
        try:
            assert (await kvgov.decide(ALLOWED)).allowed
            secret.write(content)
            opa.env = {"KVGOV_OPA_TOKEN": NEW}  # OPA restarted on the new Secret
            rotated = len(opa.seen)
            denied = [await kvgov.decide(ALLOWED) for _ in range(3)]
            secret.write(NEW)  # the operator fixes the Secret
            fixed = await kvgov.decide(ALLOWED)
        finally:
            await kvgov.aclose()
    assert denied[0].reasons == ("opa_bad_status:401",)
    assert [d.reasons for d in denied[1:]] == [("opa_token_invalid",)] * 2
    assert opa.count(OLD, rotated) == 1, "the old token was sent after the refused change"
    assert opa.seen[rotated + 1 :] == [NEW], "requests while the file was refused"
    assert fixed.allowed, fixed.reasons
    refused = [r for r in caplog.records if r.getMessage() == "policy.opa_token_refused"]
    assert len(refused) == 1, "one error per change of the file"
    assert refused[0].levelno == logging.ERROR
    error = str(refused[0].__dict__["error"])
    assert error.startswith(("policy.opa_token_file", "cannot read policy.opa_token_file"))
    assert str(secret.path) in error
    lines = [JsonFormatter().format(r) for r in caplog.records]
    values = [OLD, NEW] + ([content.strip()] if content and content.strip() else [])
    leaks = sum(line.count(value) for line in lines for value in values)
    assert leaks == 0, f"a token appears {leaks} times in {len(lines)} log lines"

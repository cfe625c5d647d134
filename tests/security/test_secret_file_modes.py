"""Files kvgov takes an identity, a trust or a credential from are refused when someone other
than their owner (the sidecar's user, or root) could write them, and, for the secret ones,
when others could read them.

Attack (review r16, "Notes"; review r15, "Smaller observations"): ``dataplane.engine_tokens_file``,
``database.url_file``, ``policy.opa_token_file`` and ``ledger.trusted_keys_file`` were read with a
plain ``read_text``, and the signing key's public half (the key a receipt is checked against:
``ApiContext.trusted_receipt_keys``, ``kvgov purge verify-receipt``) with a plain ``read_bytes``,
unlike the key files (:func:`kvgov.privatefs.read_private_file`). Whoever can write such a file
decides what it says: a writable engine-tokens file admits any engine under any engine id, a
writable trusted-keys (or public-key) file makes a chain or a receipt they signed verify, a
writable URL file points the sidecar at their database. Now each is read with
:func:`kvgov.privatefs.read_guarded_file`, at start and on every reload: refused (a
``ConfigError`` naming the file and its mode, never its content) when group or others may write
it or it belongs to a uid other than the process's own or root's; the secret ones also when
others may read them. A running sidecar that meets such a file on reload keeps the tokens in
force and logs. The shipped manifests' Secret and ConfigMap modes pass.

Dashboard sessions (review r15): every sign-in of a valid auditor token added a
``dashboard_sessions`` row, without bound. Now a token keeps at most
:data:`kvgov.db.sessions.MAX_SESSIONS_PER_TOKEN`: a sign-in past it ends the token's oldest.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from kvgov.config import load_settings
from kvgov.errors import ConfigError

# the Secrets these tests write are their user's alone, as kvgov requires
pytestmark = pytest.mark.usefixtures("private_umask")

SECRET = "s3cret-t0ken-value-that-must-never-show"
OPA_TOKEN = "0123456789abcdef" * 4
KEY = "ed25519:" + "A" * 43 + "="


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("KVGOV_") and not name.startswith("KVGOV_TEST_"):
            monkeypatch.delenv(name)


def _public_pem() -> str:
    return (
        Ed25519PrivateKey.generate()
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        .decode()
    )


def _read_engine_tokens(path: Path, tmp: Path) -> object:
    return load_settings(data_dir=tmp, dataplane={"engine_tokens_file": path}).engine_tokens


def _read_url(path: Path, tmp: Path) -> object:
    return load_settings(data_dir=tmp, database={"url_file": path}).database_url


def _read_migration_url(path: Path, tmp: Path) -> object:
    return load_settings(data_dir=tmp, database={"migration_url_file": path}).migration_database_url


def _read_redis_url(path: Path, tmp: Path) -> object:
    return load_settings(data_dir=tmp, tiers={"redis_url_file": path}).redis_url


def _read_opa_token(path: Path, tmp: Path) -> object:
    return load_settings(data_dir=tmp, policy={"opa_token_file": path}).opa_token


def _read_trusted_keys(path: Path, tmp: Path) -> object:
    from kvgov.ledger.trust import trusted_keys

    return trusted_keys(load_settings(data_dir=tmp, ledger={"trusted_keys_file": path}))


def _read_public_key(path: Path, tmp: Path) -> object:
    from kvgov.ledger.chain import load_public_key

    return load_public_key(path)


#: setting -> (how start-up reads it, a content it accepts, whether it holds a secret)
FILES: dict[str, tuple[Callable[[Path, Path], object], str, bool]] = {
    "dataplane.engine_tokens_file": (_read_engine_tokens, json.dumps({SECRET: "vllm-0"}), True),
    "database.url_file": (_read_url, f"postgresql+psycopg://kvgov:{SECRET}@db/kvgov", True),
    "database.migration_url_file": (
        _read_migration_url,
        f"postgresql+psycopg://owner:{SECRET}@db/kvgov",
        True,
    ),
    "tiers.redis_url_file": (_read_redis_url, f"redis://:{SECRET}@redis:6379/0", True),
    "policy.opa_token_file": (_read_opa_token, OPA_TOKEN, True),
    "ledger.trusted_keys_file": (_read_trusted_keys, f"# the fleet\n{KEY}\n", False),
    "a receipt's public key (load_public_key)": (_read_public_key, _public_pem(), False),
}
#: what the brief names first: an engine, a chain and a database chosen by whoever writes them
CORE = ["dataplane.engine_tokens_file", "ledger.trusted_keys_file", "database.url_file"]


def _file(tmp_path: Path, setting: str, mode: int) -> Path:
    _, content, _ = FILES[setting]
    path = tmp_path / "mounted"
    path.write_text(content)
    path.chmod(mode)
    return path


def _refused(setting: str, path: Path, tmp_path: Path) -> ConfigError | None:
    read, _, _ = FILES[setting]
    try:
        read(path, tmp_path)
    except ConfigError as exc:
        return exc
    return None


@pytest.mark.parametrize("setting", list(FILES))
@pytest.mark.parametrize(("mode", "who"), [(0o666, "others"), (0o620, "its group")])
def test_a_file_others_may_write_is_refused_at_start_naming_its_mode(
    tmp_path: Path, setting: str, mode: int, who: str
) -> None:
    path = _file(tmp_path, setting, mode)
    error = _refused(setting, path, tmp_path)
    assert error is not None, f"{setting} at mode {mode:04o} was read and trusted"
    text = error.diagnostics()
    assert str(path) in text and f"{mode:04o}" in text and who in text, text
    assert SECRET not in text and OPA_TOKEN not in text and KEY not in text


@pytest.mark.parametrize("setting", CORE)
def test_world_writable_core_files_are_refused(tmp_path: Path, setting: str) -> None:
    """The brief's three first: a world-writable engine tokens, trusted keys or URL file."""
    error = _refused(setting, _file(tmp_path, setting, 0o666), tmp_path)
    assert error is not None, f"a world-writable {setting} was read and trusted"
    assert "mode 0666" in error.message, error.message


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
@pytest.mark.parametrize("setting", list(FILES))
def test_a_file_of_another_user_is_refused(tmp_path: Path, setting: str) -> None:
    path = _file(tmp_path, setting, 0o400)
    os.chown(path, 4242, -1)
    error = _refused(setting, path, tmp_path)
    assert error is not None, f"{setting} owned by uid 4242 was read and trusted"
    assert "uid 4242" in error.message, error.message


@pytest.mark.parametrize("setting", list(FILES))
def test_a_secret_others_may_read_is_refused_a_public_one_is_not(
    tmp_path: Path, setting: str
) -> None:
    _, _, secret = FILES[setting]
    path = _file(tmp_path, setting, 0o644)
    error = _refused(setting, path, tmp_path)
    if secret:
        assert error is not None, f"{setting} readable by others (0644) was read"
        assert "readable by others" in error.message and "0644" in error.message
    else:
        assert error is None, error


@pytest.mark.parametrize("setting", list(FILES))
@pytest.mark.parametrize("mode", [0o400, 0o440, 0o600, 0o640])
def test_the_owners_file_readable_by_its_group_is_taken(
    tmp_path: Path, setting: str, mode: int
) -> None:
    assert _refused(setting, _file(tmp_path, setting, mode), tmp_path) is None


def _projected(tmp_path: Path, setting: str, mode: int) -> Path:
    """A Secret or ConfigMap volume as the kubelet writes it: ``<name> -> ..data/<name>``,
    ``..data -> ..<timestamp>``, the file in the timestamped directory (the links 0777)."""
    _, content, _ = FILES[setting]
    volume = tmp_path / "volume"
    stamped = volume / "..2026_01_01_00_00_00.000000001"
    stamped.mkdir(parents=True)
    (stamped / "file").write_text(content)
    (stamped / "file").chmod(mode)
    (volume / "..data").symlink_to(stamped.name)
    (volume / "file").symlink_to("..data/file")
    return volume / "file"


@pytest.mark.parametrize("setting", list(FILES))
def test_a_kubernetes_volumes_links_are_followed_and_what_they_reach_is_checked(
    tmp_path: Path, setting: str
) -> None:
    assert _refused(setting, _projected(tmp_path / "ok", setting, 0o440), tmp_path) is None
    error = _refused(setting, _projected(tmp_path / "bad", setting, 0o664), tmp_path)
    assert error is not None and "0664" in error.message, error


def test_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "engine-tokens.json"
    os.mkfifo(fifo, 0o600)
    error = _refused("dataplane.engine_tokens_file", fifo, tmp_path)
    assert error is not None and "not a regular file" in error.message


# -- the shipped manifests' modes pass -----------------------------------------------------

#: the settings that name such files, and whether each holds a secret
MANIFEST_FILES = {
    "KVGOV_DATAPLANE__ENGINE_TOKENS_FILE": True,
    "KVGOV_DATABASE__URL_FILE": True,
    "KVGOV_DATABASE__MIGRATION_URL_FILE": True,
    "KVGOV_TIERS__REDIS_URL_FILE": True,
    "KVGOV_POLICY__OPA_TOKEN_FILE": True,
    "KVGOV_LEDGER__TRUSTED_KEYS_FILE": False,
}
#: the kubelet's mode of a Secret's or ConfigMap's file when neither the item nor the volume
#: names one (``SecretVolumeSourceDefaultMode``, ``ConfigMapVolumeSourceDefaultMode``)
KUBELET_DEFAULT_MODE = 0o644


def _kubelet_mode(volume: dict[str, Any], path: str, pod: dict[str, Any]) -> int:
    """The mode the kubelet gives the file at ``path`` in a Secret or ConfigMap volume: the
    item's ``mode``, else the volume's ``defaultMode``, else 0644; with the pod's ``fsGroup``,
    ``SetVolumeOwnership`` adds group read (0440: these volumes are read-only)."""
    source = volume.get("secret") or volume.get("configMap")
    assert source is not None, f"volume {volume['name']} is neither a Secret nor a ConfigMap"
    mode = next(
        (i["mode"] for i in source.get("items", []) if i["path"] == path and "mode" in i),
        source.get("defaultMode", KUBELET_DEFAULT_MODE),
    )
    if pod.get("securityContext", {}).get("fsGroup") is not None:
        mode |= 0o440
    return int(mode)


@pytest.mark.parametrize("overlay", ["development", "production"])
def test_the_shipped_manifests_modes_pass(overlay: str) -> None:
    from kvgov.privatefs import guarded_problem
    from tests.integration.test_deploy_manifests import containers, one, render
    from tests.security.test_deploy_doors import container_env

    docs = render(overlay)
    checked: list[str] = []
    problems: list[str] = []
    for kind, name, container in (
        ("Deployment", "kvgov-inference", "kvgov"),
        ("Job", "kvgov-migrate", "migrate"),
    ):
        pod = one(docs, kind, name)["spec"]["template"]["spec"]
        c = containers(pod)[container]
        env = container_env(docs, {**pod, "enableServiceLinks": False}, c)
        volumes = {v["name"]: v for v in pod["volumes"]}
        for setting, secret in MANIFEST_FILES.items():
            if not env.get(setting):
                continue
            file = Path(env[setting])
            mounts = [m for m in c["volumeMounts"] if file.parent == Path(m["mountPath"])]
            if not mounts:  # the Job's ConfigMap names the sidecar's files it never reads
                assert container != "kvgov", f"{setting} {file} is not mounted"
                continue
            (mount,) = mounts
            mode = _kubelet_mode(volumes[mount["name"]], file.name, pod)
            # the kubelet's files are root's; the container runs as the pod's user
            problem = guarded_problem(stat.S_IFREG | mode, 0, secret=secret)
            checked.append(f"{kind}/{name} {setting} {mode:04o}")
            if problem is not None:
                problems.append(f"{kind}/{name} {setting}: {problem}")
    assert not problems, problems
    assert any("ENGINE_TOKENS_FILE" in c for c in checked), checked
    assert any("DATABASE__URL_FILE" in c for c in checked), checked
    if overlay == "production":
        assert any("OPA_TOKEN_FILE" in c for c in checked), checked


def test_a_secret_volume_without_a_default_mode_would_be_refused() -> None:
    """What an operator's own manifest gets without ``defaultMode``: 0644, refused for a
    secret (docs/deploy.md says to set 0440), taken for a ConfigMap of public keys."""
    from kvgov.privatefs import guarded_problem

    pod = {"securityContext": {"fsGroup": 10001}}
    mode = _kubelet_mode({"name": "v", "secret": {"secretName": "s"}}, "f", pod)
    assert guarded_problem(stat.S_IFREG | mode, 0, secret=True) is not None
    assert guarded_problem(stat.S_IFREG | mode, 0, secret=False) is None


# -- a running sidecar's reload ----------------------------------------------------------


@pytest.mark.postgres
async def test_a_token_file_made_world_writable_after_start_is_refused_on_reload(
    tmp_path: Path, prod_db: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The sidecar started on a sound file; the file is made world-writable and someone writes
    their own token into it: the reload refuses it (logged, naming the mode, not a token), the
    tokens in force stay, and the planted token opens nothing."""
    from tests.security.test_token_revocation import _sidecar

    caplog.set_level(logging.WARNING)
    clients: list[Any] = []
    async with _sidecar(tmp_path, prod_db) as (sc, tokens):
        try:
            await _plant_a_token(sc, tokens, clients, caplog)
        finally:
            for c in clients:
                c.close()


def _loosen_and_plant(path: Path, tokens: dict[str, str]) -> None:
    """Someone makes the file world-writable, then writes their token into it (in place)."""
    path.chmod(0o666)
    path.write_text(json.dumps(tokens))


async def _plant_a_token(
    sc: Any, tokens: Path, clients: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """The reload test's steps; ``clients``: every client opened (the caller closes them)."""
    from kvgov.wire import RequestContext
    from kvgov.wire.codec import ErrorCode, WireError
    from tests.security import doors
    from tests.security.doors import run
    from tests.security.test_token_revocation import EVERY_S, VALUE

    def engine(token: str) -> Any:
        clients.append(doors.engine(sc, token))
        return clients[-1]

    ctx = RequestContext(request_id="req-file-modes", user="u1")
    acme = engine("tok-acme")
    assert (await run(acme.put, doors.key(1, "acme"), VALUE, ctx)).ok
    await run(_loosen_and_plant, tokens, {**doors.TOKENS, "tok-mallory": "vllm-acme"})
    await run(time.sleep, 10 * EVERY_S)
    refused = [r for r in caplog.records if r.getMessage() == "dataplane.tokens.reload_refused"]
    assert refused, "a world-writable token file was taken on reload"
    said = str(vars(refused[0]))
    assert "0666" in said and "tok-" not in said, said
    # the tokens in force stay: the old engine's connection and a new one still work
    assert doors.value_of(await run(acme.get, doors.key(1, "acme"), ctx)) == VALUE
    again = engine("tok-acme")
    assert doors.value_of(await run(again.get, doors.key(1, "acme"), ctx)) == VALUE
    mallory = engine("tok-mallory")
    with pytest.raises(WireError) as planted:
        await run(mallory.get, doors.key(1, "acme"), ctx)
    assert planted.value.error is ErrorCode.UNAUTHENTICATED


@pytest.mark.postgres
async def test_a_sidecar_does_not_start_on_a_world_writable_token_file(
    tmp_path: Path, prod_db: Any
) -> None:
    from kvgov.proxy.app import build_sidecar
    from tests.security.test_token_revocation import _settings

    st, tokens = _settings(tmp_path, prod_db)
    tokens.chmod(0o666)
    sc = None
    try:
        with pytest.raises(ConfigError, match=r"engine_tokens_file .*mode 0666"):
            sc = await build_sidecar(st)
            await sc.start()
    finally:
        if sc is not None:
            await sc.stop()


@pytest.mark.postgres
def test_receipts_are_not_checked_against_a_signing_key_others_may_write(
    world: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """``ApiContext.trusted_receipt_keys`` reads the signing key's public half lazily: a file
    others may write gives no key (nothing verifies) and a warning naming its mode."""
    caplog.set_level(logging.WARNING)
    ctx = world.ctx
    ctx.settings.signing_key_path.chmod(0o666)
    ctx.receipt_keys = None
    assert ctx.trusted_receipt_keys() == (), "receipts are checked against a writable key"
    said = [str(vars(r)) for r in caplog.records if "receipt_key" in r.getMessage()]
    assert said and "0666" in said[0], said


# -- dashboard sessions: a cap per token ---------------------------------------------------


@pytest.fixture
def world(pg_url: str, tmp_path: Path) -> Iterator[Any]:
    from tests.integration.test_api_support import api_world

    with api_world(pg_url, tmp_path) as w:
        yield w


def _live_sessions(world: Any, token_id: str) -> int:
    from kvgov.db.models import DashboardSession

    with Session(world.engine) as s:
        count = s.scalar(
            select(func.count())
            .select_from(DashboardSession)
            .where(DashboardSession.token_id == token_id)
        )
        return int(count or 0)


@pytest.mark.postgres
async def test_a_token_keeps_at_most_the_cap_of_sessions_and_the_oldest_ends(world: Any) -> None:
    from kvgov.db.sessions import MAX_SESSIONS_PER_TOKEN

    transport = httpx.ASGITransport(app=world.app)
    cookies: list[str] = []
    async with httpx.AsyncClient(transport=transport, base_url="http://kvgov.test") as client:
        for _ in range(100):
            client.cookies.clear()
            r = await client.post("/dashboard/login", data={"token": world.tokens.auditor})
            assert r.status_code == 303, r.text
            cookies.append(r.headers["set-cookie"].split(";")[0].split("=", 1)[1])
        live = _live_sessions(world, world.tokens.auditor_id)
        assert live <= MAX_SESSIONS_PER_TOKEN, f"{live} live sessions for one token"
        client.cookies.clear()

        async def opens(cookie: str) -> int:
            page = await client.get("/dashboard", headers={"Cookie": f"kvgov_dashboard={cookie}"})
            return page.status_code

        assert await opens(cookies[0]) == 401, "the earliest session still opens the dashboard"
        assert await opens(cookies[-MAX_SESSIONS_PER_TOKEN - 1]) == 401
        for cookie in cookies[-MAX_SESSIONS_PER_TOKEN:]:
            assert await opens(cookie) == 200

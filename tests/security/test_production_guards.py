"""Start-up guards of a production sidecar (review 4a, findings 2, 3 and 4).

Attack 2: a production sidecar whose pseudonym key (or signing key) was missing (the setting
unset, a typo in its path, a Secret item not mounted) made itself a new one. It then recorded its
users under pseudonyms only it could compute, and ``kvgov purge --user`` with the fleet's key
ended ``completed``, signed, having purged nothing. Outside development kvgov now never
generates these keys: start-up stops and names the setting.

Attack 3: production with ``policy.data_file`` unset started on the packaged example data
document (tenant ``demo`` admits every engine). Start-up now refuses it.

Attack 4: start-up errors printed secrets: an inline engine token of the wrong type was quoted in
pydantic's error location, and a database URL whose password holds an unescaped ``@`` ended in a
driver traceback naming the password's tail (taken for the host).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

import kvgov
from kvgov.config import Settings, load_settings
from kvgov.errors import ConfigError, KvgovError
from kvgov.ledger.chain import generate_signing_key_file
from kvgov.ledger.pseudonym import Pseudonymizer, generate_pseudonym_key_file
from kvgov.proxy.app import build_sidecar
from tests.security import doors
from tests.security.doors import ProdDatabase

# the Secrets these tests write are their user's alone, as kvgov requires
pytestmark = pytest.mark.usefixtures("private_umask")

TOKEN = "tok-7Q2xS3CRETvalue"
SRC = Path(kvgov.__file__).resolve().parents[1]


def _fleet_keys(tmp_path: Path) -> tuple[Path, Path]:
    """The fleet's keys as an operator provisions them (a Secret), outside the data dir."""
    fleet = tmp_path / "fleet"
    fleet.mkdir(mode=0o700, exist_ok=True)
    generate_pseudonym_key_file(fleet / "pseudonym.key")
    generate_signing_key_file(fleet / "signing.key")
    return fleet / "pseudonym.key", fleet / "signing.key"


def _with(settings: Settings, **sections: dict[str, Any]) -> Settings:
    """``settings`` with whole sections replaced, validated again (production checks too)."""
    data = settings.model_dump()
    for name, values in sections.items():
        data[name] = {**data[name], **values}
    data["dataplane"]["engine_tokens"] = doors.TOKENS
    data["database"]["url"] = settings.database.url.get_secret_value()
    return Settings(**data)


def _unprovisioned(tmp_path: Path, db: ProdDatabase) -> Settings:
    """``doors.settings`` (production, provisioned KEK and policy data) with no pseudonym or
    signing key anywhere: none named, none at the data directory's default paths."""
    settings = doors.settings(tmp_path, db)
    settings = _with(settings, ledger={"pseudonym_key_path": None, "signing_key_path": None})
    settings.pseudonym_key_path.unlink(missing_ok=True)
    settings.signing_key_path.unlink(missing_ok=True)
    return settings


def _kvgov(tmp_path: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """The CLI as a container runs it (this checkout's kvgov, no inherited KVGOV_ setting)."""
    base = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "PYTHONPATH": str(SRC),
        "KVGOV_DATA_DIR": str(tmp_path / "d"),
    }
    return subprocess.run(
        [sys.executable, "-m", "kvgov", *args],
        env=base | env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


# -- finding 2: the fleet's keys are never generated outside development -----------------------


async def test_production_refuses_a_missing_pseudonym_key(
    tmp_path: Path, prod_db: ProdDatabase
) -> None:
    settings = _unprovisioned(tmp_path, prod_db)  # production: a KEK, but no pseudonym key
    with pytest.raises(ConfigError, match=r"ledger\.pseudonym_key_path \(unset\): no pseudonym"):
        sc = await build_sidecar(settings)
        await sc.stop()
    assert not settings.pseudonym_key_path.exists(), "production generated a pseudonym key"


async def test_production_refuses_a_mistyped_pseudonym_key_path(
    tmp_path: Path, prod_db: ProdDatabase
) -> None:
    _pseudonym, signing = _fleet_keys(tmp_path)
    typo = tmp_path / "fleet" / "pseudonyn.key"
    settings = _with(
        _unprovisioned(tmp_path, prod_db),
        ledger={"pseudonym_key_path": typo, "signing_key_path": signing},
    )
    with pytest.raises(ConfigError, match=r"ledger\.pseudonym_key_path: no pseudonym key") as err:
        sc = await build_sidecar(settings)
        await sc.stop()
    assert "ledger.signing_key_path" not in err.value.message
    assert not typo.exists(), "production generated a pseudonym key"


async def test_production_refuses_a_missing_signing_key(
    tmp_path: Path, prod_db: ProdDatabase
) -> None:
    pseudonym, _signing = _fleet_keys(tmp_path)
    missing = tmp_path / "keys" / "signing.key"
    settings = _with(
        _unprovisioned(tmp_path, prod_db),
        ledger={"pseudonym_key_path": pseudonym, "signing_key_path": missing},
    )
    with pytest.raises(ConfigError, match=r"ledger\.signing_key_path: no signing key"):
        sc = await build_sidecar(settings)
        await sc.stop()
    assert not missing.exists(), "production generated a signing key"


async def test_a_provisioned_production_sidecar_starts_on_the_fleet_keys(
    tmp_path: Path, prod_db: ProdDatabase
) -> None:
    """Positive control: keys and data provisioned, the sidecar starts and pseudonymises with
    the fleet's key (what ``kvgov purge --user`` computes)."""
    pseudonym, signing = _fleet_keys(tmp_path)
    settings = _with(
        _unprovisioned(tmp_path, prod_db),
        ledger={"pseudonym_key_path": pseudonym, "signing_key_path": signing},
    )
    sc = await build_sidecar(settings)
    await sc.start()
    try:
        fleet = Pseudonymizer.from_file(pseudonym).user("acme", "alice")
        assert sc.pipeline.pseudonymizer.user("acme", "alice") == fleet
    finally:
        await sc.stop()
    assert not (settings.data_dir / "pseudonym.key").exists()
    assert not (settings.data_dir / "ledger-signing.key").exists()


async def test_development_still_generates_its_keys(tmp_path: Path) -> None:
    """Positive control: a development sidecar (``kvgov demo``, a first run) makes its keys."""
    settings = Settings(
        data_dir=tmp_path / "dev",
        dataplane={"host": "127.0.0.1", "port": 0, "buffer_pool_bytes": 64 << 20},
        tiers={"chain": ["memory"]},
    )
    sc = await build_sidecar(settings)
    await sc.start()
    await sc.stop()
    assert settings.pseudonym_key_path.is_file()
    assert settings.signing_key_path.is_file()


# -- finding 3: no packaged example policy data in production ---------------------------------


async def test_production_refuses_the_shipped_example_policy_data(
    tmp_path: Path, prod_db: ProdDatabase
) -> None:
    pseudonym, signing = _fleet_keys(tmp_path)
    settings = _with(
        _unprovisioned(tmp_path, prod_db),
        ledger={"pseudonym_key_path": pseudonym, "signing_key_path": signing},
        policy={"data_file": None},
    )
    assert settings.policy.data_file is None
    with pytest.raises(ConfigError, match=r"policy\.data_file is unset"):
        sc = await build_sidecar(settings)
        await sc.stop()


async def test_production_accepts_a_data_json_in_its_policy_dir(
    tmp_path: Path, prod_db: ProdDatabase
) -> None:
    """Positive control: ``policy.policy_dir`` holding ``data.json`` names the data too."""
    pseudonym, signing = _fleet_keys(tmp_path)
    policy_dir = tmp_path / "policy"
    policy_dir.mkdir()
    shipped = Path(kvgov.__file__).parent / "policy" / "rego"
    for rego in shipped.glob("*.rego"):
        (policy_dir / rego.name).write_text(rego.read_text())
    (policy_dir / "data.json").write_text(json.dumps(doors.policy_data()))
    settings = _with(
        _unprovisioned(tmp_path, prod_db),
        ledger={"pseudonym_key_path": pseudonym, "signing_key_path": signing},
        policy={"data_file": None, "policy_dir": policy_dir},
    )
    sc = await build_sidecar(settings)
    await sc.stop()


def test_the_shipped_production_manifests_provision_keys_and_policy_data(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The production overlay names the fleet's keys and a policy data file explicitly, so the
    guards above do not stop it (the files themselves: ``test_deploy_manifests.py``)."""
    from tests.integration.test_deploy_manifests import one, render, settings_env

    docs = render("production")
    pod = one(docs, "Deployment", "kvgov-inference")["spec"]["template"]["spec"]
    env = settings_env(docs, pod)
    for key in list(os.environ):
        if key.startswith("KVGOV_"):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    settings = load_settings()
    assert settings.ledger.pseudonym_key_path is not None
    assert settings.ledger.signing_key_path is not None
    assert settings.policy.data_file is not None
    mounts = {
        m["mountPath"]
        for c in pod["containers"] + pod["initContainers"]
        for m in c.get("volumeMounts", [])
        if c["name"] == "kvgov"
    }
    assert settings.policy.data_file.parent.as_posix() in mounts


# -- finding 4: start-up errors quote no secret -------------------------------------------------


def test_an_inline_engine_token_is_not_quoted_by_a_settings_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVGOV_DATAPLANE__ENGINE_TOKENS", json.dumps({TOKEN: {"engine": "vllm"}}))
    with pytest.raises(ConfigError) as err:
        load_settings()
    assert TOKEN not in err.value.diagnostics()
    assert "dataplane.engine_tokens[<redacted>]" in err.value.diagnostics()


def test_a_toml_engine_token_is_not_quoted_by_a_settings_error(tmp_path: Path) -> None:
    cfg = tmp_path / "kvgov.toml"
    cfg.write_text(f'[dataplane.engine_tokens]\n"{TOKEN}" = 7\n')
    with pytest.raises(ConfigError) as err:
        load_settings(cfg)
    assert TOKEN not in err.value.diagnostics()
    out = _kvgov(tmp_path, {}, "--config", str(cfg), "db", "current")
    assert out.returncode == 2 and TOKEN not in out.stdout + out.stderr


def test_a_password_with_an_unescaped_at_is_not_quoted(tmp_path: Path) -> None:
    url = tmp_path / "url"
    url.write_text("postgresql+psycopg://kvgov_runtime:Pa55@Wordtail9@127.0.0.1:1/kvgov\n")
    url.chmod(0o600)
    out = _kvgov(tmp_path, {"KVGOV_DATABASE__URL_FILE": str(url)}, "db", "current")
    text = out.stdout + out.stderr
    assert "Wordtail9" not in text and "Pa55" not in text, text
    assert "Traceback" not in text, text
    assert out.returncode == 2
    assert f"database.url_file {url}" in text and "%40" in text


def test_a_database_connection_error_is_one_line_with_the_password_masked(
    tmp_path: Path,
) -> None:
    password = "S3cretPassw0rd"
    env = {"KVGOV_DATABASE__URL": f"postgresql+psycopg://kvgov_runtime:{password}@127.0.0.1:1/kv"}
    out = _kvgov(tmp_path, env, "db", "current")
    text = out.stdout + out.stderr
    assert password not in text and "Traceback" not in text, text
    assert out.returncode == 2
    (line,) = [ln for ln in text.splitlines() if ln.startswith("kvgov:")]
    assert "postgresql+psycopg://kvgov_runtime:***@127.0.0.1:1/kv" in line


@pytest.mark.parametrize(
    "url",
    [
        "postgresql+psycopg://u:p@ss:wo:rd@127.0.0.1:1/x",  # the driver reads a port from it
        "postgresql+psycopg://u:Pa5/5word@127.0.0.1:1/x",  # a '/' in the password
    ],
)
def test_a_misparsed_password_is_not_quoted(tmp_path: Path, url: str) -> None:
    out = _kvgov(tmp_path, {"KVGOV_DATABASE__URL": url}, "db", "current")
    text = out.stdout + out.stderr
    assert "Traceback" not in text, text
    for piece in ("wo:rd", "ss:wo", "5word", "Pa5/5"):
        assert piece not in text, text


async def test_a_reload_never_puts_the_example_policy_data_in_force(tmp_path: Path) -> None:
    """Review 5, finding D: the start refused the packaged example data, but the running
    sidecar's reload (every ``policy.reload_interval_s``) fell back to it as soon as its
    ``data.json`` left ``policy_dir`` (a ConfigMap key renamed or dropped): tenant ``demo``,
    which admits every engine, came into force. Now such a reload is refused (logged by the
    follower as ``policy.reload_refused``) and the operator's data stays in force."""
    from importlib import resources

    from kvgov.errors import PolicyError
    from kvgov.policy.bundle import SHIPPED_DATA_SOURCE
    from kvgov.policy.factory import build_inner_engine
    from kvgov.types import Environment

    policy_dir = tmp_path / "policy"
    policy_dir.mkdir()
    rego = resources.files("kvgov.policy").joinpath("rego")
    (policy_dir / "authz.rego").write_text(rego.joinpath("authz.rego").read_text("utf-8"))
    (policy_dir / "data.json").write_text(json.dumps(doors.policy_data()))
    settings = Settings(data_dir=tmp_path, policy={"policy_dir": str(policy_dir)}).model_copy(
        update={"environment": Environment.PRODUCTION}
    )
    engine = build_inner_engine(settings)
    ours = engine.bundle.data_source
    assert ours == str(policy_dir / "data.json")
    (policy_dir / "data.json").unlink()  # the ConfigMap loses its data.json key
    with pytest.raises(PolicyError, match="development only"):
        await engine.reload()
    assert engine.bundle.data_source == ours != SHIPPED_DATA_SOURCE
    with pytest.raises(PolicyError, match="development only"):  # nor at a start
        build_inner_engine(settings)
    dev = settings.model_copy(update={"environment": Environment.DEVELOPMENT})
    assert build_inner_engine(dev).bundle.data_source == SHIPPED_DATA_SOURCE


def test_a_password_given_as_a_query_parameter_is_not_quoted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Review 5, finding G: libpq and SQLAlchemy also take the password as ``?password=``;
    the CLI's database error printed such a URL whole."""
    from kvgov.cli.main import main
    from kvgov.db.engine import redact_url

    secret = "Hunter2SuperSecret"
    for name in [k for k in os.environ if k.startswith("KVGOV_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("KVGOV_DATA_DIR", str(tmp_path))
    url = f"postgresql+psycopg://kvgov@127.0.0.1:1/kvgov?password={secret}&connect_timeout=2"
    monkeypatch.setenv("KVGOV_DATABASE_URL", url)
    with pytest.raises(SystemExit):
        main(["keys", "list", "--tenant", "acme"])
    err = capsys.readouterr().err
    assert "cannot use the database" in err, err
    assert secret not in err, err
    assert "password=***" in err
    assert secret not in redact_url(url)
    assert secret not in redact_url(url.replace("?password=", "?sslpassword="))


@pytest.mark.parametrize(
    "url",
    ["http://opa.policy.svc:8181", "http://10.0.3.7:8181", "http://[fd00::7]:8181"],
)
def test_production_refuses_asking_opa_in_the_clear_across_the_network(
    tmp_path: Path, prod_db: ProdDatabase, url: str
) -> None:
    """Review 4a (observation): a production sidecar accepted ``policy.opa_url`` over plain
    HTTP to another host: every decision, and the bearer ``policy.opa_token``, crossed the pod
    network in the clear, and whoever could answer in OPA's place decided every put and get.
    Behind a mesh too (review r9): plain HTTP proves nothing of who answers, and the guard read
    the host as text, so another spelling of loopback (``0x7f.1``, the pod's own name or
    address) passed as "beyond this host" and a squatter on it got the token."""
    base = doors.settings(tmp_path, prod_db)
    opa = {"engine": "opa", "opa_token": OPA_TOKEN}
    with pytest.raises(ValidationError, match=r"policy\.opa_url=http://"):
        _with(base, policy={**opa, "opa_url": url})
    with pytest.raises(ValidationError, match=r"policy\.opa_url=http://"):
        _with(base, policy={**opa, "opa_url": url}, dataplane={"cleartext_network_ok": True})
    # in the pod on its socket, or over TLS: accepted
    # (loopback TCP is refused: tests/security/test_opa_channel.py)
    for ok in ("unix:///run/opa/opa.sock", "https://opa.policy.svc:8181"):
        assert _with(base, policy={**opa, "opa_url": ok}).policy.opa_url == ok


# -- OPA's API without authentication (review: OPA sidecar unauthenticated) ------------------

#: a test value, no secret
OPA_TOKEN = "opa-" + "5b" * 30


def test_production_refuses_opa_without_a_token(tmp_path: Path, prod_db: ProdDatabase) -> None:
    """Attack: ``policy.engine = "opa"`` in production with no ``policy.opa_token``: kvgov
    asked OPA without a token, so OPA had to serve its API to anyone, and in a pod that is every
    container: the vLLM container (user prompts, model code) read the policy and its data
    (``GET /v1/data``: tenants, engines, labels) and could rewrite them. Start-up now stops and
    says why (the OPA side: ``tests/security/test_opa_api_authz.py``)."""
    base = doors.settings(tmp_path, prod_db)
    opa: dict[str, Any] = {"engine": "opa", "opa_url": "unix:///run/opa/opa.sock"}
    for policy in (opa, {**opa, "opa_token": ""}):
        with pytest.raises(ValidationError) as caught:
            _with(base, policy=policy)
        text = str(caught.value)
        assert "policy.engine=opa without policy.opa_token or policy.opa_token_file" in text
        assert "--authentication=token --authorization=basic" in text
    # a token inline, or (what the overlay mounts) in a file: accepted
    assert _with(base, policy={**opa, "opa_token": OPA_TOKEN}).opa_token == OPA_TOKEN
    token_file = tmp_path / "opa-token"
    token_file.write_text(OPA_TOKEN + "\n")
    from_file = _with(base, policy={**opa, "opa_token_file": token_file})
    assert from_file.opa_token == OPA_TOKEN
    # the embedded engine asks no OPA; development keeps working without a token
    assert _with(base, policy={"engine": "embedded"}).opa_token is None
    assert Settings(data_dir=tmp_path / "dev", policy={"engine": "opa"}).opa_token is None


def test_the_opa_token_file_is_read_at_start_and_never_quoted(tmp_path: Path) -> None:
    token_file = tmp_path / "opa-token"
    settings = Settings(
        data_dir=tmp_path / "d", policy={"engine": "opa", "opa_token_file": token_file}
    )
    for content, problem in (
        (None, "cannot read policy.opa_token_file"),
        ("\n", "is empty"),
        (f"{OPA_TOKEN} {OPA_TOKEN}", "whitespace or control characters"),
        (f"{OPA_TOKEN}\x00", "whitespace or control characters"),
    ):
        if content is not None:
            token_file.write_text(content)
        with pytest.raises(ConfigError, match=problem) as caught:
            _ = settings.opa_token
        assert OPA_TOKEN not in caught.value.diagnostics()
    with pytest.raises(ValidationError, match="not both"):
        Settings(policy={"opa_token": OPA_TOKEN, "opa_token_file": token_file})


# -- review r16, finding 2: the ledger's connection without verified TLS ---------------------
#
# Attack: nothing required the ledger's Postgres connection to use TLS that authenticates the
# server. libpq's default, sslmode=prefer, verifies no certificate and falls back to plaintext
# when whoever answers says "N" to SSLRequest; sslmode=require encrypts but proves nothing of
# the server. An attacker on the pod-to-database path (a node, a mirrored port, a neighbour on a
# flat network) answered in the database's place, relayed the password exchange (no channel
# binding without TLS) and kept the authenticated runtime-role session: an INSERT into
# api_tokens of an admin token of their own, or answers the sidecar trusts rewritten. Production
# now refuses a Postgres URL beyond this host (not loopback, not a Unix socket) that does not
# itself say sslmode=verify-full (or verify-ca) and sslrootcert, and a Redis URL beyond this
# host that is not rediss:// with the certificate checked; each has an opt-out for a mesh that
# does mTLS, logged at WARNING at start.

DB_PASSWORD = "Ledg3r-r16-Passw0rd"
REMOTE_DB = f"postgresql+psycopg://kvgov_runtime:{DB_PASSWORD}@db.example.internal/kvgov"
CA = "/etc/kvgov/database/ca.crt"
VERIFIED = f"sslmode=verify-full&sslrootcert={CA}"
#: a ledger these settings name but no test here connects to (they are only validated)
_NO_DB = ProdDatabase(url="postgresql+psycopg://kvgov_runtime@127.0.0.1:1/kvgov", runtime_role="r")
#: what a URL says of TLS that authenticates nothing: no sslmode (libpq: prefer), prefer,
#: require (encrypted, server unproven), verify-full without a CA to verify against
UNVERIFIED = ["", "?sslmode=prefer", "?sslmode=require", "?sslmode=verify-full", "?sslmode=allow"]
OPEN_LEDGER = (
    "DID NOT RAISE: production accepted a ledger URL without verified TLS (libpq"
    " sslmode=prefer: unauthenticated, downgradable; runtime-role session hijack)"
)


@pytest.fixture(autouse=True)
def _no_libpq_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """libpq's own environment for where and how it connects, as a container starts: unset."""
    for name in ("PGHOST", "PGHOSTADDR", "PGSERVICE", "PGSSLMODE", "PGSSLROOTCERT"):
        monkeypatch.delenv(name, raising=False)


def _prod(tmp_path: Path, *, tiers: dict[str, Any] | None = None, **database: Any) -> Settings:
    """``doors.settings`` (production, everything else provisioned) with its ``database``
    section replaced by ``database`` (and ``tiers`` merged), validated again."""
    data = doors.settings(tmp_path, _NO_DB).model_dump()
    data["dataplane"]["engine_tokens"] = doors.TOKENS
    data["database"] = {"runtime_role": "kvgov_runtime", **database}
    data["tiers"] = {**data["tiers"], **(tiers or {})}
    return Settings(**data)


def _refusal(build: Callable[[], object], when_open: str = OPEN_LEDGER) -> str:
    """What refusing ``build()`` says (a ValidationError, or a ConfigError when a URL file is
    read); the test fails with ``when_open`` when it is accepted."""
    try:
        build()
    except ValidationError as exc:
        return str(exc)
    except ConfigError as exc:
        return exc.diagnostics()
    pytest.fail(when_open)


def _names_the_cure(text: str, setting: str, host: str = "db.example.internal") -> None:
    assert DB_PASSWORD not in text and "Ledg3r" not in text, text
    assert setting in text and host in text, text
    assert "sslmode=verify-full" in text and "sslrootcert" in text, text
    assert "database.cleartext_network_ok" in text, text


@pytest.mark.parametrize("query", UNVERIFIED)
@pytest.mark.parametrize("setting", ["url", "migration_url"])
def test_production_refuses_a_ledger_url_without_verified_tls(
    tmp_path: Path, setting: str, query: str
) -> None:
    extra = {} if setting == "url" else {"url": f"{REMOTE_DB}?{VERIFIED}"}
    text = _refusal(lambda: _prod(tmp_path, **{setting: REMOTE_DB + query}, **extra))
    _names_the_cure(text, f"database.{setting}")


@pytest.mark.parametrize("query", UNVERIFIED)
@pytest.mark.parametrize("setting", ["url_file", "migration_url_file"])
def test_production_refuses_a_ledger_url_file_without_verified_tls(
    tmp_path: Path, setting: str, query: str
) -> None:
    """The shipped manifests' way: the URL in a mounted Secret, read when used."""
    url_file = tmp_path / "url"
    url_file.write_text(REMOTE_DB + query + "\n")
    extra = {} if setting == "url_file" else {"url": f"{REMOTE_DB}?{VERIFIED}"}
    settings = _prod(tmp_path, **{setting: url_file}, **extra)
    prop = "database_url" if setting == "url_file" else "migration_database_url"
    text = _refusal(lambda: getattr(settings, prop))
    _names_the_cure(text, f"database.{setting} {url_file}")


@pytest.mark.parametrize(
    "url",
    [
        # the query's host is where psycopg connects: the authority's is replaced
        f"postgresql+psycopg://u:{DB_PASSWORD}@127.0.0.1/kvgov?host=db.example.internal",
        # hostaddr is the address dialled whatever host says (host: what the certificate names)
        f"postgresql+psycopg://u:{DB_PASSWORD}@/kvgov?host=/run/postgresql&hostaddr=10.0.3.7",
        f"postgresql+psycopg://u:{DB_PASSWORD}@127.0.0.1/kvgov?hostaddr=10.0.3.7",
        # libpq tries every host of a list
        f"postgresql+psycopg://u:{DB_PASSWORD}@/kvgov?host=127.0.0.1,db.example.internal",
        f"postgresql+psycopg://u:{DB_PASSWORD}@/kvgov?host=127.0.0.1:5432&host=db.example:5432",
        # a service's host is in pg_service.conf, which the URL does not show
        f"postgresql+psycopg://u:{DB_PASSWORD}@/kvgov?service=ledger",
        # libpq takes the last sslmode, SQLAlchemy both: not a verified URL either way
        f"{REMOTE_DB}?sslmode=verify-full&sslrootcert={CA}&sslmode=disable",
        f"{REMOTE_DB}?sslmode=verify-full&sslrootcert=",
        f"{REMOTE_DB}?sslmode=verify-full&sslrootcert={CA}&sslrootcert=/tmp/ca.crt",
        # a spelling of loopback libpq resolves but kvgov does not read: fail closed
        f"postgresql+psycopg://u:{DB_PASSWORD}@localhost.evil.example/kvgov",
    ],
)
def test_production_reads_where_libpq_connects(tmp_path: Path, url: str) -> None:
    text = _refusal(lambda: _prod(tmp_path, url=url))
    assert "sslmode" in text and DB_PASSWORD not in text, text


@pytest.mark.parametrize(
    ("env", "value"), [("PGHOST", "db.example.internal"), ("PGHOSTADDR", "10.0.3.7")]
)
def test_production_reads_libpqs_environment_for_where_it_connects(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: str, value: str
) -> None:
    """A URL with no host (the Unix socket) goes where PGHOST says, and any host to the
    address PGHOSTADDR says, when the URL does not name one itself."""
    monkeypatch.setenv(env, value)
    url = f"postgresql+psycopg://u:{DB_PASSWORD}@/kvgov"
    text = _refusal(lambda: _prod(tmp_path, url=url))
    assert value in text and "sslmode" in text and DB_PASSWORD not in text, text


def test_libpqs_sslmode_environment_does_not_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PGSSLMODE/PGSSLROOTCERT would give libpq verify-full, but only in the process that has
    them (not the migration Job, not an operator's shell): the URL itself must say it."""
    monkeypatch.setenv("PGSSLMODE", "verify-full")
    monkeypatch.setenv("PGSSLROOTCERT", CA)
    text = _refusal(lambda: _prod(tmp_path, url=REMOTE_DB))
    assert "PGSSLMODE" in text and DB_PASSWORD not in text, text


@pytest.mark.parametrize(
    "url",
    [
        f"{REMOTE_DB}?{VERIFIED}",
        f"{REMOTE_DB}?sslmode=verify-ca&sslrootcert={CA}&connect_timeout=5",
        f"postgresql://kvgov_runtime:{DB_PASSWORD}@db.example.internal:6432/kvgov?{VERIFIED}",
        f"postgresql+psycopg://u:{DB_PASSWORD}@127.0.0.1:5432/kvgov",
        f"postgresql+psycopg://u:{DB_PASSWORD}@127.0.0.53/kvgov",
        f"postgresql+psycopg://u:{DB_PASSWORD}@localhost/kvgov",
        f"postgresql+psycopg://u:{DB_PASSWORD}@[::1]:5432/kvgov",
        f"postgresql+psycopg://u:{DB_PASSWORD}@/kvgov?host=/run/postgresql",
        f"postgresql+psycopg://u:{DB_PASSWORD}@/kvgov",  # libpq's default socket directory
        f"postgresql+psycopg://u:{DB_PASSWORD}@db.example.internal/kvgov?hostaddr=127.0.0.1",
    ],
)
def test_production_accepts_verified_tls_and_this_hosts_ledger(tmp_path: Path, url: str) -> None:
    settings = _prod(tmp_path, url=url, migration_url=url)
    assert settings.database_url == url
    url_file = tmp_path / "url"
    url_file.write_text(url)
    assert _prod(tmp_path, url_file=url_file).database_url == url


def test_load_settings_refuses_it_without_quoting_the_password(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As a production pod's environment gives it (``KVGOV_DATABASE_URL``, the shorthand)."""
    base = doors.settings(tmp_path, _NO_DB)
    for name in [k for k in os.environ if k.startswith("KVGOV_")]:
        monkeypatch.delenv(name)
    env = {
        "KVGOV_ENVIRONMENT": "production",
        "KVGOV_DATA_DIR": str(base.data_dir),
        "KVGOV_DATABASE_URL": f"{REMOTE_DB}?sslmode=require&password={DB_PASSWORD}",
        "KVGOV_DATABASE__RUNTIME_ROLE": "kvgov_runtime",
        "KVGOV_KEYS__KEK_PATH": str(base.keys.kek_path),
        "KVGOV_POLICY__DATA_FILE": str(base.policy.data_file),
        "KVGOV_DATAPLANE__ENGINE_TOKENS": json.dumps(doors.TOKENS),
        "KVGOV_PURGE__NO_GPU_PREFIX_CACHE": "true",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    text = _refusal(load_settings)
    _names_the_cure(text, "database.url")
    assert "sslmode=require" in text, text


async def test_the_database_opt_out_is_accepted_and_logged_at_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Behind a mesh that encrypts and authenticates the connection to the database (mTLS),
    ``database.cleartext_network_ok`` lifts the refusal, and every start says so: the
    sidecar's, and ``kvgov db upgrade``'s for the owner's URL."""
    import logging

    from kvgov.db.engine import migrate

    runtime = f"postgresql+psycopg://kvgov_runtime:{DB_PASSWORD}@db.example.invalid/kvgov"
    owner = f"postgresql+psycopg://kvgov_owner:{DB_PASSWORD}@owner.example.invalid/kvgov"
    settings = _prod(
        tmp_path,
        url=runtime + "?connect_timeout=2",
        migration_url=owner + "?connect_timeout=2",
        cleartext_network_ok=True,
    )
    assert settings.production_problems() == []
    with caplog.at_level(logging.WARNING, logger="kvgov"):
        with pytest.raises(KvgovError) as failed:
            await build_sidecar(settings)  # no such database: it stops after the warning
        with pytest.raises(KvgovError) as failed_migration:
            migrate(settings)
    warned = [r for r in caplog.records if r.getMessage() == "database.tls.unverified"]
    assert [
        (r.levelno, getattr(r, "setting", None), getattr(r, "hosts", None)) for r in warned
    ] == [
        (logging.WARNING, "database.url", "db.example.invalid"),
        (logging.WARNING, "database.migration_url", "owner.example.invalid"),
    ]
    assert all(getattr(r, "opt_out", None) == "database.cleartext_network_ok" for r in warned)
    said = " ".join(str(vars(r)) for r in caplog.records)
    said += failed.value.diagnostics() + failed_migration.value.diagnostics()
    assert DB_PASSWORD not in said, said


# -- the same for the Redis tier's URL (its password crosses the network) -------------------

REDIS_PASSWORD = "R3dis-r16-Passw0rd"
REMOTE_REDIS = f"redis://:{REDIS_PASSWORD}@redis.example.internal:6379/0"
OPEN_REDIS = (
    "DID NOT RAISE: production accepted a Redis tier URL beyond this host without verified"
    " TLS (its password in the clear)"
)


@pytest.mark.parametrize(
    "url",
    [
        REMOTE_REDIS,
        REMOTE_REDIS.replace("redis://", "rediss://") + "?ssl_cert_reqs=none",
        REMOTE_REDIS.replace("redis://", "rediss://") + "?ssl_cert_reqs=optional",
        REMOTE_REDIS.replace("redis://", "rediss://") + "?ssl_check_hostname=false",
        f"redis://:{REDIS_PASSWORD}@/0?host=redis.example.internal",
    ],
)
def test_production_refuses_a_redis_url_without_verified_tls(tmp_path: Path, url: str) -> None:
    tiers = {"chain": ["memory", "redis"]}
    text = _refusal(
        lambda: _prod(tmp_path, url=_NO_DB.url, tiers={**tiers, "redis_url": url}), OPEN_REDIS
    )
    url_file = tmp_path / "redis-url"
    url_file.write_text(url)
    settings = _prod(tmp_path, url=_NO_DB.url, tiers={**tiers, "redis_url_file": url_file})
    text += _refusal(lambda: settings.redis_url, OPEN_REDIS)
    assert REDIS_PASSWORD not in text and "R3dis" not in text, text
    assert "redis.example.internal" in text and "rediss://" in text, text
    assert "tiers.redis_url" in text and f"tiers.redis_url_file {url_file}" in text, text
    assert "tiers.redis_cleartext_network_ok" in text, text


@pytest.mark.parametrize(
    "url",
    [
        REMOTE_REDIS.replace("redis://", "rediss://"),
        REMOTE_REDIS.replace("redis://", "rediss://") + "?ssl_ca_certs=/etc/kvgov/redis/ca.crt",
        f"redis://:{REDIS_PASSWORD}@127.0.0.1:6379/0",
        f"redis://:{REDIS_PASSWORD}@localhost/0",
        "unix:///run/redis/redis.sock?db=0",
    ],
)
def test_production_accepts_a_verified_or_local_redis(tmp_path: Path, url: str) -> None:
    settings = _prod(tmp_path, url=_NO_DB.url, tiers={"redis_url": url})
    assert settings.redis_url == url


def test_the_redis_opt_out_is_accepted(tmp_path: Path) -> None:
    settings = _prod(
        tmp_path,
        url=_NO_DB.url,
        tiers={"redis_url": REMOTE_REDIS, "redis_cleartext_network_ok": True},
    )
    assert settings.redis_url == REMOTE_REDIS
    (found,) = settings.unverified_transports("runtime", "migration", "redis")
    assert (found.use, found.setting, found.hosts) == (
        "redis",
        "tiers.redis_url",
        "redis.example.internal",
    )

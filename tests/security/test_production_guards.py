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
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

import kvgov
from kvgov.config import Settings, load_settings
from kvgov.errors import ConfigError
from kvgov.ledger.chain import generate_signing_key_file
from kvgov.ledger.pseudonym import Pseudonymizer, generate_pseudonym_key_file
from kvgov.proxy.app import build_sidecar
from tests.security import doors
from tests.security.doors import ProdDatabase

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

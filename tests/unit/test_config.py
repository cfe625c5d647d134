"""Settings: defaults, sources and their precedence, unknown keys, unsafe combinations."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvgov.config import DEV_FILESYSTEM_MAX_BYTES, load_settings
from kvgov.errors import ConfigError
from kvgov.types import Environment

#: a production ledger URL beyond this host: TLS that proves the server (review r16, finding 2)
PROD_DB_URL = (
    "postgresql+psycopg://kvgov@db/kvgov?sslmode=verify-full&sslrootcert=/etc/kvgov/database/ca.crt"
)

# the Secrets these tests write are their user's alone, as kvgov requires
pytestmark = pytest.mark.usefixtures("private_umask")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("KVGOV_") and not name.startswith("KVGOV_TEST_"):
            monkeypatch.delenv(name)


def test_embedded_defaults_need_nothing() -> None:
    s = load_settings()
    assert s.environment is Environment.DEVELOPMENT
    assert s.database_url == "sqlite:///.kvgov/ledger.db"
    assert s.policy.engine == "embedded"
    assert s.tiers.chain == ["memory", "filesystem"]
    assert s.signing_key_path == Path(".kvgov/ledger-signing.key")


def test_database_url_shorthand_selects_postgres(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGOV_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1/kv")
    s = load_settings()
    assert s.is_postgres
    assert s.database_url == "postgresql+psycopg://postgres@127.0.0.1/kv"


def test_env_beats_file_and_nested_delimiter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tmp_path / "kvgov.toml"
    cfg.write_text('log_level = "debug"\n[tiers]\nchain = ["memory"]\nmemory_max_bytes = 2097152\n')
    monkeypatch.setenv("KVGOV_TIERS__MEMORY_MAX_BYTES", "4194304")
    s = load_settings(cfg)
    assert s.log_level == "debug"
    assert s.tiers.chain == ["memory"]
    assert s.tiers.memory_max_bytes == 4194304


def test_unknown_file_key_is_an_error(tmp_path: Path) -> None:
    cfg = tmp_path / "kvgov.toml"
    cfg.write_text("[tiers]\nchian = ['memory']\n")
    with pytest.raises(ConfigError, match=r"tiers\.chian"):
        load_settings(cfg)


def test_unknown_env_key_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGOV_TIERS__CHIAN", '["memory"]')
    with pytest.raises(ConfigError, match="KVGOV_TIERS__CHIAN"):
        load_settings()


def test_service_link_variables_are_named_as_such(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the kubelet makes of a Service named kvgov-control (review r8): refused like any
    other unknown name, with the cause and its fix in the hint."""
    monkeypatch.setenv("KVGOV_CONTROL_PORT_7080_TCP_ADDR", "10.96.0.10")
    monkeypatch.setenv("KVGOV_CONTROL_SERVICE_HOST", "10.96.0.10")
    with pytest.raises(ConfigError, match="KVGOV_CONTROL_SERVICE_HOST") as err:
        load_settings()
    assert "enableServiceLinks: false" in str(err.value.hint)


def test_a_plain_typo_gets_no_service_link_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGOV_TIERS__CHIAN", '["memory"]')
    with pytest.raises(ConfigError) as err:
        load_settings()
    assert "enableServiceLinks" not in str(err.value.hint)


@pytest.mark.parametrize("value", ["-1", "1001", "soon"])
def test_a_journal_sync_interval_out_of_range_stops_start_up(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("KVGOV_LEDGER__JOURNAL_SYNC_INTERVAL_MS", value)
    with pytest.raises(ConfigError, match="journal_sync_interval_ms"):
        load_settings()
    monkeypatch.setenv("KVGOV_LEDGER__JOURNAL_SYNC_INTERVAL_MS", "0")
    assert load_settings().ledger.journal_sync_interval_ms == 0.0


@pytest.mark.parametrize("value", ["-1", "0.05", "nan", "inf", "2592001", "hourly"])
def test_a_shared_reconcile_interval_out_of_range_stops_start_up(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    assert load_settings().tiers.shared_reconcile_interval_s == 3600.0
    monkeypatch.setenv("KVGOV_TIERS__SHARED_RECONCILE_INTERVAL_S", value)
    with pytest.raises(ConfigError, match="shared_reconcile_interval_s"):
        load_settings()
    for ok in ("0", "0.1", "600", "2592000"):  # 0: reconcile shared tiers at start only
        monkeypatch.setenv("KVGOV_TIERS__SHARED_RECONCILE_INTERVAL_S", ok)
        assert load_settings().tiers.shared_reconcile_interval_s == float(ok)


def test_missing_and_invalid_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_settings(tmp_path / "absent.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("this is = = not toml")
    with pytest.raises(ConfigError, match="TOML"):
        load_settings(bad)


def test_production_refuses_unsafe_combinations() -> None:
    with pytest.raises(ConfigError) as err:
        load_settings(environment="production", policy={"engine": "unsafe-allow-all"})
    text = err.value.diagnostics()
    assert "unsafe-allow-all" in text
    assert "Postgres" in text
    assert "kek_path" in text


def test_production_refuses_the_benchmarks_null_collaborators() -> None:
    with pytest.raises(ConfigError) as err:
        load_settings(
            environment="production",
            dataplane={"sealer": "unsafe-plaintext", "events": "unsafe-null"},
        )
    text = err.value.diagnostics()
    assert "dataplane.sealer=unsafe-plaintext" in text
    assert "dataplane.events=unsafe-null" in text
    with pytest.raises(ConfigError, match="sealer"):
        load_settings(dataplane={"sealer": "none"})  # only the two named choices


def test_production_accepts_a_safe_configuration(tmp_path: Path) -> None:
    s = load_settings(
        environment="production",
        database={"url": PROD_DB_URL, "runtime_role": "kvgov_runtime"},
        keys={"kek_path": str(tmp_path / "kek.key")},
        dataplane={"engine_tokens": {"t0ken-value": "engine-a"}},
        purge={"vllm_engines": ["http://127.0.0.1:8000"]},
        tiers={"filesystem_max_bytes": 2 << 30},
    )
    assert s.production_problems() == []


def test_production_refuses_the_filesystem_tier_without_a_bound(tmp_path: Path) -> None:
    """Attack (review r16, finding 1): the filesystem tier had no size bound; on a Kubernetes
    emptyDir a tenant's unique prompts filled it and the kubelet evicted the pod, the ledger
    journal with it. Production now refuses a chain with ``filesystem`` and no bound;
    development bounds it by default."""
    safe: dict[str, object] = {
        "environment": "production",
        "database": {"url": PROD_DB_URL, "runtime_role": "rt"},
        "keys": {"kek_path": str(tmp_path / "kek.key")},
        "dataplane": {"engine_tokens": {"t0ken-value": "engine-a"}},
        "purge": {"no_gpu_prefix_cache": True},
    }
    with pytest.raises(ConfigError, match=r"tiers\.filesystem_max_bytes is unset"):
        load_settings(**safe)
    bounded = load_settings(**safe, tiers={"filesystem_max_bytes": 2 << 30})
    assert bounded.filesystem_tier_max_bytes == 2 << 30
    memory_only = load_settings(**safe, tiers={"chain": ["memory"]})
    assert memory_only.production_problems() == []
    with pytest.raises(ConfigError, match="filesystem_max_bytes"):
        load_settings(tiers={"filesystem_max_bytes": 4096})  # under 1 MiB
    dev = load_settings(data_dir=tmp_path / "dev")
    assert dev.tiers.filesystem_max_bytes is None
    assert dev.filesystem_tier_max_bytes == DEV_FILESYSTEM_MAX_BYTES


def test_a_filesystem_bound_below_what_puts_hold_in_flight_is_refused(tmp_path: Path) -> None:
    """Attack (review r18, finding 4): nothing kept ``tiers.filesystem_max_bytes`` above the
    bytes puts have in flight (their pooled buffers: ``dataplane.buffer_pool_bytes``) or the
    largest value a put may carry (``dataplane.max_frame_bytes``). A bound near the pool had
    puts refused as "held by puts in progress" (the chain then dropped the key from every
    tier) and evictions reaching the value just written; a bound below a value cached it
    nowhere. Start-up now refuses a bound under twice the pool or under the largest frame,
    naming the settings and their values, in every environment."""
    mib = 1 << 20
    small = {"buffer_pool_bytes": 64 * mib, "max_frame_bytes": 16 * mib}
    with pytest.raises(ConfigError) as refused:  # at the pool: no room left for what is cached
        load_settings(dataplane=small, tiers={"filesystem_max_bytes": 64 * mib})
    message = str(refused.value)
    assert f"tiers.filesystem_max_bytes={64 * mib}" in message, message
    assert f"dataplane.buffer_pool_bytes={64 * mib}" in message, message
    assert f"at least {128 * mib}" in message, message
    frames = {"buffer_pool_bytes": 8 * mib, "max_frame_bytes": 256 * mib}
    with pytest.raises(ConfigError) as refused:  # below one value of the largest frame
        load_settings(dataplane=frames, tiers={"filesystem_max_bytes": 128 * mib})
    message = str(refused.value)
    assert f"dataplane.max_frame_bytes={256 * mib}" in message, message
    assert f"at least {256 * mib}" in message, message
    # production too (the shipped manifests: a 512 MiB pool, a 16 GiB bound)
    with pytest.raises(ConfigError, match=r"tiers\.filesystem_max_bytes="):
        load_settings(
            environment="production",
            database={"url": PROD_DB_URL, "runtime_role": "rt"},
            keys={"kek_path": str(tmp_path / "kek.key")},
            dataplane={"engine_tokens": {"t0ken-value": "engine-a"}},
            purge={"no_gpu_prefix_cache": True},
            tiers={"filesystem_max_bytes": 1 << 30},  # the default 1 GiB pool: twice that
        )
    # the minimum itself, and the defaults, pass
    assert load_settings(dataplane=small, tiers={"filesystem_max_bytes": 128 * mib})
    shipped = {"buffer_pool_bytes": 512 * mib}
    assert load_settings(dataplane=shipped, tiers={"filesystem_max_bytes": 16 << 30})
    dev = load_settings(data_dir=tmp_path / "dev")
    assert dev.filesystem_tier_max_bytes == DEV_FILESYSTEM_MAX_BYTES
    # unset in development with a pool too large for the default bound: raised to the minimum
    big = load_settings(data_dir=tmp_path / "dev", dataplane={"buffer_pool_bytes": 4 << 30})
    assert big.filesystem_tier_max_bytes == 8 << 30
    # a chain without the filesystem tier does not use the bound: not checked
    assert load_settings(tiers={"chain": ["memory"], "filesystem_max_bytes": mib})


def test_production_refuses_a_purge_that_resets_no_gpu_prefix_cache(tmp_path: Path) -> None:
    """Attack (review r10, observation): production accepted no ``purge.vllm_engines``, and
    every purge's ``gpu`` step then ended ``completed`` with nothing reset while the pod's vLLM
    kept the purged user's blocks in its GPU prefix cache, under a signed receipt. Start-up
    now refuses it unless the operator says the engines keep no GPU prefix cache."""
    safe: dict[str, object] = {
        "environment": "production",
        "database": {"url": PROD_DB_URL, "runtime_role": "kvgov_rt"},
        "keys": {"kek_path": str(tmp_path / "kek.key")},
        "dataplane": {"engine_tokens": {"t0ken-value": "engine-a"}},
        "tiers": {"filesystem_max_bytes": 2 << 30},
    }
    with pytest.raises(ConfigError, match=r"purge\.vllm_engines is empty"):
        load_settings(**safe)
    declared = load_settings(**safe, purge={"no_gpu_prefix_cache": True})
    assert declared.production_problems() == []
    with pytest.raises(ConfigError, match="say one"):
        load_settings(
            **safe,
            purge={"no_gpu_prefix_cache": True, "vllm_engines": ["http://127.0.0.1:8000"]},
        )
    # development keeps its default (no vLLM to reset)
    assert load_settings(data_dir=tmp_path / "dev").purge.vllm_engines == []


def test_production_refuses_the_cleartext_wire_beyond_loopback(tmp_path: Path) -> None:
    """Attack (review, ninth session): production accepted ``dataplane.host=0.0.0.0``; the
    kvgov wire has no encryption of its own, so every engine token and every value a get
    opened crossed the network in the clear. Refused now, like a non-loopback ``lm_host``,
    unless the operator says a mesh encrypts pod traffic."""
    safe: dict[str, object] = {
        "environment": "production",
        "database": {"url": PROD_DB_URL, "runtime_role": "rt"},
        "keys": {"kek_path": str(tmp_path / "kek.key")},
        "purge": {"no_gpu_prefix_cache": True},
        "tiers": {"filesystem_max_bytes": 2 << 30},
    }
    tokens = {"engine_tokens": {"t0ken-value": "engine-a"}}
    for host in ("0.0.0.0", "10.1.2.3", "::"):
        with pytest.raises(ConfigError, match=rf"dataplane\.host={host} .*no encryption"):
            load_settings(**safe, dataplane={**tokens, "host": host})
    for host in ("127.0.0.1", "::1", ""):  # loopback, or no TCP listener at all
        s = load_settings(**safe, dataplane={**tokens, "host": host})
        assert s.production_problems() == []
    meshed = load_settings(
        **safe, dataplane={**tokens, "host": "0.0.0.0", "cleartext_network_ok": True}
    )
    assert meshed.production_problems() == []
    assert load_settings(dataplane={"host": "0.0.0.0"}).dataplane.host == "0.0.0.0"  # dev


def test_production_needs_a_runtime_role(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"database\.runtime_role is empty"):
        load_settings(
            environment="production",
            database={"url": PROD_DB_URL},
            keys={"kek_path": str(tmp_path / "kek.key")},
            dataplane={"engine_tokens": {"t0ken-value": "engine-a"}},
            purge={"no_gpu_prefix_cache": True},
        )


PASSWORD = "pa55-w0rd-never-shown"


def test_database_urls_from_files_and_the_migration_fallback(tmp_path: Path) -> None:
    runtime = tmp_path / "runtime-url"
    runtime.write_text(f"postgresql+psycopg://kvgov_rt:{PASSWORD}@db/kvgov\n")
    s = load_settings(database={"url_file": str(runtime)})
    assert s.database_url == f"postgresql+psycopg://kvgov_rt:{PASSWORD}@db/kvgov"
    assert s.is_postgres
    assert s.migration_database_url == s.database_url  # one role for both unless told
    owner = tmp_path / "owner-url"
    owner.write_text(f"postgresql+psycopg://kvgov_owner:{PASSWORD}@db/kvgov")
    s = load_settings(database={"url_file": str(runtime), "migration_url_file": str(owner)})
    assert s.migration_database_url == f"postgresql+psycopg://kvgov_owner:{PASSWORD}@db/kvgov"
    runtime.write_text("postgresql+psycopg://rotated@db/kvgov")  # read when used
    assert s.database_url == "postgresql+psycopg://rotated@db/kvgov"
    s = load_settings(database={"migration_url": "postgresql+psycopg://owner@db/kvgov"})
    assert s.database_url.startswith("sqlite:///")
    assert s.migration_database_url == "postgresql+psycopg://owner@db/kvgov"


def test_database_url_and_its_file_are_exclusive(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"database\.url or database\.url_file, not both"):
        load_settings(database={"url": "postgresql://a@b/c", "url_file": str(tmp_path / "u")})
    with pytest.raises(ConfigError, match=r"migration_url or database\.migration_url_file"):
        load_settings(database={"migration_url": "postgresql://a@b/c", "migration_url_file": "/x"})


def test_unreadable_or_empty_url_file_stops_with_a_hint(tmp_path: Path) -> None:
    s = load_settings(database={"url_file": str(tmp_path / "absent")})
    with pytest.raises(ConfigError, match=r"cannot read database\.url_file .*absent"):
        _ = s.database_url
    empty = tmp_path / "empty"
    empty.write_text("  \n")
    s = load_settings(database={"migration_url_file": str(empty)})
    with pytest.raises(ConfigError, match="is empty"):
        _ = s.migration_database_url


def test_production_refuses_sqlite_from_a_url_file(tmp_path: Path) -> None:
    url_file = tmp_path / "url"
    url_file.write_text(f"sqlite:///{tmp_path}/ledger.db")
    s = load_settings(
        environment="production",
        database={"url_file": str(url_file), "runtime_role": "kvgov_runtime"},
        keys={"kek_path": str(tmp_path / "kek.key")},
        dataplane={"engine_tokens": {"t0ken-value": "engine-a"}},
        purge={"no_gpu_prefix_cache": True},
        tiers={"filesystem_max_bytes": 2 << 30},
    )
    with pytest.raises(ConfigError, match="production needs a Postgres ledger"):
        _ = s.database_url


def test_database_passwords_stay_out_of_reprs_and_errors(tmp_path: Path) -> None:
    url = f"postgresql+psycopg://kvgov_rt:{PASSWORD}@db/kvgov"
    s = load_settings(database={"url": url, "migration_url": url})
    assert s.database_url == url
    assert PASSWORD not in repr(s) and PASSWORD not in str(s.database)
    with pytest.raises(ConfigError) as err:
        load_settings(database={"url": url, "url_file": str(tmp_path / "u")})
    assert PASSWORD not in err.value.diagnostics()


@pytest.mark.parametrize("role", ["Kvgov", "kvgov-rt", "a b", '"x"', "x" * 64])
def test_runtime_role_must_be_a_plain_role_name(role: str) -> None:
    with pytest.raises(ConfigError, match=r"database\.runtime_role"):
        load_settings(database={"runtime_role": role})


def test_an_engine_id_a_receipt_would_show_as_the_lm_engine_is_refused() -> None:
    """A receipt names the lm:// engine ``lm:<id>``: no wire engine id may begin so; the error
    says which setting and why, never the token."""
    with pytest.raises(ConfigError, match=r'dataplane\.engine_tokens.*begins with "lm:"') as exc:
        load_settings(dataplane={"engine_tokens": {"t0ken-value": "lm:10.0.0.5"}})
    assert "t0ken-value" not in exc.value.diagnostics()
    assert load_settings(dataplane={"engine_tokens": {"t0ken-value": "vllm-lm:0"}})


@pytest.mark.parametrize("engine", ["lm\n2", "lm\u202e", " lm", "x" * 129])
def test_the_lm_engine_id_is_printable_text(engine: str) -> None:
    with pytest.raises(ConfigError, match=r"dataplane\.lm_engine_id"):
        load_settings(dataplane={"lm_engine_id": engine})
    assert load_settings(dataplane={"lm_engine_id": "lm-demo"}).dataplane.lm_engine_id


def test_a_token_file_read_again_leaves_out_only_the_refused_entries(tmp_path: Path) -> None:
    """What a running sidecar takes from a changed file: the valid entries, and why the others
    were left out (never the token or the id); start-up refuses the same file."""
    import json

    path = tmp_path / "engine-tokens.json"
    path.write_text(json.dumps({"t0k-a": "vllm-a", "t0k-b": "LM:b", "t0k-c": "c\u200b"}))
    s = load_settings(dataplane={"engine_tokens_file": path})
    tokens, refused = s.read_engine_tokens()
    assert {t: e.get_secret_value() for t, e in tokens.items()} == {"t0k-a": "vllm-a"}
    assert len(refused) == 2
    assert not any("t0k" in r or "LM:b" in r for r in refused)
    with pytest.raises(ConfigError, match="2 engine id"):
        _ = s.engine_tokens

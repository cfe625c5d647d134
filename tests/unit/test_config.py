"""Settings: defaults, sources and their precedence, unknown keys, unsafe combinations."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvgov.config import load_settings
from kvgov.errors import ConfigError
from kvgov.types import Environment


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


def test_production_accepts_a_safe_configuration(tmp_path: Path) -> None:
    s = load_settings(
        environment="production",
        database={"url": "postgresql+psycopg://kvgov@db/kvgov"},
        keys={"kek_path": str(tmp_path / "kek.key")},
        dataplane={"engine_tokens": {"t0ken-value": "engine-a"}},
    )
    assert s.production_problems() == []

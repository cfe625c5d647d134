"""The Redis tier's URL is a secret: hidden in reprs and dumps, and it can come from a file
(``tiers.redis_url_file``) exactly as ``database.url`` does from ``database.url_file``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvgov.config import Settings, load_settings
from kvgov.connectors.tiers.factory import build_tiers
from kvgov.errors import ConfigError, KvgovError

# the Secrets these tests write are their user's alone, as kvgov requires
pytestmark = pytest.mark.usefixtures("private_umask")

PASSWORD = "r3dis-pa55-never-shown"
URL = f"redis://:{PASSWORD}@redis.internal:6379/0"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("KVGOV_") and not name.startswith("KVGOV_TEST_"):
            monkeypatch.delenv(name)


def test_redis_password_stays_out_of_repr_and_dumps() -> None:
    s = Settings(tiers={"redis_url": URL})  # type: ignore[arg-type]
    assert s.redis_url == URL
    assert PASSWORD not in repr(s)
    assert PASSWORD not in str(s)
    assert PASSWORD not in repr(s.tiers)
    assert PASSWORD not in str(s.model_dump())
    assert PASSWORD not in s.model_dump_json()


def test_redis_url_defaults_to_the_local_redis() -> None:
    s = load_settings()
    assert s.redis_url == "redis://127.0.0.1:6379/0"
    assert s.tiers.redis_url_file is None


def test_redis_url_file_is_read_and_stripped(tmp_path: Path) -> None:
    url_file = tmp_path / "redis-url"
    url_file.write_text(f"  {URL}\n\n")
    s = load_settings(tiers={"redis_url_file": str(url_file)})
    assert s.redis_url == URL
    assert PASSWORD not in repr(s) and PASSWORD not in str(s.model_dump())
    url_file.write_text("redis://:rotated@redis.internal:6379/1")  # read when used
    assert s.redis_url == "redis://:rotated@redis.internal:6379/1"


def test_redis_url_file_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url_file = tmp_path / "redis-url"
    url_file.write_text(URL)
    monkeypatch.setenv("KVGOV_TIERS__REDIS_URL_FILE", str(url_file))
    assert load_settings().redis_url == URL


def test_redis_url_and_its_file_are_exclusive(tmp_path: Path) -> None:
    url_file = tmp_path / "redis-url"
    url_file.write_text(URL)
    with pytest.raises(ConfigError, match=r"tiers\.redis_url or tiers\.redis_url_file") as err:
        load_settings(tiers={"redis_url": URL, "redis_url_file": str(url_file)})
    assert PASSWORD not in err.value.diagnostics()


def test_missing_redis_url_file_names_the_file(tmp_path: Path) -> None:
    absent = tmp_path / "absent"
    s = load_settings(tiers={"redis_url_file": str(absent)})
    with pytest.raises(ConfigError, match=r"cannot read tiers\.redis_url_file .*absent"):
        _ = s.redis_url


def test_empty_redis_url_file_names_the_file(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("  \n")
    s = load_settings(tiers={"redis_url_file": str(empty)})
    with pytest.raises(ConfigError, match=r"tiers\.redis_url_file .*empty is empty"):
        _ = s.redis_url


def test_unreadable_redis_url_file_never_shows_its_content(tmp_path: Path) -> None:
    binary = tmp_path / "not-text"
    binary.write_bytes(PASSWORD.encode() + b"\xff\xfe")  # not UTF-8
    s = load_settings(tiers={"redis_url_file": str(binary)})
    with pytest.raises(ConfigError) as err:
        _ = s.redis_url
    assert "not-text" in err.value.diagnostics()
    assert PASSWORD not in err.value.diagnostics()


async def test_bad_redis_url_file_stops_building_the_tiers(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("")
    s = load_settings(
        data_dir=str(tmp_path), tiers={"chain": ["memory", "redis"], "redis_url_file": str(empty)}
    )
    with pytest.raises(ConfigError, match=r"tiers\.redis_url_file .*empty is empty"):
        await build_tiers(s)


async def test_unreachable_redis_error_does_not_show_the_password(tmp_path: Path) -> None:
    url_file = tmp_path / "redis-url"
    url_file.write_text(f"redis://:{PASSWORD}@127.0.0.1:1/0\n")
    s = load_settings(
        data_dir=str(tmp_path),
        tiers={"chain": ["memory", "redis"], "redis_url_file": str(url_file)},
    )
    with pytest.raises(KvgovError, match="tier redis failed to start") as err:
        await build_tiers(s)
    assert PASSWORD not in err.value.diagnostics()


@pytest.mark.redis
async def test_redis_tier_from_a_url_file_round_trips(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    url_file = tmp_path / "redis-url"
    url_file.write_text(f"\n  {redis_url}  \n")
    s = load_settings(
        data_dir=str(tmp_path),
        tiers={
            "chain": ["memory", "redis"],
            "redis_url_file": str(url_file),
            "redis_prefix": redis_prefix,
        },
    )
    chain = await build_tiers(s)
    try:
        await chain.put("k", b"value-through-redis", allowed={"redis"})
        assert await chain.where("k") == ["redis"]
        assert await chain.tiers[1].get("k") == b"value-through-redis"
    finally:
        await chain.close()

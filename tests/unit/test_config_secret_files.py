"""Secrets read from files (Kubernetes Secrets mounted as files): the sidecar's engine tokens
(``dataplane.engine_tokens_file``) and the connector's engine token (``kvgov.token_file``).
Bad files stop start-up with an error naming the file, never what it holds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvgov.config import load_settings
from kvgov.connectors.lmcache.settings import ConnectorSettings
from kvgov.errors import ConfigError

# the Secrets these tests write are their user's alone, as kvgov requires
pytestmark = pytest.mark.usefixtures("private_umask")

SECRET = "s3cret-t0ken-value"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("KVGOV_") and not name.startswith("KVGOV_TEST_"):
            monkeypatch.delenv(name)


def test_engine_tokens_come_from_a_json_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "engine-tokens.json"
    path.write_text(json.dumps({SECRET: "vllm-0"}))
    monkeypatch.setenv("KVGOV_DATAPLANE__ENGINE_TOKENS_FILE", str(path))
    s = load_settings()
    tokens = s.engine_tokens
    assert list(tokens) == [SECRET]
    assert tokens[SECRET].get_secret_value() == "vllm-0"
    assert SECRET not in repr(s)


def test_a_token_file_satisfies_production_without_a_socket(tmp_path: Path) -> None:
    path = tmp_path / "engine-tokens.json"
    path.write_text(json.dumps({SECRET: "vllm-0"}))
    s = load_settings(dataplane={"engine_tokens_file": path, "unix_path": None})
    assert not any("engine tokens" in p for p in s.production_problems())
    bare = load_settings(dataplane={"unix_path": None})
    assert any("engine tokens" in p for p in bare.production_problems())


def test_tokens_and_a_token_file_together_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not both"):
        load_settings(
            dataplane={"engine_tokens": {"a": "e"}, "engine_tokens_file": tmp_path / "t.json"}
        )


@pytest.mark.parametrize(
    ("content", "error"),
    [
        (None, "cannot read"),
        ("", "not JSON"),
        (f"{SECRET}: vllm-0", "not JSON"),
        ("{}", "holds no tokens"),
        (json.dumps([SECRET]), "holds no tokens"),
        (json.dumps({SECRET: 7}), "engine id"),
        (json.dumps({SECRET: ""}), "engine id"),
        (json.dumps({SECRET: "vllm-0"})[:-1] + ', "\\ud83d": "x"}', "not text"),
        (json.dumps({SECRET: "\ud800"}), "surrogate"),
        (json.dumps({SECRET: "lm:10.0.0.5"}), 'begins with "lm:"'),
        (json.dumps({SECRET: "vllm-0", "other": "lm:vllm-1"}), 'engine id.*begins with "lm:"'),
        ("[" * 100_000, "not JSON"),
    ],
)
def test_a_bad_token_file_stops_startup_naming_the_file_not_its_content(
    tmp_path: Path, content: str | None, error: str
) -> None:
    path = tmp_path / "engine-tokens.json"
    if content is not None:
        path.write_text(content)
    s = load_settings(dataplane={"engine_tokens_file": path})
    with pytest.raises(ConfigError, match=error) as exc:
        _ = s.engine_tokens
    assert str(path) in str(exc.value)
    assert SECRET not in exc.value.diagnostics()


def test_connector_reads_its_token_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(f"  {SECRET}\n")
    cfg = ConnectorSettings.from_extra_config(
        {"kvgov.endpoint": "unix:///run/kvgov/data.sock", "kvgov.token_file": str(path)}
    )
    assert cfg.token == SECRET


@pytest.mark.parametrize(
    ("extra", "error"),
    [
        ({"kvgov.token": SECRET, "kvgov.token_file": "/nonexistent"}, "not both"),
        ({"kvgov.token_file": "/nonexistent/token"}, "cannot read"),
        ({"kvgov.token_file": "EMPTY"}, "is empty"),
    ],
)
def test_connector_token_file_errors(tmp_path: Path, extra: dict[str, str], error: str) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n")
    extra = {k: (str(empty) if v == "EMPTY" else v) for k, v in extra.items()}
    with pytest.raises(ConfigError, match=error) as exc:
        ConnectorSettings.from_extra_config({"kvgov.endpoint": "tcp://127.0.0.1:7070", **extra})
    assert SECRET not in exc.value.diagnostics()


@pytest.mark.parametrize(
    ("raw", "uids"),
    [(None, None), ([65532], {65532}), ("1000, 65532", {1000, 65532}), (0, {0})],
)
def test_connector_sidecar_uids(raw: object, uids: set[int] | None) -> None:
    extra: dict[str, object] = {"kvgov.endpoint": "unix:///run/kvgov/data.sock"}
    if raw is not None:
        extra["kvgov.sidecar_uids"] = raw
    cfg = ConnectorSettings.from_extra_config(extra)
    assert cfg.sidecar_uids == (frozenset(uids) if uids is not None else None)


@pytest.mark.parametrize("raw", [[], "", "root", [-1], [True], "1,x"])
def test_connector_sidecar_uids_must_be_uids(raw: object) -> None:
    with pytest.raises(ConfigError, match=r"kvgov\.sidecar_uids"):
        ConnectorSettings.from_extra_config(
            {"kvgov.endpoint": "unix:///run/kvgov/data.sock", "kvgov.sidecar_uids": raw}
        )


@pytest.mark.parametrize(
    ("content", "refused"),
    [("{}", 0), (json.dumps({SECRET: "lm:vllm-0"}), 1), (json.dumps({SECRET: " vllm-0"}), 1)],
    ids=["empty-object", "lm-id", "blank-id"],
)
def test_a_running_sidecar_reads_a_token_file_left_with_no_token_as_every_token_revoked(
    tmp_path: Path, content: str, refused: int
) -> None:
    """(review r16, finding 3) The last token removed from the file: a running sidecar reads
    no tokens (and revokes them all) where start-up refuses the file."""
    path = tmp_path / "engine-tokens.json"
    path.write_text(content)
    s = load_settings(dataplane={"engine_tokens_file": path})
    tokens, why = s.read_engine_tokens(revoke_all=True)
    assert tokens == {}
    assert len(why) == refused
    assert not any(SECRET in r or "vllm-0" in r for r in why)
    with pytest.raises(ConfigError, match="holds no"):
        _ = s.engine_tokens


@pytest.mark.parametrize(
    "content",
    [
        "",
        '{"' + SECRET + '": ',  # half written
        json.dumps([SECRET]),
        "null",
        json.dumps({SECRET: 7}),
        json.dumps({SECRET: ""}),
        json.dumps({SECRET: "vllm-0"})[:-1] + ', "\\ud83d": "x"}',
        "[" * 100_000,
    ],
    ids=["empty", "half-written", "list", "null", "number", "empty-id", "surrogate", "deep"],
)
def test_a_token_file_that_does_not_read_is_refused_even_when_running(
    tmp_path: Path, content: str
) -> None:
    """What does not read is refused whole (the tokens in force stay), never taken as the
    revocation of every token: a file caught half-way is not an operator's intent."""
    path = tmp_path / "engine-tokens.json"
    path.write_text(content)
    s = load_settings(dataplane={"engine_tokens_file": path})
    with pytest.raises(ConfigError) as exc:
        s.read_engine_tokens(revoke_all=True)
    assert str(path) in str(exc.value)
    assert SECRET not in exc.value.diagnostics()

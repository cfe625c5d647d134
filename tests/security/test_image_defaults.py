"""The sidecar image's defaults rank below an operator's ``--config`` file (review r16, finding
5), and a development sidecar with a network listener says so when it starts.

The image used to bake its defaults into ``ENV`` (``KVGOV_API__HOST=0.0.0.0``,
``KVGOV_DATAPLANE__UNIX_PATH=/var/lib/kvgov/run/data.sock`` & co.), and the environment ranks
above the TOML file: ``kvgov serve --config kvgov.toml`` saying ``api.host = "127.0.0.1"``
(behind a TLS proxy) served on every interface, ``dataplane.host = ""`` left the TCP wire on and
a ``unix_path`` moved where the engine does not look, each silently. Without
``KVGOV_ENVIRONMENT`` that image is a development sidecar: any engine id admitted without a
token on the pod's shared loopback, with nothing in its log to say so.

Who: an operator who configures the image with a file (a manifest of one's own, ``podman run``
with a mounted ``kvgov.toml``): the settings they wrote are not the ones that run. The door
holds when the image's defaults are a file read below ``--config`` and the environment (the
shipped manifests' ``KVGOV_*`` still win), the image's ``ENV`` names no setting, and ``kvgov
serve`` warns in development whenever it listens on a network. Offline: the Containerfile is
read here (its ``ENV`` and what it copies), so these tests follow it; ``tests/e2e/test_image.py``
runs the built image.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from kvgov.config import load_settings
from kvgov.errors import ConfigError
from kvgov.types import Environment
from tests.integration.test_deploy_manifests import OVERLAYS, containers, one, render
from tests.security.test_image_lock import ROOT, _stages

#: the one variable the image may set: where its defaults file is (not a setting)
DEFAULTS_ENV = "KVGOV_DEFAULTS_FILE"

#: what the image has always run with when nothing else says (docs/deploy.md, "The sidecar
#: image"): the state volume, the socket in it, the loopback TCP wire, lm:// off, the API on
#: every address of the pod
IMAGE_DEFAULTS = {
    "data_dir": Path("/var/lib/kvgov"),
    "dataplane.host": "127.0.0.1",
    "dataplane.port": 7070,
    "dataplane.unix_path": Path("/var/lib/kvgov/run/data.sock"),
    "dataplane.lm_port": -1,
    "api.host": "0.0.0.0",
    "api.port": 7080,
}


def image_env() -> dict[str, str]:
    """The ``KVGOV_*`` variables the runtime stage's ``ENV`` instructions set."""
    env: dict[str, str] = {}
    for ins in _stages()["runtime"]:
        if ins.startswith("ENV "):
            for item in shlex.split(ins.removeprefix("ENV ")):
                name, _, value = item.partition("=")
                env[name] = value
    return {k: v for k, v in env.items() if k.startswith("KVGOV_")}


def image_copies() -> dict[str, Path]:
    """What the runtime stage copies from the build context: its path in the image -> the
    checkout's file."""
    out: dict[str, Path] = {}
    for ins in _stages()["runtime"]:
        if not ins.startswith("COPY ") or "--from=" in ins:
            continue
        args = [a for a in shlex.split(ins.removeprefix("COPY ")) if not a.startswith("--")]
        *sources, dest = args
        for src in sources:
            into = dest + Path(src).name if dest.endswith("/") else dest
            out[into] = ROOT / src
    return out


def as_the_image(monkeypatch: pytest.MonkeyPatch, **extra: str) -> None:
    """The environment of a container of the image: every ``KVGOV_*`` of the host's cleared,
    the image's ``ENV`` set (its defaults file, where it names one, read from the checkout),
    then ``extra`` (what a manifest or ``podman run -e`` adds)."""
    for name in list(os.environ):
        if name.startswith("KVGOV_") and not name.startswith("KVGOV_TEST_"):
            monkeypatch.delenv(name)
    copies = image_copies()
    for name, value in {**image_env(), **extra}.items():
        in_image = name == DEFAULTS_ENV and value in copies
        monkeypatch.setenv(name, str(copies[value]) if in_image else value)


def setting(settings: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        settings = getattr(settings, part)
    return settings


def operator_toml(tmp_path: Path) -> Path:
    """An operator's ``kvgov.toml``: the API behind a TLS proxy on loopback, the socket only,
    where the engine's pod mounts it."""
    cfg = tmp_path / "kvgov.toml"
    cfg.write_text(
        '[api]\nhost = "127.0.0.1"\nport = 9080\n'
        '[dataplane]\nhost = ""\nunix_path = "/run/kvgov/data.sock"\n'
    )
    return cfg


def test_a_config_file_beats_the_images_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    as_the_image(monkeypatch)
    s = load_settings(operator_toml(tmp_path))
    assert s.api.host == "127.0.0.1", (
        "the image's KVGOV_API__HOST silently overrides the config file"
    )
    assert s.api.port == 9080, "the image's KVGOV_API__PORT silently overrides the config file"
    assert s.dataplane.host == "", (
        "the image's KVGOV_DATAPLANE__HOST keeps the TCP wire on against the config file"
    )
    assert s.dataplane.unix_path == Path("/run/kvgov/data.sock"), (
        "the image's KVGOV_DATAPLANE__UNIX_PATH moves the socket away from where the config"
        " file (and the engine) put it"
    )
    # what the file does not say still comes from the image
    assert s.data_dir == IMAGE_DEFAULTS["data_dir"]
    assert s.dataplane.lm_port == -1


def test_the_image_env_names_no_setting() -> None:
    """Whatever the image's ``ENV`` sets ranks above every ``--config`` file: it may name
    where its defaults are, never a setting."""
    settings = sorted(k for k in image_env() if k != DEFAULTS_ENV)
    assert settings == [], (
        f"the image's ENV sets {settings}: each silently overrides an operator's --config file;"
        " put the image's defaults in its defaults file (lowest priority)"
    )


def test_the_images_defaults_apply_when_nothing_else_says(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    as_the_image(monkeypatch)
    s = load_settings()
    got = {name: setting(s, name) for name in IMAGE_DEFAULTS}
    assert got == IMAGE_DEFAULTS
    assert s.environment is Environment.DEVELOPMENT  # the embedded default, unchanged


def test_the_environment_still_beats_the_config_file_and_the_images_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    as_the_image(
        monkeypatch,
        KVGOV_API__HOST="::1",
        KVGOV_DATAPLANE__UNIX_PATH="/tmp/elsewhere.sock",
        KVGOV_DATA_DIR="/srv/kvgov",
    )
    s = load_settings(operator_toml(tmp_path))
    assert s.api.host == "::1"
    assert s.dataplane.unix_path == Path("/tmp/elsewhere.sock")
    assert s.data_dir == Path("/srv/kvgov")
    assert s.api.port == 9080  # the file, where the environment says nothing


def test_keyword_overrides_beat_everything(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    as_the_image(monkeypatch, KVGOV_API__PORT="9180")
    s = load_settings(operator_toml(tmp_path), api={"port": 9280})
    assert s.api.port == 9280


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_shipped_manifests_env_still_wins(
    overlay: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The manifests configure the image with ``KVGOV_*`` (ConfigMap ``kvgov-settings`` and the
    container's ``env``): each of those wins over the image's defaults."""
    from tests.security.test_deploy_doors import container_env

    docs = render(overlay)
    pod = one(docs, "Deployment", "kvgov-inference")["spec"]["template"]["spec"]
    env = {
        k: v
        for k, v in container_env(docs, pod, containers(pod)["kvgov"]).items()
        if k.startswith("KVGOV_") and not v.startswith("from-")
    }
    as_the_image(monkeypatch, **env)
    s = load_settings()
    assert s.dataplane.unix_path == Path(env["KVGOV_DATAPLANE__UNIX_PATH"])
    assert s.dataplane.host == env["KVGOV_DATAPLANE__HOST"]
    assert s.api.host == env["KVGOV_API__HOST"]
    assert s.data_dir == Path(env["KVGOV_DATA_DIR"])


def test_the_defaults_file_is_built_into_the_image() -> None:
    """The image copies the file its ``ENV`` names, from the build context."""
    path = image_env().get(DEFAULTS_ENV)
    assert path, f"the image names no defaults file ({DEFAULTS_ENV})"
    source = image_copies().get(path)
    assert source is not None, f"the runtime stage copies nothing to {path}"
    assert source.is_file(), source
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    assert f"!{source.relative_to(ROOT)}" in ignore, ".dockerignore leaves it out of the context"


def test_a_missing_or_broken_defaults_file_stops_start_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fail closed: an image whose defaults file is gone (a volume mounted over it) or broken
    does not start on the embedded defaults instead."""
    as_the_image(monkeypatch, **{DEFAULTS_ENV: str(tmp_path / "absent.toml")})
    with pytest.raises(ConfigError, match="defaults file not found"):
        load_settings()
    bad = tmp_path / "bad.toml"
    bad.write_text("[api\nhost = 1\n")
    monkeypatch.setenv(DEFAULTS_ENV, str(bad))
    with pytest.raises(ConfigError, match=re.escape(f"defaults file {bad} is not valid TOML")):
        load_settings()
    bad.write_text("[api]\nhots = '127.0.0.1'\n")
    with pytest.raises(ConfigError, match=r"api\.hots"):
        load_settings()
    # an empty value: no defaults file (what the environment says is all there is)
    monkeypatch.setenv(DEFAULTS_ENV, "")
    assert load_settings().api.host == "127.0.0.1"


# -- kvgov serve in development says what development allows --------------------------


class _StopError(Exception):
    """Stands in for building the sidecar: start-up goes no further."""


def _serve_until_build(settings: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``kvgov serve``'s start (``run_sidecar``) up to building the sidecar, which stops."""
    from kvgov.proxy import app

    async def stop(*_: Any, **__: Any) -> Any:
        raise _StopError

    monkeypatch.setattr(app, "build_sidecar", stop)
    with pytest.raises(_StopError):
        asyncio.run(app.run_sidecar(settings))


def _warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.levelno == logging.WARNING and r.getMessage() == "sidecar.development"
    ]


def test_serve_warns_when_the_image_runs_a_development_sidecar(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    as_the_image(monkeypatch)  # no KVGOV_ENVIRONMENT: development
    settings = load_settings()
    caplog.set_level(logging.INFO)
    _serve_until_build(settings, monkeypatch)
    found = _warnings(caplog)
    assert found, (
        "kvgov serve starts a development sidecar on the loopback TCP wire (any engine id"
        " admitted without a token) and the API on 0.0.0.0 without a warning"
    )
    record: Any = found[0]
    listeners = " ".join(record.listeners)
    assert "tcp://127.0.0.1:7070" in listeners
    assert "http://0.0.0.0:7080" in listeners
    allows = " ".join(record.allows)
    assert "without a token" in allows
    assert "environment" in record.hint


def test_serve_does_not_warn_outside_development_nor_without_a_network_listener(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    as_the_image(monkeypatch)
    # the socket only, the API on loopback: nothing beyond this process's own user and pod
    quiet = load_settings(dataplane={"host": ""}, api={"host": "127.0.0.1"}, data_dir=tmp_path)
    caplog.set_level(logging.INFO)
    _serve_until_build(quiet, monkeypatch)
    assert _warnings(caplog) == []
    # the same listeners in production: no warning either
    noisy = load_settings(data_dir=tmp_path)
    assert noisy.environment is Environment.DEVELOPMENT
    prod = noisy.model_copy(update={"environment": Environment.PRODUCTION})
    _serve_until_build(prod, monkeypatch)
    assert _warnings(caplog) == []

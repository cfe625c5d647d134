"""The local KEK file: generation, permission checks, production refusal, wrap/unwrap binding."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from kvgov.config import Settings
from kvgov.errors import KeyManagementError, StartupError
from kvgov.keys.kek import FileKekProvider, generate_kek_file, load_kek_provider, read_kek_file
from kvgov.types import Environment


def test_generated_file_is_0600_and_marked_auto_generated(tmp_path: Path) -> None:
    path = generate_kek_file(tmp_path / "sub" / "kek.key")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    parsed = read_kek_file(path)
    assert parsed.auto_generated
    assert len(parsed.key) == 32
    assert parsed.kek_id.startswith("file:")
    assert path.read_text().startswith("# kvgov-kek 1 auto-generated ")


def test_generate_never_overwrites(tmp_path: Path) -> None:
    path = generate_kek_file(tmp_path / "kek.key")
    before = path.read_bytes()
    with pytest.raises(KeyManagementError, match="already exists"):
        generate_kek_file(path)
    assert generate_kek_file(path, exist_ok=True) == path
    assert path.read_bytes() == before


def test_generate_ignores_a_permissive_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        path = generate_kek_file(tmp_path / "kek.key")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660, 0o700 | 0o007])
def test_loose_permissions_are_refused(tmp_path: Path, mode: int) -> None:
    path = generate_kek_file(tmp_path / "kek.key")
    path.chmod(mode)
    with pytest.raises(StartupError, match="loose permissions") as info:
        FileKekProvider(path)
    assert "chmod 600" in info.value.diagnostics()


def test_missing_file_is_a_startup_error(tmp_path: Path) -> None:
    with pytest.raises(StartupError, match="not found"):
        FileKekProvider(tmp_path / "absent.key")


def test_not_a_kek_file(tmp_path: Path) -> None:
    path = tmp_path / "kek.key"
    path.write_text("hello\n")
    path.chmod(0o600)
    with pytest.raises(StartupError, match="not a kvgov KEK file"):
        FileKekProvider(path)


def test_auto_generated_kek_refused_in_production(tmp_path: Path) -> None:
    path = generate_kek_file(tmp_path / "kek.key")
    with pytest.raises(StartupError, match="auto-generated"):
        FileKekProvider(path, environment=Environment.PRODUCTION)
    # a provisioned file (no auto-generated marker) is accepted
    text = path.read_text().replace(" auto-generated ", " provisioned ")
    path.write_text(text)
    provider = FileKekProvider(path, environment=Environment.PRODUCTION)
    assert provider.kek_id == read_kek_file(path).kek_id


def test_load_from_settings(tmp_path: Path) -> None:
    path = generate_kek_file(tmp_path / "kek.key")
    settings = Settings(data_dir=tmp_path)
    provider = load_kek_provider(settings)
    assert provider.kek_id == read_kek_file(path).kek_id


def test_wrap_round_trip_and_aad_binding(tmp_path: Path) -> None:
    provider = FileKekProvider(generate_kek_file(tmp_path / "kek.key"))
    dek = os.urandom(32)
    wrapped = provider.wrap(dek, b"t:acme|1|acme")
    assert dek not in wrapped
    assert provider.unwrap(wrapped, b"t:acme|1|acme") == dek
    with pytest.raises(KeyManagementError, match="does not unwrap"):
        provider.unwrap(wrapped, b"t:other|1|other")
    flipped = bytearray(wrapped)
    flipped[20] ^= 1
    with pytest.raises(KeyManagementError, match="does not unwrap"):
        provider.unwrap(bytes(flipped), b"t:acme|1|acme")
    with pytest.raises(KeyManagementError, match="malformed"):
        provider.unwrap(wrapped[:10], b"t:acme|1|acme")


def test_another_kek_cannot_unwrap(tmp_path: Path) -> None:
    one = FileKekProvider(generate_kek_file(tmp_path / "a.key"))
    two = FileKekProvider(generate_kek_file(tmp_path / "b.key"))
    wrapped = one.wrap(os.urandom(32), b"aad")
    with pytest.raises(KeyManagementError):
        two.unwrap(wrapped, b"aad")

"""The trusted keys of ledger verification: their formats, where they come from, and bad ones
stopping start-up (the database side is in ``tests/security/test_rekeyed_rewrite.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kvgov.config import Settings, load_settings
from kvgov.errors import ConfigError
from kvgov.ledger.chain import generate_signing_key_file, load_public_key, public_key_bytes
from kvgov.ledger.trust import format_public_key, read_keys_file, trusted_keys


def _key() -> tuple[bytes, str]:
    raw = public_key_bytes(Ed25519PrivateKey.generate())
    return raw, format_public_key(raw)


def test_own_key_and_configured_keys_are_trusted(tmp_path: Path) -> None:
    raw, text = _key()
    settings = Settings(data_dir=tmp_path, ledger={"trusted_keys": [text]})
    assert trusted_keys(settings) == {raw}  # no signing key yet: only the configured one
    generate_signing_key_file(settings.signing_key_path)
    own = load_public_key(settings.signing_key_path)
    assert trusted_keys(settings) == {raw, own}


def test_a_keys_file_takes_lines_comments_and_pem(tmp_path: Path) -> None:
    one, one_text = _key()
    two_private = Ed25519PrivateKey.generate()
    pem = (
        two_private.public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        .decode()
    )
    path = tmp_path / "fleet.keys"
    path.write_text(f"# the fleet\n{one_text}  # node-a\n\n{pem}")
    assert read_keys_file(path) == [one, public_key_bytes(two_private)]
    settings = Settings(data_dir=tmp_path, ledger={"trusted_keys_file": path})
    assert trusted_keys(settings) == {one, public_key_bytes(two_private)}


@pytest.mark.parametrize(
    "text", ["not-base64!", "ed25519:" + "A" * 8, "ed25519:" + "QUJD" * 20, ""]
)
def test_a_malformed_key_is_a_config_error(text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGOV_LEDGER__TRUSTED_KEYS", json.dumps([text]))
    with pytest.raises(ConfigError, match=r"ledger\.trusted_keys"):
        load_settings()


def test_a_bad_keys_file_names_the_line(tmp_path: Path) -> None:
    _, good = _key()
    path = tmp_path / "fleet.keys"
    path.write_text(f"{good}\nssh-ed25519 AAAA... someone\n")
    settings = Settings(data_dir=tmp_path, ledger={"trusted_keys_file": path})
    with pytest.raises(ConfigError, match="line 2"):
        trusted_keys(settings)
    missing = Settings(data_dir=tmp_path, ledger={"trusted_keys_file": tmp_path / "nope"})
    with pytest.raises(ConfigError, match="cannot read"):
        trusted_keys(missing)
    path.write_text("-----BEGIN PUBLIC KEY-----\nAAAA\n")
    with pytest.raises(ConfigError, match="not closed"):
        trusted_keys(settings)

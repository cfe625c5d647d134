"""``--user-file``: the id read once, and the confirmation names what will be destroyed.

Review 5, finding C: ``kvgov keys shred --user-file F`` asked to destroy "EVERY key of tenant
... (user keys included)" while it shredded only that user's keys (the question was built from
``--user``, empty with ``--user-file``): an operator could not tell a user shred from a tenant
shred by reading it.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvgov.cli.main import build_app
from kvgov.db.engine import make_engine, upgrade
from kvgov.db.keystore import SqlKeyStore
from kvgov.ledger.pseudonym import Pseudonymizer, generate_pseudonym_key_file
from kvgov.types import KeyState, WrappedKey


def test_a_user_file_shred_asks_about_that_user_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    for name in [k for k in os.environ if k.startswith("KVGOV_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("KVGOV_DATABASE_URL", url)
    monkeypatch.setenv("KVGOV_DATA_DIR", str(tmp_path))
    upgrade(url)
    generate_pseudonym_key_file(tmp_path / "pseudonym.key")
    alice = Pseudonymizer.from_file(tmp_path / "pseudonym.key").user("acme", "alice")
    engine = make_engine(url)
    store = SqlKeyStore(engine)
    for user in (alice, None):
        store.add(
            WrappedKey(
                key_id=f"acme:{user or 'tenant'}",
                version=1,
                tenant="acme",
                user=user,
                state=KeyState.ACTIVE,
                wrapped=b"x" * 40,
                kek_id="k",
                created_at=datetime.now(UTC),
                usage_count=0,
                destroyed_at=None,
            )
        )
    id_file = tmp_path / "subject"
    id_file.write_text("alice\n")
    result = CliRunner().invoke(
        build_app(),
        ["keys", "shred", "--tenant", "acme", "--user-file", str(id_file)],
        input="n\n",
    )
    assert "Destroy the keys of user 'alice' in tenant 'acme' (1 versions)" in result.output
    assert "EVERY key" not in result.output
    assert result.exit_code != 0  # declined: nothing destroyed
    assert {r.state for r in store.versions("acme")} == {KeyState.ACTIVE}
    engine.dispose()

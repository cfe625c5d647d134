"""``kvgov purge`` end to end as an operator runs it, with no sidecar (a CLI-only deployment):
real ``kvgov init``, Postgres ledger, filesystem tier, key files and sealed chunks; the CLI runs
in a subprocess exactly as installed.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy.orm import Session

from kvgov.config import Settings, load_settings
from kvgov.connectors.tiers.filesystem import FilesystemTier
from kvgov.db.engine import make_engine
from kvgov.db.keystore import SqlKeyStore
from kvgov.db.models import PurgeReceipt
from kvgov.errors import KeyDestroyedError
from kvgov.keys.kek import FileKekProvider
from kvgov.keys.keyring import Keyring
from kvgov.ledger.chain import load_signing_key
from kvgov.ledger.events import EntryChange, Event
from kvgov.ledger.pseudonym import Pseudonymizer
from kvgov.ledger.writer import LedgerWriter
from kvgov.types import EntryState, EventKind, Scope

pytestmark = pytest.mark.postgres

N = 5


def _env(pg_url: str, data_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGOV_")}
    env.update(
        {
            "KVGOV_DATABASE_URL": pg_url,
            "KVGOV_DATA_DIR": str(data_dir),
            "KVGOV_TIERS__CHAIN": '["memory", "filesystem"]',
            "KVGOV_TIERS__FILESYSTEM_FSYNC": "false",
            "KVGOV_PURGE__POLL_INTERVAL_S": "0.05",
            "KVGOV_PURGE__JOB_TIMEOUT_S": "20",
            "KVGOV_PURGE__HTTP_TIMEOUT_S": "2",
            "KVGOV_LOG_LEVEL": "warning",
            "LMCACHE_TRACK_USAGE": "false",
        }
    )
    env.update(extra)
    return env


def kvgov(env: dict[str, str], *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvgov", *args],
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


async def _seed(
    settings: Settings, who: list[tuple[str, str]]
) -> dict[tuple[str, str], dict[str, bytes]]:
    """Put chunks the way the data plane does: sealed, in the filesystem tier, with kv:put."""
    engine = make_engine(settings.database_url)
    writer = LedgerWriter(
        engine, chain_id="seed-sidecar", signing_key=load_signing_key(settings.signing_key_path)
    )
    await writer.start()
    keyring = Keyring(SqlKeyStore(engine), FileKekProvider(settings.kek_path))
    pseudo = Pseudonymizer.from_file(settings.pseudonym_key_path)
    fs = await FilesystemTier.open(settings.filesystem_tier_path, fsync=False)
    out: dict[tuple[str, str], dict[str, bytes]] = {}
    try:
        for tenant, user in who:
            p = pseudo.user(tenant, user)
            chunks: dict[str, bytes] = {}
            for i in range(N):
                digest = pseudo.key_digest(f"m@1@0@{i:x}@bfloat16@tenant%{tenant}@user%{user}")
                sealed = keyring.seal(tenant, digest.encode(), os.urandom(3000), user=p)
                handle = keyring.current(tenant, p)
                await fs.put(digest, sealed)
                chunks[digest] = bytes(sealed)
                await writer.append(
                    Event(
                        kind=EventKind.KV_PUT,
                        tenant=tenant,
                        actor=p,
                        key_digest=digest,
                        payload={"note": f"about {user}"},
                        entry=EntryChange(
                            key_digest=digest,
                            state=EntryState.LIVE,
                            tenant=tenant,
                            owner=p,
                            scope_user=p,
                            scope=Scope.USER,
                            size=3000,
                            tiers=("filesystem",),
                            key_id=handle.key_id,
                            key_version=handle.version,
                        ),
                    )
                )
            out[(tenant, user)] = chunks
    finally:
        await writer.close()
        await fs.close()
        engine.dispose()
    return out


@pytest.fixture
def deployment(
    pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[dict[str, str], Settings]:
    env = _env(pg_url, tmp_path / "kvgov")
    done = kvgov(env, "init")
    assert done.returncode == 0, done.stderr
    for name in [k for k in os.environ if k.startswith("KVGOV_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        if name.startswith("KVGOV_"):
            monkeypatch.setenv(name, value)
    return env, load_settings()


def _files(settings: Settings, digests: dict[str, bytes]) -> int:
    async def count() -> int:
        fs = await FilesystemTier.open(settings.filesystem_tier_path, fsync=False)
        try:
            return sum([await fs.contains(d) for d in digests])
        finally:
            await fs.close()

    return asyncio.run(count())


def test_cli_purge_takes_the_user_id_on_standard_input(
    deployment: tuple[dict[str, str], Settings], tmp_path: Path
) -> None:
    """A raw user id on the command line is kept by the platform (the API server's audit log
    for ``kubectl exec``, ``/proc/<pid>/cmdline``): ``--user-file -`` takes it on standard
    input. A file with no id never widens a user's purge to the whole tenant."""
    env, settings = deployment
    data = asyncio.run(_seed(settings, [("acme", "alice"), ("acme", "bob")]))
    alice, bob = data[("acme", "alice")], data[("acme", "bob")]

    for args, stdin in (
        (("--user-file", "-", "--yes"), ""),  # no id at all: not a tenant purge
        (("--user-file", "-", "--yes"), "\n"),
        (("--user-file", "-", "--yes"), "alice\nbob\n"),  # two lines: which one?
        (("--user-file", "-", "--user", "alice", "--yes"), "alice\n"),  # both: which one?
        (("--user-file", "-"), "alice\n"),  # stdin holds the id: no room for a "y"
    ):
        refused = kvgov(env, "purge", "--tenant", "acme", *args, stdin=stdin)
        assert refused.returncode == 2, (args, stdin, refused.stdout + refused.stderr)
        assert _files(settings, alice) == N and _files(settings, bob) == N
    shred = kvgov(env, "keys", "shred", "--tenant", "acme", "--user-file", "-", "--yes", stdin="")
    assert shred.returncode == 2, shred.stdout + shred.stderr

    plan = kvgov(
        env, "purge", "--tenant", "acme", "--user-file", "-", "--dry-run", "--json", stdin="alice"
    )
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout)["entries_in_scope"] == N
    done = kvgov(env, "purge", "--tenant", "acme", "--user-file", "-", "--yes", stdin="alice\n")
    assert done.returncode == 0, done.stdout + done.stderr
    assert _files(settings, alice) == 0
    assert _files(settings, bob) == N

    id_file = tmp_path / "subject"
    id_file.write_text("bob\n")
    id_file.chmod(0o600)
    reuse = kvgov(env, "provenance", "--tenant", "acme", "--user-file", str(id_file), "--json")
    assert reuse.returncode == 0, reuse.stdout + reuse.stderr


def test_cli_purge_user_end_to_end(
    deployment: tuple[dict[str, str], Settings], tmp_path: Path
) -> None:
    env, settings = deployment
    data = asyncio.run(_seed(settings, [("acme", "alice"), ("acme", "bob"), ("globex", "alice")]))
    alice, bob, other = data[("acme", "alice")], data[("acme", "bob")], data[("globex", "alice")]

    # --dry-run: reports what would go, changes nothing
    dry = kvgov(env, "purge", "--user", "alice", "--tenant", "acme", "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    plan = json.loads(dry.stdout)
    assert plan["entries_in_scope"] == N
    assert plan["present_in_reachable_tiers"] == {"filesystem": N}
    assert len(plan["keys_to_destroy"]) == 1
    assert _files(settings, alice) == N

    # no --yes and the operator says no: nothing happens, non-zero exit
    refused = kvgov(env, "purge", "--user", "alice", "--tenant", "acme", stdin="n\n")
    assert refused.returncode != 0
    assert "no record of user" not in refused.stderr  # alice is known: no warning
    assert _files(settings, alice) == N

    # a misspelt id (the gateway sent "alice") would purge nothing: said before it is confirmed
    typo = kvgov(env, "purge", "--user", "Alice", "--tenant", "acme", "--dry-run")
    assert typo.returncode == 0, typo.stderr
    assert "no record of this user id" in typo.stdout and "1 other spelling" in typo.stdout
    typo = kvgov(env, "purge", "--user", "Alice", "--tenant", "acme", stdin="n\n")
    assert typo.returncode != 0
    assert "has no record of user 'Alice'" in typo.stderr and "1 other spelling" in typo.stderr
    assert _files(settings, alice) == N

    receipt = tmp_path / "receipt.json"
    done = kvgov(
        env, "purge", "--user", "alice", "--tenant", "acme", "--yes", "--receipt", str(receipt)
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "completed" in done.stdout
    assert _files(settings, alice) == 0
    assert _files(settings, bob) == N
    assert _files(settings, other) == N

    # a ciphertext copied aside before the purge cannot be opened any more
    engine = make_engine(settings.database_url)
    try:
        keyring = Keyring(SqlKeyStore(engine), FileKekProvider(settings.kek_path))
        digest, sealed = next(iter(alice.items()))
        with pytest.raises(KeyDestroyedError):
            keyring.open(sealed, tenant="acme", cache_key=digest.encode())
        digest, sealed = next(iter(bob.items()))
        assert keyring.open(sealed, tenant="acme", cache_key=digest.encode())
    finally:
        engine.dispose()

    # the receipt verifies; a tampered one does not; the ledger still verifies
    ok = kvgov(env, "purge", "verify-receipt", str(receipt))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    doc = json.loads(receipt.read_text())
    assert doc["receipt"]["state"] == "completed"
    assert doc["receipt"]["tiers"] == {"filesystem": N}
    doc["receipt"]["tiers"] = {"filesystem": N + 1}
    forged = tmp_path / "forged.json"
    forged.write_text(json.dumps(doc))
    bad = kvgov(env, "purge", "verify-receipt", str(forged))
    assert bad.returncode == 1
    audit = kvgov(env, "audit", "verify")
    assert audit.returncode == 0, audit.stdout + audit.stderr

    # status of the job
    status = kvgov(env, "purge", "status", doc["receipt"]["purge_id"], "--json")
    assert status.returncode == 0
    assert json.loads(status.stdout)["state"] == "completed"

    # the same purge again: harmless, nothing left to delete
    again = kvgov(env, "purge", "--user", "alice", "--tenant", "acme", "--yes", "--json")
    assert again.returncode == 0, again.stderr
    r2 = json.loads(again.stdout)["receipt"]["receipt"]
    assert r2["entries_purged"] == 0
    assert r2["tiers"] == {"filesystem": 0}
    assert r2["keys_destroyed"] == []

    # a receipt is bound to its purge: verify-receipt --purge-id, and status checks it
    first, second = doc["receipt"]["purge_id"], r2["purge_id"]
    own = kvgov(env, "purge", "verify-receipt", str(receipt), "--purge-id", first)
    assert own.returncode == 0, own.stdout + own.stderr
    other = kvgov(env, "purge", "verify-receipt", str(receipt), "--purge-id", second)
    assert other.returncode == 1 and "the receipt of purge" in other.stdout, other.stdout
    assert "receipt signature: valid" in kvgov(env, "purge", "status", second).stdout
    # attack (runtime-role rights: UPDATE purge_receipts): the first purge's validly signed
    # receipt copied onto the second's row; status must not call it the second's
    engine = make_engine(settings.database_url)
    try:
        with Session(engine) as session, session.begin():
            src = session.get(PurgeReceipt, first)
            dst = session.get(PurgeReceipt, second)
            assert src is not None and dst is not None
            dst.receipt, dst.signature = src.receipt, src.signature
    finally:
        engine.dispose()
    swapped = kvgov(env, "purge", "status", second).stdout
    assert "receipt signature: INVALID" in swapped and f"of purge {first}" in swapped, swapped


def test_cli_purge_unreachable_engine_is_incomplete(
    deployment: tuple[dict[str, str], Settings], tmp_path: Path
) -> None:
    env, settings = deployment
    asyncio.run(_seed(settings, [("acme", "alice")]))
    env = {**env, "KVGOV_PURGE__VLLM_ENGINES": '["http://127.0.0.1:9"]'}
    receipt = tmp_path / "receipt.json"
    done = kvgov(
        env, "purge", "--user", "alice", "--tenant", "acme", "--yes", "--receipt", str(receipt)
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "incomplete" in done.stdout
    doc = json.loads(receipt.read_text())["receipt"]
    assert doc["state"] == "incomplete"
    assert any("127.0.0.1:9" in line for line in doc["incomplete"])
    # the signature still holds: an incomplete receipt is an honest one
    assert kvgov(env, "purge", "verify-receipt", str(receipt)).returncode == 0

"""``kvgov keys`` end to end on Postgres: ciphertext copied aside is dead after a shred, other
tenants and users are unaffected, the ledger records it, list never shows material."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, select
from typer.testing import CliRunner

from kvgov.cli.main import build_app
from kvgov.config import Settings
from kvgov.db.engine import make_engine, upgrade
from kvgov.db.keystore import SqlKeyStore
from kvgov.db.models import DataKey, LedgerEvent, table
from kvgov.errors import KeyDestroyedError, KeyManagementError
from kvgov.keys.kek import FileKekProvider, generate_kek_file
from kvgov.keys.keyring import Keyring
from kvgov.keys.sealed import parse_header
from kvgov.ledger.chain import generate_signing_key_file
from kvgov.ledger.pseudonym import Pseudonymizer, generate_pseudonym_key_file
from kvgov.ledger.verify import verify
from kvgov.types import EventKind, KeyState

pytestmark = pytest.mark.postgres

CK = b"llama|chunk-42"


@pytest.fixture
def cfg(tmp_path: Path, pg_url: str, monkeypatch: pytest.MonkeyPatch) -> Settings:
    monkeypatch.setenv("KVGOV_DATA_DIR", str(tmp_path / "kvgov"))
    monkeypatch.setenv("KVGOV_DATABASE_URL", pg_url)
    settings = Settings()
    upgrade(pg_url)
    generate_signing_key_file(settings.signing_key_path)
    generate_pseudonym_key_file(settings.pseudonym_key_path)
    generate_kek_file(settings.kek_path)
    return settings


@pytest.fixture
def engine(cfg: Settings) -> Iterator[Engine]:
    eng = make_engine(cfg.database_url, pool_size=2)
    yield eng
    eng.dispose()


def keyring(cfg: Settings, engine: Engine) -> Keyring:
    """A sidecar's keyring: its own process state, the shared database and KEK."""
    return Keyring(SqlKeyStore(engine), FileKekProvider(cfg.kek_path))


def kvgov(*args: str, input: str | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(build_app(), list(args), input=input, catch_exceptions=False)
    return result.exit_code, result.output


def ledger_rows(engine: Engine, kind: EventKind) -> list[dict[str, object]]:
    t = table(LedgerEvent)
    with engine.connect() as conn:
        rows = conn.execute(select(t).where(t.c.kind == str(kind)).order_by(t.c.seq)).all()
    return [dict(r._mapping) for r in rows]


def test_shred_a_user_then_the_tenant(cfg: Settings, engine: Engine, tmp_path: Path) -> None:
    alice = Pseudonymizer.from_file(cfg.pseudonym_key_path).user("acme", "alice@example.com")
    ring = keyring(cfg, engine)
    data = {
        "alice": os.urandom(50_000),
        "bob": os.urandom(5000),
        "acme": os.urandom(7000),
        "globex": os.urandom(7000),
    }
    sealed = {
        "alice": ring.seal("acme", CK, data["alice"], user=alice),
        "bob": ring.seal("acme", CK, data["bob"], user="bob-pseudonym"),
        "acme": ring.seal("acme", CK, data["acme"]),
        "globex": ring.seal("globex", CK, data["globex"]),
    }
    aside = tmp_path / "aside"
    aside.mkdir()
    for name, blob in sealed.items():  # an attacker's (or a backup's) copy of the ciphertext
        (aside / name).write_bytes(blob)

    # without --yes it asks, and "no" changes nothing
    code, out = kvgov(
        "keys", "shred", "--tenant", "acme", "--user", "alice@example.com", input="n\n"
    )
    assert code == 1 and "Destroy the keys of user" in out
    assert keyring(cfg, engine).open(sealed["alice"], tenant="acme", cache_key=CK) == data["alice"]

    code, out = kvgov("keys", "shred", "--tenant", "acme", "--user", "alice@example.com", "--yes")
    assert code == 0, out
    assert f"u:acme:{alice} v1" in out
    assert "alice@example.com" not in out

    fresh = keyring(cfg, engine)  # a process that never saw the keys
    with pytest.raises(KeyDestroyedError, match="was destroyed"):
        fresh.open((aside / "alice").read_bytes(), tenant="acme", cache_key=CK)
    assert fresh.open((aside / "bob").read_bytes(), tenant="acme", cache_key=CK) == data["bob"]
    assert fresh.open((aside / "acme").read_bytes(), tenant="acme", cache_key=CK) == data["acme"]
    assert (
        fresh.open((aside / "globex").read_bytes(), tenant="globex", cache_key=CK) == data["globex"]
    )
    # the running sidecar's keyring drops its in-memory copy when it shreds the same scope
    assert ring.shred("acme", alice) == []
    with pytest.raises(KeyDestroyedError):
        ring.open(sealed["alice"], tenant="acme", cache_key=CK)

    shredded = ledger_rows(engine, EventKind.KEY_SHREDDED)
    assert [(r["tenant"], r["actor"], r["attrs"]) for r in shredded] == [
        ("acme", alice, {"key_id": f"u:acme:{alice}", "version": 1}),
    ]
    assert shredded[0]["principal"] == "cli" and shredded[0]["outcome"] == "ok"

    # the whole tenant: every remaining acme key, user keys included; globex untouched
    code, out = kvgov("keys", "shred", "--tenant", "acme", "--dry-run")
    assert code == 0 and "would destroy" in out and "t:acme v1" in out
    code, out = kvgov("keys", "shred", "--tenant", "acme", "--yes", "--json")
    assert code == 0, out
    report = json.loads(out)
    assert sorted(k["key_id"] for k in report["destroyed"]) == ["t:acme", "u:acme:bob-pseudonym"]
    assert len(report["ledger"]) == 4  # the two versions requested, then confirmed destroyed
    fresh = keyring(cfg, engine)
    for name in ("alice", "bob", "acme"):
        with pytest.raises(KeyDestroyedError):
            fresh.open((aside / name).read_bytes(), tenant="acme", cache_key=CK)
    assert (
        fresh.open((aside / "globex").read_bytes(), tenant="globex", cache_key=CK) == data["globex"]
    )
    shredded = ledger_rows(engine, EventKind.KEY_SHREDDED)
    assert len(shredded) == 3 and {r["outcome"] for r in shredded} == {"ok"}

    # each confirmation follows its request on the run's chain (r17 F2)
    def at(rows: list[dict[str, object]]) -> dict[tuple[object, str], object]:
        return {(r["chain_id"], json.dumps(r["attrs"], sort_keys=True)): r["seq"] for r in rows}

    asked, done = at(ledger_rows(engine, EventKind.KEY_SHRED_REQUESTED)), at(shredded)
    assert asked.keys() == done.keys()
    assert all(asked[k] < done[k] for k in done)  # type: ignore[operator]
    code, out = kvgov("keys", "shred", "--tenant", "acme", "--yes")
    assert code == 0 and "nothing to destroy" in out
    assert verify(engine).ok


def test_rotate_and_list(cfg: Settings, engine: Engine) -> None:
    ring = keyring(cfg, engine)
    old = ring.seal("globex", CK, b"v1 data" * 100)
    code, out = kvgov("keys", "rotate", "--tenant", "globex")
    assert code == 0, out
    assert "t:globex: new writes use v2" in out
    fresh = keyring(cfg, engine)
    new = fresh.seal("globex", CK, b"v2 data")
    assert parse_header(new).key_version == 2
    assert fresh.open(old, tenant="globex", cache_key=CK) == b"v1 data" * 100
    rotated = ledger_rows(engine, EventKind.KEY_ROTATED)
    assert [r["attrs"] for r in rotated] == [{"key_id": "t:globex", "version": 2}]

    ring.flush_usage()  # a sidecar adds its usage counts in batches (and on close)
    code, out = kvgov("keys", "list", "--tenant", "globex", "--json")
    assert code == 0, out
    listed = json.loads(out)
    assert [(k["version"], k["state"], k["usage_count"]) for k in listed] == [
        (1, KeyState.RETIRED, 1),
        (2, KeyState.ACTIVE, 0),  # the new process has not flushed its usage yet
    ]
    assert all("wrapped" not in k for k in listed)
    for row in SqlKeyStore(engine).versions("globex"):
        assert row.wrapped is not None
        assert base64.b64encode(row.wrapped).decode() not in out
        assert row.wrapped.hex() not in out
    code, out = kvgov("keys", "list")
    assert code == 0 and "t:globex" in out and "retired" in out
    # a user key of a new tenant, rotated from the CLI: created, then rotated
    code, out = kvgov("keys", "rotate", "--tenant", "initech", "--user", "carol")
    assert code == 0 and "v1" in out
    assert verify(engine).ok


def test_bad_usage(cfg: Settings) -> None:
    code, _ = kvgov("keys", "shred", "--yes")
    assert code == 2


@pytest.mark.parametrize("command", ["shred", "rotate"])
def test_a_run_that_cannot_record_changes_nothing(
    cfg: Settings, engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    """r15 F6: without a readable signing key the command refuses before touching the store,
    so no shred or rotation exists that the ledger does not record."""
    ring = keyring(cfg, engine)
    sealed = ring.seal("acme", CK, b"acme data")
    before = [(r.key_id, r.version, r.state) for r in SqlKeyStore(engine).versions("acme")]
    monkeypatch.setenv("KVGOV_LEDGER__SIGNING_KEY_PATH", str(tmp_path / "missing.key"))
    args = ["keys", command, "--tenant", "acme"] + (["--yes"] if command == "shred" else [])
    code, out = kvgov(*args)
    after = [(r.key_id, r.version, r.state) for r in SqlKeyStore(engine).versions("acme")]
    assert after == before, (
        f"kvgov keys {command} changed acme's keys although it could not record it"
        f" (exit {code}): {before} -> {after}; {out}"
    )
    assert code == 2, out
    assert "nothing was changed" in out
    assert keyring(cfg, engine).open(sealed, tenant="acme", cache_key=CK) == b"acme data"
    assert ledger_rows(engine, EventKind.KEY_SHREDDED) == []
    assert ledger_rows(engine, EventKind.KEY_ROTATED) == []


@pytest.mark.parametrize(
    "failure",
    [
        KeyManagementError("canceling statement due to lock timeout"),  # or a dropped connection
        KeyboardInterrupt(),  # the operator gives up on a destroy that waits for a lock
    ],
    ids=["store-error", "ctrl-c"],
)
def test_a_shred_that_fails_after_it_was_recorded_is_chained_as_failed(
    cfg: Settings, engine: Engine, monkeypatch: pytest.MonkeyPatch, failure: BaseException
) -> None:
    """r17 F2: the request is chained before the store changes (r15 F6), but a destroy that
    then fails must not leave ``key:shredded`` saying the keys are gone while they still open
    the data: only a destroy that returned is chained ``ok``; one that raised (Ctrl-C too) is
    chained ``outcome=error`` naming the versions left, and the run exits non-zero."""
    sealed = keyring(cfg, engine).seal("acme", CK, b"acme data")
    live = [(r.key_id, r.version) for r in SqlKeyStore(engine).versions("acme")]

    def destroy(self: SqlKeyStore, tenant: str, user: str | None = None) -> list[object]:
        raise failure

    monkeypatch.setattr(SqlKeyStore, "destroy", destroy)
    result = CliRunner().invoke(build_app(), ["keys", "shred", "--tenant", "acme", "--yes"])
    shredded = ledger_rows(engine, EventKind.KEY_SHREDDED)
    done = [r for r in shredded if r["outcome"] == "ok"]
    still = keyring(cfg, engine).open(sealed, tenant="acme", cache_key=CK)
    assert not (done and still == b"acme data"), (
        f"key:shredded chained ok ({len(done)} row(s)) but acme's key still opens its data"
        f" (exit {result.exit_code})"
    )
    assert result.exit_code != 0, result.output
    assert type(result.exception) is type(failure) or isinstance(failure, KeyboardInterrupt)
    assert "NOT shredded" in result.output, result.output
    # the request and its failure, both chained, name the same versions
    requested = ledger_rows(engine, EventKind.KEY_SHRED_REQUESTED)
    assert [(r["attrs"]["key_id"], r["attrs"]["version"]) for r in requested] == live  # type: ignore[index]
    failed = [r for r in shredded if r["outcome"] == "error"]
    assert [(r["attrs"]["key_id"], r["attrs"]["version"]) for r in failed] == live  # type: ignore[index]
    assert failed[0]["principal"] == "cli" and failed[0]["tenant"] == "acme"
    assert failed[0]["seq"] > requested[-1]["seq"]  # type: ignore[operator]
    assert [r.state for r in SqlKeyStore(engine).versions("acme")] == [KeyState.ACTIVE]
    monkeypatch.undo()
    assert verify(engine).ok


@pytest.mark.parametrize("lock", ["times-out", "is-released"])
def test_ctrl_c_on_a_shred_waiting_for_a_lock_chains_what_the_store_did(
    cfg: Settings, engine: Engine, lock: str
) -> None:
    """r17 F2, the real thing: someone holds acme's key rows ``FOR UPDATE``, the destroy waits,
    the operator presses Ctrl-C. The thread cannot be stopped (the process would wait for it at
    exit anyway), so the run waits for the store's answer and chains that: a lock timeout is a
    failed shred (exit non-zero, ``outcome=error``, the data still opens); a lock released
    after the Ctrl-C lets the destroy finish, and that is a shred (``ok``, the data is dead)."""
    sealed = keyring(cfg, engine).seal("acme", CK, b"acme data")
    t = table(DataKey)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    if lock == "times-out":
        env["PGOPTIONS"] = "-c lock_timeout=3s"
    with engine.connect() as holder:
        holder.begin()
        holder.execute(select(t).where(t.c.tenant == "acme").with_for_update()).all()
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvgov", "keys", "shred", "--tenant", "acme", "--yes"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            deadline = time.monotonic() + 30
            while not ledger_rows(engine, EventKind.KEY_SHRED_REQUESTED):  # the destroy waits
                assert proc.poll() is None and time.monotonic() < deadline, proc.poll()
                time.sleep(0.1)
            time.sleep(0.5)
            proc.send_signal(signal.SIGINT)
            if lock == "is-released":
                time.sleep(0.5)
                holder.rollback()
            out, _ = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert "interrupted" in out, out
    shredded = [(r["outcome"], r["attrs"]) for r in ledger_rows(engine, EventKind.KEY_SHREDDED)]
    if lock == "times-out":
        assert proc.returncode != 0 and "NOT shredded" in out, out
        assert shredded == [("error", {"key_id": "t:acme", "version": 1})], out
        assert keyring(cfg, engine).open(sealed, tenant="acme", cache_key=CK) == b"acme data"
    else:
        assert proc.returncode == 0 and "destroyed:" in out, out
        assert shredded == [("ok", {"key_id": "t:acme", "version": 1})], out
        with pytest.raises(KeyDestroyedError):
            keyring(cfg, engine).open(sealed, tenant="acme", cache_key=CK)
    assert verify(engine).ok

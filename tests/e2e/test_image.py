"""The sidecar image as a platform runs it: read-only root, its own non-root user, production
settings, secrets as read-only files, migrations run by the image itself (``kvgov db
upgrade`` as the owner role, the Kubernetes Job's command), then a real LMCache engine on the
host (CPU) through the container's Unix socket: store, retrieve byte for byte from a second
engine, a cross-tenant miss, and ``kvgov purge --user`` (run in the container, as an operator
would with ``kubectl exec``) that reaches the container's tiers and the engines.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("lmcache")

from kvgov.ledger.chain import generate_signing_key_file
from kvgov.ledger.pseudonym import generate_pseudonym_key_file
from tests import lmcache_harness as h
from tests.e2e import containers as c
from tests.pgroles import RoleDatabase, role_database
from tests.security.doors import provisioned_kek

pytestmark = [
    pytest.mark.container,
    pytest.mark.lmcache,
    pytest.mark.postgres,
    pytest.mark.slow,
]

G = h.Geometry()
TOKENS = {"t0ken-engine-a-0123456789": "engine-a", "t0ken-engine-b-0123456789": "engine-b"}
SECRETS = "/etc/kvgov/secrets"


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvi-"))  # short: the Unix socket lives under it
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _secrets(base: Path, db: RoleDatabase) -> Path:
    """What the Kubernetes Secrets hold, as files the image's user can read (0400)."""
    out = c.owned_dir(base / "secrets", 0o500)
    work = base / "work"
    work.mkdir()
    provisioned_kek(work / "kek.key")
    generate_signing_key_file(work / "signing.key")
    generate_pseudonym_key_file(work / "pseudonym.key")
    for name in ("kek.key", "signing.key", "pseudonym.key"):
        c.secret_file(out / name, (work / name).read_bytes())
    c.secret_file(out / "database-url", db.runtime_url)
    c.secret_file(out / "migration-url", db.owner_url)
    c.secret_file(out / "engine-tokens.json", json.dumps(TOKENS))
    policy = json.loads((c.ROOT / "src/kvgov/policy/rego/data.json").read_text())
    engines = sorted(TOKENS.values())
    policy["tenants"] = {
        "acme": {"enabled": True, "engines": engines},
        "globex": {"enabled": True, "engines": engines},
    }
    c.secret_file(out / "policy-data.json", json.dumps(policy))
    return out


def _env(db: RoleDatabase, api_port: int) -> list[str]:
    env = {
        "KVGOV_ENVIRONMENT": "production",
        "KVGOV_PURGE__NO_GPU_PREFIX_CACHE": "true",  # no vLLM here
        "KVGOV_LOG_LEVEL": "warning",
        "KVGOV_DATABASE__URL_FILE": f"{SECRETS}/database-url",
        "KVGOV_DATABASE__MIGRATION_URL_FILE": f"{SECRETS}/migration-url",
        "KVGOV_DATABASE__RUNTIME_ROLE": db.runtime,
        "KVGOV_KEYS__KEK_PATH": f"{SECRETS}/kek.key",
        "KVGOV_LEDGER__SIGNING_KEY_PATH": f"{SECRETS}/signing.key",
        "KVGOV_LEDGER__PSEUDONYM_KEY_PATH": f"{SECRETS}/pseudonym.key",
        "KVGOV_LEDGER__CHAIN_ID": "image-test-0",
        "KVGOV_DATAPLANE__ENGINE_TOKENS_FILE": f"{SECRETS}/engine-tokens.json",
        "KVGOV_DATAPLANE__HOST": "",  # the Unix socket only
        "KVGOV_POLICY__DATA_FILE": f"{SECRETS}/policy-data.json",
        # loopback (the host network): plain HTTP is refused beyond it in production without
        # TLS (test_kube_play runs the manifests' TLS)
        "KVGOV_API__HOST": "127.0.0.1",
        "KVGOV_API__PORT": str(api_port),
        "KVGOV_TIERS__FILESYSTEM_FSYNC": "false",
        "KVGOV_TIERS__FILESYSTEM_MAX_BYTES": str(2 << 30),  # production refuses it unbounded
        "KVGOV_PURGE__POLL_INTERVAL_S": "0.1",
        "KVGOV_PURGE__JOB_TIMEOUT_S": "60",
    }
    return [arg for k, v in env.items() for arg in ("-e", f"{k}={v}")]


def _run_args(base: Path, secrets: Path) -> list[str]:
    """How a platform runs it: read-only root (no tmpfs either), the image's own user, no
    capabilities, no privilege escalation, one writable volume, secrets read-only."""
    state = c.owned_dir(base / "state")
    return [
        "--read-only",
        "--read-only-tmpfs=false",
        "--cap-drop=ALL",
        "--security-opt=no-new-privileges",
        "--network=host",
        "-v",
        f"{state}:/var/lib/kvgov",
        "-v",
        f"{secrets}:{SECRETS}:ro",
    ]


def test_image_runs_read_only_as_non_root_and_governs_a_real_engine(
    kvgov_image: str, base: Path
) -> None:
    with role_database() as db:
        secrets = _secrets(base, db)
        api_port = h.free_port()
        run = _run_args(base, secrets)
        env = _env(db, api_port)
        name = f"kvgov-image-test-{base.name}"

        # the migration Job's command, from the image, as the owner role
        up = c.podman("run", "--rm", *run, *env, kvgov_image, "db", "upgrade", check=False)
        assert up.returncode == 0, up.stdout + up.stderr
        try:
            c.podman("run", "-d", "--name", name, *run, *env, kvgov_image)
            c.wait_ready(f"http://127.0.0.1:{api_port}/readyz", name)

            info = c.inspect(name)
            assert info["HostConfig"]["ReadonlyRootfs"] is True
            assert c.podman("exec", name, "id", "-u").stdout.strip() == str(c.UID)
            write = c.podman(
                "exec", name, "python3", "-c", "open('/opt/kvgov/x', 'w')", check=False
            )
            assert write.returncode != 0 and "Read-only file system" in write.stderr
            # no setuid or setgid file (the few 0700 folders it cannot read hold none)
            setuid = c.podman(
                "exec", name, "find", "/", "-xdev", "-perm", "/6000", "-type", "f", check=False
            )
            assert setuid.stdout.split() == [], "setuid/setgid files in the image"
            assert all("Permission denied" in line for line in setuid.stderr.splitlines())
            # nor file capabilities (a base's ping and the like gain them at exec without setuid)
            assert c.files_with_capabilities(kvgov_image) == [], "file capabilities in the image"
            for heavy in ("torch", "lmcache"):
                imp = c.podman("exec", name, "python3", "-c", f"import {heavy}", check=False)
                assert imp.returncode != 0, f"{heavy} is in the sidecar image"
            assert c.podman("healthcheck", "run", name, check=False).returncode == 0
            assert c.podman("exec", name, "kvgov", "health").returncode == 0

            _drive_engines(name, base)

            verify = c.podman("exec", name, "kvgov", "audit", "verify", check=False)
            assert verify.returncode == 0, verify.stdout + verify.stderr
            c.podman("stop", "-t", "60", name)
            assert c.inspect(name)["State"]["ExitCode"] == 0  # a graceful stop on SIGTERM
        finally:
            c.remove(name)


def _drive_engines(name: str, base: Path) -> None:
    sock = base / "state" / "run" / "data.sock"
    assert sock.is_socket()
    token_files = []
    for i, token in enumerate(TOKENS):
        path = base / f"engine-token-{i}"
        path.write_text(token + "\n")
        token_files.append(path)
    cfg_a, cfg_b = (
        h.kvgov_config(f"unix://{sock}", engine_id=f"e{i}", extra={"kvgov.token_file": str(p)})
        for i, p in enumerate(token_files)
    )
    alice = h.identity("acme", user_scope="alice", user="alice", request_id="r-a")
    bob = h.identity("acme", user_scope="bob", user="bob", request_id="r-b")
    globex = h.identity("globex", user_scope="alice", user="alice", request_id="r-g")
    alice_toks = h.tokens(2 * G.chunk, seed=41)
    bob_toks = h.tokens(2 * G.chunk, seed=42)
    with h.engines(cfg_a, cfg_b) as (a, b):
        for e in (a, b):
            assert e.remote_connector().control.connected.wait(10)
        a.fill(len(alice_toks), seed=1)
        a.store(alice_toks, alice)
        a.wait_remote_puts()
        stored = a.kv_bytes(len(alice_toks))
        a.fill(len(bob_toks), seed=2)
        a.store(bob_toks, bob)
        a.wait_remote_puts()

        b.zero()
        assert b.retrieve(alice_toks, alice) == len(alice_toks)
        assert b.kv_bytes(len(alice_toks)) == stored  # byte for byte, through the container
        assert b.lookup(alice_toks, globex) == 0  # another tenant: a miss

        done = c.podman(
            "exec", name, "kvgov", "purge", "--user", "alice", "--tenant", "acme", "--yes",
            "--json", check=False, timeout=180,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        receipt = json.loads(done.stdout)["receipt"]["receipt"]
        assert receipt["state"] == "completed", receipt
        assert receipt["entries_purged"] == len(alice_toks) // G.chunk
        assert receipt["sidecars"] == ["image-test-0"]
        for e in (a, b):
            assert e.lookup(alice_toks, alice) == 0
        assert b.lookup(bob_toks, bob) == len(bob_toks)  # bob's chunks are untouched

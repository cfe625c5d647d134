"""The sidecar image with a Redis tier (attacker review: the image installed kvgov without its
``redis`` extra, so a sidecar configured with a Redis tier, as ``docs/deploy.md`` and
``docs/tiers.md`` describe, refused to start: "the redis package is not installed").

The image as a platform runs it (read-only root, its own user, no capabilities, production
settings, secrets as files), its tier chain **only** Redis (this host's, 127.0.0.1:6379: the
container uses the host network; its URL from a Secret file, ``tiers.redis_url_file``), so the
put can land nowhere else and the get is served from Redis: ready with the tier connected, a
put through the container's Unix socket stored in Redis under the configured prefix as
ciphertext only, and read back byte for byte. No LMCache engine: the wire client stands in.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvgov.ledger.chain import generate_signing_key_file
from kvgov.ledger.pseudonym import generate_pseudonym_key_file
from kvgov.wire.client import WireClient
from kvgov.wire.messages import RequestContext
from tests.e2e import containers as c
from tests.pgroles import RoleDatabase, role_database
from tests.security.doors import key, provisioned_kek

pytestmark = [pytest.mark.container, pytest.mark.postgres, pytest.mark.redis, pytest.mark.slow]

TOKEN = "t0ken-image-redis-0123456789"
ENGINE = "engine-redis"
SECRETS = "/etc/kvgov/secrets"
CHUNK = bytes(range(256)) * 64


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvr-"))  # short: the Unix socket lives under it
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _secrets(base: Path, db: RoleDatabase, redis_url: str) -> Path:
    """What the Kubernetes Secrets hold, the Redis URL among them, readable by uid 10001."""
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
    c.secret_file(out / "redis-url", redis_url)
    c.secret_file(out / "engine-tokens.json", json.dumps({TOKEN: ENGINE}))
    policy = json.loads((c.ROOT / "src/kvgov/policy/rego/data.json").read_text())
    policy["tenants"] = {"acme": {"enabled": True, "engines": [ENGINE]}}
    c.secret_file(out / "policy-data.json", json.dumps(policy))
    return out


def _env(db: RoleDatabase, api_port: int, prefix: str) -> list[str]:
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
        "KVGOV_LEDGER__CHAIN_ID": "image-redis-0",
        "KVGOV_DATAPLANE__ENGINE_TOKENS_FILE": f"{SECRETS}/engine-tokens.json",
        "KVGOV_DATAPLANE__HOST": "",  # the Unix socket only
        "KVGOV_POLICY__DATA_FILE": f"{SECRETS}/policy-data.json",
        "KVGOV_API__HOST": "127.0.0.1",
        "KVGOV_API__PORT": str(api_port),
        # Redis only: nothing else can hold the put or serve the get
        "KVGOV_TIERS__CHAIN": '["redis"]',
        "KVGOV_TIERS__REDIS_URL_FILE": f"{SECRETS}/redis-url",
        "KVGOV_TIERS__REDIS_PREFIX": prefix,
    }
    return [arg for k, v in env.items() for arg in ("-e", f"{k}={v}")]


def _run_args(base: Path, secrets: Path) -> list[str]:
    """Read-only root (no tmpfs), the image's user, no capabilities, host network."""
    state = c.owned_dir(base / "state")
    return [
        "--read-only",
        "--read-only-tmpfs=false",
        "--cap-drop=ALL",
        "--security-opt=no-new-privileges",
        "--network=host",
        "--no-healthcheck",
        "-v",
        f"{state}:/var/lib/kvgov",
        "-v",
        f"{secrets}:{SECRETS}:ro",
    ]


def test_image_serves_a_redis_tier_round_trip(
    kvgov_image: str, base: Path, redis_url: str, redis_prefix: str
) -> None:
    import redis

    with role_database() as db:
        secrets = _secrets(base, db, redis_url)
        api_port = c.free_port()
        run = _run_args(base, secrets)
        env = _env(db, api_port, redis_prefix)
        name = f"kvgov-image-redis-{base.name}"

        up = c.podman("run", "--rm", *run, *env, kvgov_image, "db", "upgrade", check=False)
        assert up.returncode == 0, up.stdout + up.stderr
        try:
            c.podman("run", "-d", "--name", name, *run, *env, kvgov_image)
            # ready means every configured tier connected (a Redis tier PINGs at start)
            c.wait_ready(f"http://127.0.0.1:{api_port}/readyz", name)
            imp = c.podman("exec", name, "python3", "-c", "import hiredis, redis", check=False)
            assert imp.returncode == 0, imp.stderr

            client = WireClient(f"unix://{base / 'state/run/data.sock'}", engine_id=ENGINE,
                                token=TOKEN)  # fmt: skip
            alice = RequestContext(request_id="r-alice", user="alice")
            try:
                ack = client.put(key(1, "acme", "alice"), CHUNK, alice)
                assert ack.ok, ack

                # in Redis, under the prefix, sealed: never the chunk's bytes
                r = redis.Redis.from_url(redis_url)
                try:
                    stored = list(r.scan_iter(match=redis_prefix + "*", count=1000))
                    assert len(stored) == 1, stored
                    value = r.get(stored[0])
                finally:
                    r.close()
                assert isinstance(value, bytes) and len(value) > len(CHUNK)
                assert CHUNK[:64] not in value

                got = client.get(key(1, "acme", "alice"), alice)
                assert got is not None and got[0] == CHUNK
            finally:
                client.close()
        finally:
            c.remove(name)

"""The Kubernetes pod spec, run: ``podman kube play`` of the kvgov sidecar from the rendered
production overlay (``kubectl kustomize deploy/kubernetes/overlays/production``), two such
pods sharing one Postgres ledger, their migration done first by the overlay's Job command.

Taken as rendered: the kvgov and kvgov-keys containers (image, command, args, ConfigMap
settings, the chain id from the pod's name, securityContext, volume mounts), the pod's
volumes and securityContext, the settings and policy ConfigMaps, the Job's command.

Changed, because podman is not a cluster and nothing can be pulled here: no vLLM and no OPA
container (kvgov uses its embedded Rego engine; no GPU prefix cache to reset); the sidecar
runs as a regular container (podman 4.3 knows no native sidecars); the pods use the host
network (the ledger is this host's Postgres; each API gets its own port, no probes or port
mappings; the test waits for /readyz over TLS, trusting the CA that signed the API's
certificate in Secret kvgov-api-tls); the socket's emptyDir is a host folder (the test stands
in for vLLM); Secrets are
projected into host folders as the kubelet projects them (podman 4.3 writes kube Secrets
still base64-encoded); each emptyDir gets a per-pod name (podman 4.3 would share it).

A put through each pod's socket, then ``kvgov purge --user`` started in pod A removes the
user's data from both pods' tiers; each pod's chain verifies under the fleet's signing key.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import ssl
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvgov.ledger.chain import generate_signing_key_file
from kvgov.ledger.pseudonym import generate_pseudonym_key_file
from kvgov.wire.client import WireClient
from kvgov.wire.messages import RequestContext
from tests.e2e import containers as c
from tests.pgroles import RoleDatabase, role_database
from tests.security.doors import TlsIdentity, key, provisioned_kek, tls_identity

pytestmark = [pytest.mark.container, pytest.mark.postgres, pytest.mark.slow]

PODS = ("kvgov-kube-a", "kvgov-kube-b")
TOKEN = "t0ken-kube-play-0123456789"
ENGINE = "vllm"
CHUNK = bytes(range(256)) * 64


def _render() -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: cannot render the Kustomize overlay")
    out = subprocess.run(
        [kubectl, "kustomize", str(c.ROOT / "deploy/kubernetes/overlays/production")],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _secrets(work: Path, db: RoleDatabase, tls: TlsIdentity) -> dict[str, dict[str, bytes]]:
    """What the Secrets hold (docs/deploy.md, "Secrets"; the API's certificate and key as
    ``kubectl create secret tls`` stores them)."""
    provisioned_kek(work / "kek.key")
    generate_signing_key_file(work / "signing.key")
    generate_pseudonym_key_file(work / "pseudonym.key")
    keys = {n: (work / n).read_bytes() for n in ("kek.key", "signing.key", "pseudonym.key")}
    return {
        "kvgov-keys": keys,
        "kvgov-engine-tokens": {
            "engine-tokens.json": json.dumps({TOKEN: ENGINE}).encode(),
            "engine-token": TOKEN.encode(),
        },
        # the ledger is this host's (loopback: no TLS asked); the manifests mount a CA anyway
        "kvgov-database": {"url": db.runtime_url.encode(), "ca.crt": tls.ca.read_bytes()},
        "kvgov-database-owner": {"url": db.owner_url.encode()},
        "kvgov-api-tls": {"tls.crt": tls.cert.read_bytes(), "tls.key": tls.key.read_bytes()},
        # the token kvgov shows OPA (read only with policy.engine=opa; the test runs embedded)
        "kvgov-opa-token": {"token": b"kube-play-opa-token-0123456789abcdef"},
    }


def _project(volume: dict[str, Any], secrets: dict[str, dict[str, bytes]], into: Path) -> None:
    """A Secret volume as the kubelet projects it under fsGroup 10001: its items (or every
    key), owned root:10001, the volume's mode plus group read. podman 4.3 writes a kube
    Secret's values still base64-encoded, so the test projects them itself (a hostPath)."""
    src = volume.pop("secret")
    data = secrets[src["secretName"]]
    items = src.get("items") or [{"key": k, "path": k} for k in data]
    into.mkdir(parents=True)
    for item in items:
        path = into / item["path"]
        path.write_bytes(data[item["key"]])
        os.chown(path, 0, c.UID)
        path.chmod(src.get("defaultMode", 0o644) | 0o040)
    os.chown(into, 0, c.UID)
    into.chmod(0o750)
    volume["hostPath"] = {"path": str(into), "type": "Directory"}


def _pod(
    template: dict[str, Any],
    name: str,
    image: str,
    api_port: int,
    base: Path,
    secrets: dict[str, dict[str, bytes]],
) -> dict[str, Any]:
    spec = copy.deepcopy(template["spec"])
    inits = {ct["name"]: ct for ct in spec["initContainers"]}
    keys, kvgov = inits["kvgov-keys"], inits["kvgov"]
    kvgov.pop("restartPolicy")  # a native sidecar; podman runs it as a container
    for ct in (keys, kvgov):
        ct["image"] = image
    kvgov["env"].append({"name": "KVGOV_API__PORT", "value": str(api_port)})
    spec["initContainers"] = [keys]
    spec["containers"] = [kvgov]
    spec["hostNetwork"] = True
    spec["restartPolicy"] = "Never"
    used = {m["name"] for ct in (keys, kvgov) for m in ct["volumeMounts"]}
    spec["volumes"] = [v for v in spec["volumes"] if v["name"] in used]
    for volume in spec["volumes"]:
        if volume["name"] == "socket":  # the test, in vLLM's place, reaches it from the host
            volume.pop("emptyDir")
            volume["hostPath"] = {"path": str(base / "sock" / name), "type": "Directory"}
            c.owned_dir(base / "sock" / name, 0o750)
        elif "secret" in volume:
            _project(volume, secrets, base / "secrets" / name / volume["name"])
        elif "emptyDir" in volume:  # podman 4.3 names an emptyDir's volume by the volume's
            old = volume["name"]  # name alone: two pods would share one
            volume["name"] = f"{name}-{old}"
            for ct in (keys, kvgov):
                for m in ct["volumeMounts"]:
                    if m["name"] == old:
                        m["name"] = volume["name"]
    for ct in (keys, kvgov):
        # podman's healthchecks need systemd timers (none here; the test polls /readyz), and
        # it maps no ports on the host network
        for field in ("startupProbe", "readinessProbe", "livenessProbe", "ports"):
            ct.pop(field, None)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": template["metadata"]["labels"]},
        "spec": spec,
    }


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvk-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_two_rendered_pods_share_the_ledger_and_a_purge_reaches_both(
    kvgov_image: str, base: Path
) -> None:
    docs = _render()
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    template = deployment["spec"]["template"]
    settings_cm = next(
        d
        for d in docs
        if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("kvgov-settings")
    )
    policy_cm = next(
        d
        for d in docs
        if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("kvgov-policy")
    )
    job = next(d for d in docs if d["kind"] == "Job")["spec"]["template"]["spec"]["containers"][0]
    with role_database() as db:
        settings_cm = copy.deepcopy(settings_cm)
        # podman 4.3 lets envFrom win over env: the per-pod port is the pod's own entry
        port_setting = settings_cm["data"].pop("KVGOV_API__PORT")
        assert port_setting == "7080"
        settings_cm["data"].update(
            {
                "KVGOV_DATABASE__RUNTIME_ROLE": db.runtime,
                "KVGOV_POLICY__ENGINE": "embedded",  # no OPA image here
                "KVGOV_PURGE__VLLM_ENGINES": "[]",  # nor vLLM
                "KVGOV_PURGE__NO_GPU_PREFIX_CACHE": "true",
                "KVGOV_PURGE__POLL_INTERVAL_S": "0.1",
                "KVGOV_PURGE__JOB_TIMEOUT_S": "60",
                "KVGOV_TIERS__FILESYSTEM_FSYNC": "false",
            }
        )
        policy_cm = copy.deepcopy(policy_cm)
        data = json.loads(policy_cm["data"]["data.json"])
        data["tenants"] = {"acme": {"enabled": True, "engines": [ENGINE]}}
        policy_cm["data"]["data.json"] = json.dumps(data)
        work = base / "work"
        work.mkdir()
        tls = tls_identity(work / "tls")  # its certificate names 127.0.0.1
        secrets = _secrets(work, db, tls)
        objects = [settings_cm, policy_cm]
        ports = {name: c.free_port() for name in PODS}
        pods = [_pod(template, n, kvgov_image, ports[n], base, secrets) for n in PODS]
        manifest = base / "kube.yaml"
        manifest.write_text(yaml.safe_dump_all(objects + pods))
        volumes_before = set(c.podman("volume", "ls", "-q").stdout.split())
        try:
            _migrate(job, settings_cm, db, kvgov_image)
            play = c.podman("kube", "play", str(manifest), check=False, timeout=300)
            assert play.returncode == 0, play.stdout + play.stderr
            verify = ssl.create_default_context(cafile=str(tls.ca))
            for name in PODS:
                c.wait_ready(
                    f"https://127.0.0.1:{ports[name]}/readyz", f"{name}-kvgov", context=verify
                )
                # the API answers nothing in the clear; the image's probe speaks its TLS
                assert c.http_status(f"http://127.0.0.1:{ports[name]}/readyz") is None
                health = c.podman("exec", f"{name}-kvgov", "kvgov", "health", check=False)
                assert health.returncode == 0, health.stdout + health.stderr
            _check(base / "sock")
        finally:
            for pod in PODS:  # with their anonymous volumes (the image's VOLUME)
                names = c.podman("ps", "-a", "-q", "--filter", f"pod={pod}", check=False)
                for cid in names.stdout.split():
                    c.podman("rm", "-f", "-v", "-t", "60", cid, check=False, timeout=120)
            c.podman("kube", "down", str(manifest), check=False, timeout=180)
            c.podman("pod", "rm", "-f", *PODS, check=False)
            # podman keeps the volumes of ConfigMaps, emptyDirs and the init containers' image
            # VOLUME: remove those this test made (a volume in use elsewhere is refused)
            made = set(c.podman("volume", "ls", "-q").stdout.split()) - volumes_before
            if made:
                c.podman("volume", "rm", *sorted(made), check=False)


def _migrate(
    job: dict[str, Any], settings_cm: dict[str, Any], db: RoleDatabase, image: str
) -> None:
    """The overlay's Job command, as that Job runs it: the settings, the owner URL file."""
    secrets = c.owned_dir(Path(tempfile.mkdtemp(prefix="kvm-")), 0o700)
    try:
        (secrets / "owner").mkdir()
        (secrets / "runtime").mkdir()
        c.secret_file(secrets / "owner" / "url", db.owner_url)
        c.secret_file(secrets / "runtime" / "url", db.runtime_url)
        env = {**settings_cm["data"], **{e["name"]: e["value"] for e in job["env"]}}
        args = [a for k, v in env.items() for a in ("-e", f"{k}={v}")]
        owner_dir = str(Path(env["KVGOV_DATABASE__MIGRATION_URL_FILE"]).parent)
        runtime_dir = str(Path(env["KVGOV_DATABASE__URL_FILE"]).parent)
        up = c.podman(
            "run", "--rm", "--read-only", "--network=host", "--cap-drop=ALL",
            "-v", f"{secrets / 'owner'}:{owner_dir}:ro",
            "-v", f"{secrets / 'runtime'}:{runtime_dir}:ro",
            "--tmpfs", "/var/lib/kvgov", *args, image, *job["args"],
            check=False, timeout=180,
        )  # fmt: skip
        assert up.returncode == 0, up.stdout + up.stderr
    finally:
        shutil.rmtree(secrets, ignore_errors=True)


def _check(sockets: Path) -> None:
    clients = {
        name: WireClient(f"unix://{sockets / name / 'data.sock'}", engine_id=ENGINE, token=TOKEN)
        for name in PODS
    }
    alice = RequestContext(request_id="r-alice", user="alice")
    bob = RequestContext(request_id="r-bob", user="bob")
    # the engine's control channel to each pod is up while the purge runs: an engine that put
    # the user's data through a sidecar and has none is named unreachable (incomplete)
    channels = [client.control(lambda r: sorted(r.digests)) for client in clients.values()]
    try:
        assert all(channel.connected.wait(10) for channel in channels)
        for i, client in enumerate(clients.values()):
            for chunk, user, ctx in ((i, "alice", alice), (10 + i, "bob", bob)):
                ack = client.put(key(chunk, "acme", user), CHUNK, ctx)
                assert ack.ok, ack
            got = client.get(key(i, "acme", "alice"), alice)
            assert got is not None and got[0] == CHUNK

        purge = c.podman(
            "exec", f"{PODS[0]}-kvgov", "kvgov", "purge", "--user", "alice", "--tenant",
            "acme", "--yes", "--json", check=False, timeout=180,
        )  # fmt: skip
        assert purge.returncode == 0, purge.stdout + purge.stderr
        receipt = json.loads(purge.stdout)["receipt"]["receipt"]
        assert receipt["state"] == "completed", receipt
        assert sorted(receipt["sidecars"]) == sorted(PODS)  # chain ids: the pods' names
        assert receipt["entries_purged"] == len(PODS)
        deadline = time.monotonic() + 10  # each sidecar's key revalidation
        for i, client in enumerate(clients.values()):
            while client.get(key(i, "acme", "alice"), alice) is not None:
                assert time.monotonic() < deadline, "alice's chunk still served"
                time.sleep(0.1)
            assert client.get(key(10 + i, "acme", "bob"), bob) is not None
    finally:
        for channel in channels:
            channel.close()
        for client in clients.values():
            client.close()

    # the fleet's signing key signs every pod's chain head; each chain verifies under it
    sign = c.podman("exec", f"{PODS[0]}-kvgov", "kvgov", "audit", "checkpoint", check=False)
    assert sign.returncode == 0, sign.stdout + sign.stderr
    for pod in PODS:
        assert f"{pod}: " in sign.stdout, sign.stdout
    for name in PODS:
        verify = c.podman(
            "exec", f"{name}-kvgov", "kvgov", "audit", "verify", "--json",
            "--trust-key", "/etc/kvgov/keys/signing.key", check=False,
        )  # fmt: skip
        assert verify.returncode == 0, verify.stdout + verify.stderr
        chains = {ch["chain_id"]: ch for ch in json.loads(verify.stdout)["chains"]}
        for pod in PODS:
            assert chains[pod]["ok"] and chains[pod]["events"] > 0, chains[pod]
            assert chains[pod]["checkpoints"] >= 1, chains[pod]
        assert len({ch["key_fingerprint"] for ch in chains.values()}) == 1

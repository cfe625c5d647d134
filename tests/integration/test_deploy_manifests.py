"""The Kubernetes manifests (``deploy/kubernetes``): every overlay renders with ``kubectl
kustomize``, every rendered object validates against the Kubernetes schemas (strict: unknown
fields are errors) of the oldest release with native sidecars on by default and of the
newest, and the pod spec keeps the promises of docs/deploy.md: a native kvgov sidecar beside
vLLM sharing the socket's emptyDir, probes, a locked-down securityContext on every container,
resources, draining time, settings from a ConfigMap that loads (production: safe), secrets
from Secret files only, per-pod chain ids with fleet-wide keys, a NetworkPolicy that admits
only the compliance namespace to the API and no one to the data ports and lets the pod reach
only DNS, the ledger's Postgres and (production) the OPA bundle server, the migration Job.
"""

from __future__ import annotations

import ipaddress
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from kvgov.config import LOOPBACK_HOSTS, load_settings
from kvgov.types import Environment
from kvgov.urlreach import POSTGRES_CURE

ROOT = Path(__file__).resolve().parents[2]
KUSTOMIZE = ROOT / "deploy" / "kubernetes"
OVERLAYS = ["development", "production"]
#: the CA of the ledger database's server, as the documented URLs' sslrootcert names it
DATABASE_CA = Path(POSTGRES_CURE.rpartition("sslrootcert=")[2])
#: native sidecars are on by default from 1.29 (beta) and GA in 1.33
K8S_VERSIONS = ["1.29.0", "1.37.0"]
#: the egress destinations' selectors (docs/deploy.md names the labels operators set)
KUBE_DNS = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
    "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
}
LEDGER_DATABASE = {
    "namespaceSelector": {"matchLabels": {"kvgov.io/ledger-database": "true"}},
    "podSelector": {"matchLabels": {"kvgov.io/ledger-database": "true"}},
}
BUNDLE_SERVER = {
    "namespaceSelector": {"matchLabels": {"kvgov.io/policy-bundles": "true"}},
    "podSelector": {"matchLabels": {"kvgov.io/policy-bundles": "true"}},
}
RESTRICTED = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "runAsNonRoot": True,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


def render(overlay: str) -> list[dict[str, Any]]:
    return render_dir(KUSTOMIZE / "overlays" / overlay)


def render_dir(path: Path) -> list[dict[str, Any]]:
    """``kubectl kustomize`` of the Kustomization in ``path``."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: cannot render the Kustomize overlays")
    out = subprocess.run(
        [kubectl, "kustomize", str(path)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(params=OVERLAYS, scope="module")
def overlay(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(request.param)


def one(docs: list[dict[str, Any]], kind: str, name_prefix: str = "") -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].startswith(name_prefix)]
    assert len(found) == 1, f"{kind} {name_prefix}: {[d['metadata']['name'] for d in found]}"
    return found[0]


def containers(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in pod.get("initContainers", []) + pod["containers"]}


def settings_env(docs: list[dict[str, Any]], pod: dict[str, Any]) -> dict[str, str]:
    """The kvgov container's environment: its ConfigMap plus its own entries."""
    kvgov = containers(pod)["kvgov"]
    (ref,) = [e["configMapRef"]["name"] for e in kvgov["envFrom"]]
    env = dict(one(docs, "ConfigMap", ref)["data"])
    for e in kvgov.get("env", []):
        env[e["name"]] = e.get("value", f"<{e['valueFrom']}>")
    return env


def test_every_rendered_object_validates(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    import kubernetes_validate

    name, docs = overlay
    kinds = {d["kind"] for d in docs}
    assert {
        "Deployment",
        "Service",
        "NetworkPolicy",
        "Job",
        "ConfigMap",
        "ServiceAccount",
    } <= kinds
    for version in K8S_VERSIONS:
        for doc in docs:
            kubernetes_validate.validate(doc, version, strict=True)  # raises on any error
    namespaces = {d["metadata"].get("namespace") for d in docs}
    assert namespaces == {"kvgov-dev" if name == "development" else "kvgov"}


def test_an_invalid_manifest_is_caught() -> None:
    """The validation above can fail: a misspelt field and a wrong type are both errors."""
    import kubernetes_validate
    from kubernetes_validate.utils import ValidationError

    docs = render("production")
    deployment = json.loads(json.dumps(one(docs, "Deployment")))
    deployment["spec"]["template"]["spec"]["initContainers"][1]["restartPolicy"] = 1
    with pytest.raises(ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[-1], strict=True)
    deployment = json.loads(json.dumps(one(docs, "Deployment")))
    deployment["spec"]["template"]["spec"]["securityContext"]["runAsNonRot"] = True
    with pytest.raises(ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[-1], strict=True)


def test_kvgov_is_a_native_sidecar_beside_vllm_sharing_the_socket(
    overlay: tuple[str, list[dict[str, Any]]],
) -> None:
    _, docs = overlay
    pod = one(docs, "Deployment", "kvgov-inference")["spec"]["template"]["spec"]
    inits = [c["name"] for c in pod["initContainers"]]
    assert inits.index("kvgov-keys") < inits.index("kvgov")
    by_name = containers(pod)
    kvgov, vllm = by_name["kvgov"], by_name["vllm"]
    assert kvgov["restartPolicy"] == "Always"
    assert "restartPolicy" not in by_name["kvgov-keys"]  # runs to completion first
    assert [c["name"] for c in pod["containers"]] == ["vllm"]
    volumes = {v["name"]: v for v in pod["volumes"]}

    def mount(c: dict[str, Any], path: str) -> dict[str, Any]:
        (m,) = [m for m in c["volumeMounts"] if m["mountPath"] == path]
        return m

    sock_volume = mount(kvgov, "/run/kvgov")["name"]
    assert mount(vllm, "/run/kvgov")["name"] == sock_volume
    assert "emptyDir" in volumes[sock_volume]
    env = settings_env(docs, pod)
    assert env["KVGOV_DATAPLANE__UNIX_PATH"] == "/run/kvgov/data.sock"
    assert env["KVGOV_DATAPLANE__HOST"] == ""  # no TCP data plane: the socket only
    assert env["KVGOV_DATAPLANE__LM_PORT"] == "-1"  # lm:// off

    # the engine's LMCache config: the file in deploy/engine/, pointing at that socket
    lm_env = {e["name"]: e.get("value") for e in vllm["env"]}
    lm_dir = Path(lm_env["LMCACHE_CONFIG_FILE"]).parent.as_posix()
    cm = one(docs, "ConfigMap", volumes[mount(vllm, lm_dir)["name"]]["configMap"]["name"])
    text = cm["data"]["lmcache.yaml"]
    assert text == (ROOT / "deploy/engine/lmcache.yaml").read_text()
    lmcache = yaml.safe_load(text)["extra_config"]
    assert lmcache["kvgov.endpoint"] == "unix://" + env["KVGOV_DATAPLANE__UNIX_PATH"]
    token_dir = Path(lmcache["kvgov.token_file"]).parent.as_posix()
    token_volume = volumes[mount(vllm, token_dir)["name"]]
    assert token_volume["secret"]["secretName"] == "kvgov-engine-tokens"
    assert [i["path"] for i in token_volume["secret"]["items"]] == ["token"]


def test_probes_resources_and_draining(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = overlay
    pod = one(docs, "Deployment", "kvgov-inference")["spec"]["template"]["spec"]
    kvgov = containers(pod)["kvgov"]
    (port,) = [p for p in kvgov["ports"] if p["name"] == "control"]
    assert port["containerPort"] == int(settings_env(docs, pod)["KVGOV_API__PORT"])
    assert kvgov["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert kvgov["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert kvgov["startupProbe"]["httpGet"]["path"] == "/readyz"
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert kvgov[probe]["httpGet"]["port"] == "control"
        assert kvgov[probe]["httpGet"]["scheme"] == "HTTPS"  # the API serves TLS only
    for c in containers(pod).values():
        assert c["resources"]["requests"], c["name"]
        assert c["resources"]["limits"]["memory"], c["name"]
    # vLLM leaves the endpoints first; then the sidecar drains (30 s) and flushes the ledger
    prestop = containers(pod)["vllm"]["lifecycle"]["preStop"]["exec"]["command"]
    assert prestop[0] == "sleep"
    assert pod["terminationGracePeriodSeconds"] >= int(prestop[1]) + 30 + 60


def test_every_container_is_locked_down(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = overlay
    pods = [
        one(docs, "Deployment", "kvgov-inference")["spec"]["template"]["spec"],
        one(docs, "Job", "kvgov-migrate")["spec"]["template"]["spec"],
    ]
    for pod in pods:
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert pod["automountServiceAccountToken"] is False
        assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
        for c in containers(pod).values():
            sc = c["securityContext"]
            assert {k: sc.get(k) for k in RESTRICTED} == RESTRICTED, c["name"]
            assert sc.get("runAsUser", 1) != 0 and not sc.get("privileged"), c["name"]


def test_settings_load_and_secrets_come_from_secret_files(
    overlay: tuple[str, list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    name, docs = overlay
    pod = one(docs, "Deployment", "kvgov-inference")["spec"]["template"]["spec"]
    env = settings_env(docs, pod)
    for secret in ("KVGOV_DATABASE__URL", "KVGOV_DATAPLANE__ENGINE_TOKENS", "KVGOV_DATABASE_URL"):
        assert secret not in env  # no secret value in a ConfigMap
    assert not any("TOKEN=" in f"{k}=" and not k.endswith("_FILE") for k in env)
    for key in list(os.environ):
        if key.startswith("KVGOV_"):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    settings = load_settings()  # raises on unknown names, bad values, unsafe production
    expected = Environment.DEVELOPMENT if name == "development" else Environment.PRODUCTION
    assert settings.environment is expected
    assert settings.production_problems() == [] or name == "development"
    if name == "production":
        assert settings.policy.engine == "opa"

    kvgov = containers(pod)["kvgov"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in kvgov["volumeMounts"]}

    def source(path: Path | None) -> dict[str, Any]:
        assert path is not None
        mount = mounts[path.parent.as_posix()]
        assert mount.get("readOnly") is True, path
        return volumes[mount["name"]]

    database = source(settings.database.url_file)["secret"]
    assert database["secretName"] == "kvgov-database"
    # beside the URL, the CA its sslrootcert names (docs/database.md, "TLS"; review r16)
    assert [(i["key"], i["path"]) for i in database["items"]] == [
        ("url", settings.database.url_file.name),
        ("ca.crt", "ca.crt"),
    ]
    assert settings.database.url_file.parent / "ca.crt" == DATABASE_CA
    tokens = source(settings.dataplane.engine_tokens_file)["secret"]
    assert tokens["secretName"] == "kvgov-engine-tokens"
    # per fleet: the KEK, the signing key and the pseudonym key, from one Secret, copied 0400
    # by kvgov-keys into a memory volume; never generated per pod
    keys_copy = containers(pod)["kvgov-keys"]
    copy_src = {m["mountPath"]: m["name"] for m in keys_copy["volumeMounts"]}
    items = {i["path"] for i in volumes[copy_src["/etc/kvgov/secret-keys"]]["secret"]["items"]}
    assert volumes[copy_src["/etc/kvgov/secret-keys"]]["secret"]["secretName"] == "kvgov-keys"
    for path in (settings.kek_path, settings.signing_key_path, settings.pseudonym_key_path):
        volume = source(path)
        assert volume["emptyDir"]["medium"] == "Memory"
        assert copy_src[path.parent.as_posix()] == volume["name"]
        assert path.name in items
    # the API's TLS certificate and key: Secret kvgov-api-tls, copied 0400 beside the keys
    # (kvgov reads the key as it reads the others: its own, readable by no one else)
    tls = volumes[copy_src["/etc/kvgov/secret-api-tls"]]["secret"]
    assert tls["secretName"] == "kvgov-api-tls" and tls["optional"] is False
    assert {i["key"] for i in tls["items"]} == {"tls.crt", "tls.key"}
    copy = " ".join(keys_copy["command"])
    for path, item in (
        (settings.api.tls_cert_file, "tls.crt"),
        (settings.api.tls_key_file, "tls.key"),
    ):
        assert path is not None
        assert source(path)["emptyDir"]["medium"] == "Memory"
        assert f"-m 0400 /etc/kvgov/secret-api-tls/{item} {path.as_posix()}" in copy
    # per pod: the chain id (the pod's name), the journal on the pod's state volume
    (chain,) = [e for e in kvgov["env"] if e["name"] == "KVGOV_LEDGER__CHAIN_ID"]
    assert chain["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    state = volumes[mounts[env["KVGOV_DATA_DIR"]]["name"]]
    assert "medium" not in state["emptyDir"]  # disk: survives container restarts
    assert settings.journal_path.is_relative_to(settings.data_dir)
    assert settings.filesystem_tier_path.is_relative_to(settings.data_dir)


def test_network_policy_admits_only_compliance_to_the_api(
    overlay: tuple[str, list[dict[str, Any]]],
) -> None:
    _, docs = overlay
    labels = one(docs, "Deployment", "kvgov-inference")["spec"]["template"]["metadata"]["labels"]
    policy = one(docs, "NetworkPolicy")["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= labels.items()
    assert "Ingress" in policy["policyTypes"]
    admitted: dict[int, list[Any]] = {}
    for rule in policy["ingress"]:
        assert rule.get("ports"), "a rule without ports admits every port"
        assert rule.get("from"), "a rule without sources admits everyone"
        for port in rule["ports"]:
            admitted.setdefault(port["port"], []).extend(rule["from"])
    assert 7070 not in admitted and 7071 not in admitted  # data ports: the pod only
    assert admitted[7080] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "compliance"}}}
    ]
    service = one(docs, "Service", "kvgov-control")["spec"]
    assert service["selector"].items() <= labels.items()
    assert [p["port"] for p in service["ports"]] == [7080]


def test_migration_job_runs_db_upgrade_as_the_owner(
    overlay: tuple[str, list[dict[str, Any]]],
) -> None:
    _, docs = overlay
    job = one(docs, "Job", "kvgov-migrate")["spec"]
    (c,) = job["template"]["spec"]["containers"]
    assert c["args"] == ["db", "upgrade"]
    deployment = one(docs, "Deployment", "kvgov-inference")["spec"]["template"]["spec"]
    assert c["image"] == containers(deployment)["kvgov"]["image"]  # same release
    env = {e["name"]: e["value"] for e in c["env"]}
    owner_dir = Path(env["KVGOV_DATABASE__MIGRATION_URL_FILE"]).parent.as_posix()
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == owner_dir]
    volumes = {v["name"]: v for v in job["template"]["spec"]["volumes"]}
    assert volumes[mount["name"]]["secret"]["secretName"] == "kvgov-database-owner"
    assert job["template"]["spec"]["restartPolicy"] == "Never"
    # the CA the owner's URL names too (sslrootcert), from Secret kvgov-database
    (ca_mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == DATABASE_CA.parent.as_posix()]
    ca_volume = volumes[ca_mount["name"]]["secret"]
    assert ca_volume["secretName"] == "kvgov-database"
    assert {"key": "ca.crt", "path": DATABASE_CA.name} in ca_volume["items"]


def test_the_documented_database_urls_verify_the_server() -> None:
    """Review r16, finding 2: the setup step's URLs asked libpq for nothing (sslmode=prefer:
    no certificate checked, plaintext when refused). They name the CA the manifests mount."""
    deploy = (ROOT / "docs" / "deploy.md").read_text()
    urls = re.findall(r"postgresql\+psycopg://kvgov_\w+:[^'\s]*", deploy)
    assert len(urls) >= 2, urls
    for url in urls:
        assert url.endswith(f"?sslmode=verify-full&sslrootcert={DATABASE_CA}"), url
    assert f"sslrootcert={DATABASE_CA}" in (ROOT / "docs" / "database.md").read_text()


def test_production_runs_opa_as_its_own_sidecar_before_kvgov() -> None:
    docs = render("production")
    pod = one(docs, "Deployment", "kvgov-inference")["spec"]["template"]["spec"]
    inits = [c["name"] for c in pod["initContainers"]]
    assert inits.index("opa") < inits.index("kvgov")
    opa = containers(pod)["opa"]
    assert opa["restartPolicy"] == "Always"
    # a Unix socket, not a loopback port any container could take (review r8, F4)
    assert "--addr=unix:///run/opa/opa.sock" in opa["args"]
    assert [a for a in opa["args"] if a.startswith("--addr=")] == [
        "--addr=unix:///run/opa/opa.sock"
    ]
    assert "--unix-socket-perm=660" in opa["args"]
    env = settings_env(docs, pod)
    assert env["KVGOV_POLICY__OPA_URL"] == "unix:///run/opa/opa.sock"
    assert one(docs, "Deployment")["spec"]["replicas"] > 1
    assert one(docs, "PodDisruptionBudget")["spec"]["maxUnavailable"] == 1


def test_production_opas_socket_is_mounted_by_opa_and_kvgov_only() -> None:
    """OPA's socket directory is a memory emptyDir that exactly the opa and kvgov containers
    mount, at the directory of ``policy.opa_url`` and of OPA's ``--addr``: vLLM can neither
    bind that socket nor reach it (review r8, F4). A tmpfs, whose root is sticky, so that
    kvgov's directory check (no other uid can replace the socket) holds."""
    docs = render("production")
    pod = one(docs, "Deployment", "kvgov-inference")["spec"]["template"]["spec"]
    env = settings_env(docs, pod)
    socket_dir = Path(urlsplit(env["KVGOV_POLICY__OPA_URL"]).path).parent.as_posix()
    (volume,) = [v for v in pod["volumes"] if v["name"] == "opa-socket"]
    assert volume["emptyDir"]["medium"] == "Memory"
    holders = {
        name: [m for m in c.get("volumeMounts", []) if m["name"] == "opa-socket"]
        for name, c in containers(pod).items()
    }
    assert {name for name, mounts in holders.items() if mounts} == {"opa", "kvgov"}
    assert all(m["mountPath"] == socket_dir for m in holders["opa"] + holders["kvgov"])
    # the kubelet's probes use OPA's diagnostic port (the pod IP), never the socket
    opa = containers(pod)["opa"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert opa[probe]["httpGet"]["port"] == "opa-diag"


def secrets_of(pod: dict[str, Any], container: dict[str, Any]) -> set[str]:
    """The Secrets a container gets: in its environment (``secretKeyRef``, ``envFrom``) or
    through a volume it mounts (``secret``, or a ``projected`` volume's secret sources)."""
    names = {
        e["valueFrom"]["secretKeyRef"]["name"]
        for e in container.get("env", [])
        if "secretKeyRef" in e.get("valueFrom", {})
    }
    names |= {e["secretRef"]["name"] for e in container.get("envFrom", []) if "secretRef" in e}
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        if "secret" in volume:
            names.add(volume["secret"]["secretName"])
        for source in volume.get("projected", {}).get("sources", []):
            if "secret" in source:
                names.add(source["secret"]["name"])
    return names


def test_production_opa_serves_its_api_to_kvgovs_token_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Whoever reaches OPA's API (its socket, opa and kvgov only; a loopback port before, every
    container): OPA asks its ``system.authz`` policy (``overlays/production/opa-authz.rego``,
    its rules: ``tests/security/test_opa_api_authz.py``) about every request, with the bearer
    token as the identity, and the token's Secret reaches the opa and kvgov containers and no
    other."""
    import os

    docs = render("production")
    pod = one(docs, "Deployment", "kvgov-inference")["spec"]["template"]["spec"]
    by_name = containers(pod)
    opa = by_name["opa"]
    assert "--authentication=token" in opa["args"]
    assert "--authorization=basic" in opa["args"]
    # the authz policy: a file argument (not the bundle's), from a ConfigMap opa mounts,
    # holding the overlay's file as it is
    policy_file = ROOT / "deploy/kubernetes/overlays/production/opa-authz.rego"
    (arg,) = [a for a in opa["args"] if a.endswith(".rego")]
    (mount,) = [m for m in opa["volumeMounts"] if Path(arg).parent.as_posix() == m["mountPath"]]
    volumes = {v["name"]: v for v in pod["volumes"]}
    cm = one(docs, "ConfigMap", volumes[mount["name"]]["configMap"]["name"])
    assert cm["data"][Path(arg).name] == policy_file.read_text(encoding="utf-8")
    assert "package system.authz" in cm["data"][Path(arg).name]
    # OPA's side of the token: the variable the policy reads, from Secret kvgov-opa-token
    (env,) = [e for e in opa["env"] if e["name"] == "KVGOV_OPA_TOKEN"]
    assert "opa.runtime().env[name]" in policy_file.read_text(encoding="utf-8")
    ref = env["valueFrom"]["secretKeyRef"]
    assert ref["name"] == "kvgov-opa-token" and ref.get("optional") is not True
    # and, during a rotation only, the next token of the same Secret (key `next`, absent
    # otherwise: optional), which the policy admits too (docs/deploy.md, "Rotating OPA's token")
    (nxt,) = [e for e in opa["env"] if e["name"] == "KVGOV_OPA_TOKEN_NEXT"]
    next_ref = nxt["valueFrom"]["secretKeyRef"]
    assert next_ref == {"name": ref["name"], "key": "next", "optional": True}
    assert '"KVGOV_OPA_TOKEN", "KVGOV_OPA_TOKEN_NEXT"' in policy_file.read_text(encoding="utf-8")
    # kvgov's side: policy.opa_token_file, in its read-only mount of that Secret's key
    for key in list(os.environ):
        if key.startswith("KVGOV_"):
            monkeypatch.delenv(key)
    for key, value in settings_env(docs, pod).items():
        monkeypatch.setenv(key, value)
    settings = load_settings()
    assert settings.policy.opa_token is None  # never a value in the ConfigMap
    token_file = settings.policy.opa_token_file
    assert token_file is not None
    kvgov = by_name["kvgov"]
    (mount,) = [m for m in kvgov["volumeMounts"] if m["mountPath"] == token_file.parent.as_posix()]
    assert mount.get("readOnly") is True
    secret = volumes[mount["name"]]["secret"]
    assert secret["secretName"] == ref["name"] and secret["optional"] is False
    assert [(i["key"], i["path"]) for i in secret["items"]] == [(ref["key"], token_file.name)]
    # and no other container gets it (vLLM runs user prompts and model code)
    holders = {name for name, c in by_name.items() if ref["name"] in secrets_of(pod, c)}
    assert holders == {"opa", "kvgov"}
    assert "kvgov-opa-token" in (ROOT / "docs" / "deploy.md").read_text()


def test_the_bundle_roots_leave_the_authz_policy_alone() -> None:
    """A bundle owns the paths of its manifest's roots (every path without one) and, when it
    activates, deletes every policy under them: the system.authz policy loaded from the file
    too, and OPA then refuses every request. The manifest docs/deploy.md builds the bundle with
    claims ``kvgov`` only, which holds every package of the shipped policies and the data
    document's path (``data.kvgov.config``), and nothing under ``system``."""
    from kvgov.policy.interfaces import DATA_PATH, POLICY_PACKAGE

    manifest = json.loads(
        (ROOT / "deploy/kubernetes/overlays/production/bundle.manifest").read_text()
    )
    roots = manifest["roots"]
    assert roots and all(isinstance(r, str) and r.strip("/") for r in roots), roots

    def owned(path: str) -> bool:
        parts = path.strip("/").split("/")
        return any(parts[: len(r.strip("/").split("/"))] == r.strip("/").split("/") for r in roots)

    assert not owned("system/authz")
    assert owned(POLICY_PACKAGE.replace(".", "/")) and owned(DATA_PATH.replace(".", "/"))
    rego = ROOT / "src/kvgov/policy/rego"
    for module in rego.glob("*.rego"):
        (package,) = [
            line.split()[1]
            for line in module.read_text().splitlines()
            if line.startswith("package ")
        ]
        assert owned(package.replace(".", "/")), module.name
    assert "bundle.manifest" in (ROOT / "docs" / "deploy.md").read_text()


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a label selector matches these labels (an empty selector matches every pod)."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        if (
            (op == "In" and labels.get(key) not in values)
            or (op == "NotIn" and labels.get(key) in values)
            or (op == "Exists" and key not in labels)
            or (op == "DoesNotExist" and key in labels)
        ):
            return False
    return True


def assert_closed(rule: dict[str, Any]) -> None:
    """An egress rule that names its ports and its destinations, none of them 'anything'."""
    assert rule.get("ports"), f"a rule without ports reaches every port: {rule}"
    assert all("port" in p for p in rule["ports"]), f"a port entry without a port: {rule}"
    assert rule.get("to"), f"a rule without destinations reaches everyone: {rule}"
    for peer in rule["to"]:
        assert peer, f"an empty destination is every pod and address: {rule}"
        for key in ("namespaceSelector", "podSelector"):
            if key in peer:  # {} is every namespace / every pod of the namespace
                assert peer[key].get("matchLabels") or peer[key].get("matchExpressions"), rule
        if "ipBlock" in peer:  # 0.0.0.0/0, ::/0 and near-everything (0.0.0.0/1 + 128.0.0.0/1)
            net = ipaddress.ip_network(peer["ipBlock"]["cidr"], strict=False)
            assert net.prefixlen >= 8, f"ipBlock {net} reaches (almost) every address"


def egress(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The egress rules of every NetworkPolicy selecting the inference pod (they add up).
    Fails unless one limits the pod's egress, and if any rule is open (assert_closed)."""
    labels = one(docs, "Deployment", "kvgov-inference")["spec"]["template"]["metadata"]["labels"]
    rules: list[dict[str, Any]] = []
    limited = False
    for policy in (d["spec"] for d in docs if d["kind"] == "NetworkPolicy"):
        types = policy.get("policyTypes") or ["Ingress"] + ["Egress"] * ("egress" in policy)
        if "Egress" in types and selects(policy["podSelector"], labels):
            limited = True
            rules.extend(policy.get("egress") or [])
    assert limited, "no NetworkPolicy limits the inference pod's egress"
    for rule in rules:
        assert_closed(rule)
    return rules


def reachable(docs: list[dict[str, Any]]) -> dict[tuple[int, str], list[dict[str, Any]]]:
    """(port, protocol) -> every destination the pod may reach there."""
    out: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for rule in egress(docs):
        for port in rule["ports"]:
            out.setdefault((port["port"], port.get("protocol", "TCP")), []).extend(rule["to"])
    return out


def bundle_port(docs: list[dict[str, Any]]) -> int:
    """The port of OPA's bundle service (the rendered kvgov-opa ConfigMap's services URL)."""
    config = yaml.safe_load(one(docs, "ConfigMap", "kvgov-opa")["data"]["opa-config.yaml"])
    url = urlsplit(config["services"][config["bundles"]["kvgov"]["service"]]["url"])
    return url.port or {"https": 443, "http": 80}[url.scheme]


def test_egress_policy_selects_the_inference_pod(
    overlay: tuple[str, list[dict[str, Any]]],
) -> None:
    _, docs = overlay
    labels = one(docs, "Deployment", "kvgov-inference")["spec"]["template"]["metadata"]["labels"]
    policy = one(docs, "NetworkPolicy", "kvgov-inference")["spec"]
    assert "Egress" in policy["policyTypes"]
    assert policy["podSelector"]["matchLabels"].items() <= labels.items()
    assert egress(docs)


def test_every_egress_rule_names_ports_and_destinations(
    overlay: tuple[str, list[dict[str, Any]]],
) -> None:
    _, docs = overlay
    for rule in egress(docs):  # egress() also runs assert_closed on each rule
        assert set(rule) == {"to", "ports"}, rule
        for peer in rule["to"]:
            assert "ipBlock" not in peer, "the shipped policy selects by label, never by address"
            assert peer.get("namespaceSelector") and peer.get("podSelector"), peer


def test_egress_reaches_dns_in_kube_system_only(
    overlay: tuple[str, list[dict[str, Any]]],
) -> None:
    _, docs = overlay
    allowed = reachable(docs)
    assert allowed[(53, "UDP")] == [KUBE_DNS]
    assert allowed[(53, "TCP")] == [KUBE_DNS]
    assert all(KUBE_DNS not in peers for key, peers in allowed.items() if key[0] != 53)


def test_egress_reaches_the_ledger_database_by_its_labels_only(
    overlay: tuple[str, list[dict[str, Any]]],
) -> None:
    _, docs = overlay
    allowed = reachable(docs)
    assert allowed[(5432, "TCP")] == [LEDGER_DATABASE]
    assert all(LEDGER_DATABASE not in peers for key, peers in allowed.items() if key[0] != 5432)
    assert "`kvgov.io/ledger-database=true`" in (ROOT / "docs" / "deploy.md").read_text()


def test_egress_reaches_nothing_else(
    overlay: tuple[str, list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The exact list of ports: Redis only with a Redis tier, the bundle server only beside
    OPA, and none for what is on the pod's loopback (vLLM's reset) or on OPA's socket (its API)."""
    import os

    name, docs = overlay
    pod = one(docs, "Deployment", "kvgov-inference")["spec"]["template"]["spec"]
    for key in list(os.environ):
        if key.startswith("KVGOV_"):
            monkeypatch.delenv(key)
    for key, value in settings_env(docs, pod).items():
        monkeypatch.setenv(key, value)
    settings = load_settings()
    expected = {(53, "UDP"), (53, "TCP"), (5432, "TCP")}
    if "redis" in settings.tiers.chain:
        expected.add((6379, "TCP"))
    if settings.policy.engine == "opa":
        opa = urlsplit(settings.policy.opa_url)
        assert opa.scheme == "unix" or opa.hostname in LOOPBACK_HOSTS  # in the pod: no rule
        expected.add((bundle_port(docs), "TCP"))
    for url in settings.purge.vllm_engines:
        assert urlsplit(url).hostname in LOOPBACK_HOSTS, url  # else it needs a rule
    assert set(reachable(docs)) == expected
    assert (name == "production") == (settings.policy.engine == "opa")


def test_production_egress_reaches_the_bundle_server_on_its_port_only() -> None:
    docs = render("production")
    allowed = reachable(docs)
    port = bundle_port(docs)
    assert port == 443
    assert allowed[(port, "TCP")] == [BUNDLE_SERVER]
    assert [key for key, peers in allowed.items() if BUNDLE_SERVER in peers] == [(port, "TCP")]
    assert "`kvgov.io/policy-bundles=true`" in (ROOT / "docs" / "deploy.md").read_text()
    dev = reachable(render("development"))
    assert all(BUNDLE_SERVER not in peers for peers in dev.values())


def test_the_egress_checks_catch_an_open_policy() -> None:
    """The checks above can fail: no egress policy, an allow-all rule, a rule without ports,
    one to 0.0.0.0/0 or ::/0, an empty destination, and a second, open policy all do."""
    docs = render("production")
    egress(docs)

    def spoilt(change: Any) -> list[dict[str, Any]]:
        copy: list[dict[str, Any]] = json.loads(json.dumps(docs))
        change(one(copy, "NetworkPolicy", "kvgov-inference")["spec"], copy)
        return copy

    anywhere = {"ports": [{"port": 443, "protocol": "TCP"}]}
    changes = [
        lambda p, _: p.update(policyTypes=["Ingress"], egress=[]),
        lambda p, _: p["egress"].append({}),
        lambda p, _: p["egress"].append({"to": [KUBE_DNS]}),
        lambda p, _: p["egress"].append({**anywhere, "to": [{"ipBlock": {"cidr": "0.0.0.0/0"}}]}),
        lambda p, _: p["egress"].append({**anywhere, "to": [{"ipBlock": {"cidr": "::/0"}}]}),
        lambda p, _: p["egress"].append({**anywhere, "to": [{}]}),
        lambda p, _: p["egress"].append({**anywhere, "to": [{"namespaceSelector": {}}]}),
        lambda p, _: p["egress"].append(anywhere),
        lambda _, d: d.append(
            {
                "kind": "NetworkPolicy",
                "metadata": {"name": "allow-all-egress"},
                "spec": {"podSelector": {}, "policyTypes": ["Egress"], "egress": [{}]},
            }
        ),
    ]
    for change in changes:
        with pytest.raises(AssertionError):
            egress(spoilt(change))


def test_the_ledger_database_example_admits_only_kvgovs_pods() -> None:
    """The example policy for the ledger's Postgres (deploy/kubernetes/examples): before it, the
    manifests limited only where the inference pods connect, and any pod of the cluster holding
    a stolen role password reached the ledger. It admits the production sidecars and the
    migration Job, from namespace kvgov, on 5432, and nothing else."""
    path = KUSTOMIZE / "examples" / "ledger-database-networkpolicy.yaml"
    (policy,) = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert policy["kind"] == "NetworkPolicy"
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"] and "egress" not in spec
    assert selects(spec["podSelector"], {"kvgov.io/ledger-database": "true"})
    docs = render("production")
    namespace = {"kubernetes.io/metadata.name": "kvgov"}
    deployment, job_object = one(docs, "Deployment", "kvgov-inference"), one(docs, "Job", "kvgov-")
    assert deployment["metadata"]["namespace"] == job_object["metadata"]["namespace"] == "kvgov"
    sidecar = deployment["spec"]["template"]["metadata"]
    job = job_object["spec"]["template"]["metadata"]

    def admitted(ns: dict[str, str], pod: dict[str, str], port: int) -> bool:
        return any(
            any(p["port"] == port and p.get("protocol", "TCP") == "TCP" for p in rule["ports"])
            and any(
                selects(peer["namespaceSelector"], ns) and selects(peer["podSelector"], pod)
                for peer in rule["from"]
            )
            for rule in spec["ingress"]
        )

    for rule in spec["ingress"]:  # every peer names both its namespace and its pods
        assert rule.get("ports") and rule.get("from"), rule
        for peer in rule["from"]:
            assert set(peer) == {"namespaceSelector", "podSelector"}, peer
    assert admitted(namespace, sidecar["labels"], 5432)
    assert admitted(namespace, job["labels"], 5432)
    assert not admitted(namespace, sidecar["labels"], 5433)
    gateway = {"kvgov.io/inference-gateway": "true"}
    assert not admitted(namespace, gateway, 5432), "another pod of namespace kvgov"
    compliance = {"kubernetes.io/metadata.name": "compliance"}
    assert not admitted(compliance, sidecar["labels"], 5432), "kvgov's labels in another namespace"

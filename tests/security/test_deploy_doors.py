"""The deployment's doors (review r8), read on the rendered Kustomize overlays: each test
failed on the manifests as they were (a21ff2c) and states the property that holds now.

Attackers: (a) code execution in the vLLM container, (b) another pod in the namespace,
(c) another namespace, (d) whoever can move an image's tag. OPA's channel (r8's F4) is
``test_opa_channel.py``'s.

* service links: the kubelet's variables for the Service ``kvgov-control``
  (``KVGOV_CONTROL_PORT`` & co.) are unknown ``KVGOV_*`` settings, and every sidecar and the
  migration Job refused to start on a real cluster (``podman kube play`` sets none);
* images: the base renamed the images first, so production rendered ``localhost/kvgov:dev``
  (a registry on each node's loopback) and an operator's digest pin matched nothing;
* vLLM's port admitted every pod of a labelled namespace, each free to write its own tenant
  and user tags, where only the gateway's pods may;
* the database Secrets were mounted whole.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest

from kvgov.config import load_settings
from kvgov.errors import ConfigError
from tests.integration.test_deploy_manifests import (
    OVERLAYS,
    ROOT,
    containers,
    one,
    render,
    render_dir,
)

#: a cluster IP the API server would assign (rendered Services carry none)
CLUSTER_IP = "10.96.0.10"


def env_name(name: str) -> str:
    """kubelet's ``makeEnvVariableName``: upper case, '-' -> '_'."""
    return name.upper().replace("-", "_")


def service_link_env(service: dict[str, Any], ip: str = CLUSTER_IP) -> dict[str, str]:
    """What the kubelet puts in every container of a pod of the Service's namespace when the
    pod's ``enableServiceLinks`` is true (the default): ``pkg/kubelet/envvars.FromServices``
    (``_SERVICE_HOST``, ``_SERVICE_PORT``, one ``_SERVICE_PORT_<NAME>`` per named port) and the
    Docker-link variables (``_PORT``, ``_PORT_<port>_<PROTO>`` and its ``_PROTO``, ``_PORT``,
    ``_ADDR``)."""
    spec = service["spec"]
    if spec.get("clusterIP") == "None":  # headless: no variables
        return {}
    name = env_name(service["metadata"]["name"])
    ports = spec["ports"]
    out = {f"{name}_SERVICE_HOST": ip, f"{name}_SERVICE_PORT": str(ports[0]["port"])}
    for p in ports:
        if p.get("name"):
            out[f"{name}_SERVICE_PORT_{env_name(p['name'])}"] = str(p["port"])
    for i, p in enumerate(ports):
        proto = p.get("protocol", "TCP")
        url = f"{proto.lower()}://{ip}:{p['port']}"
        if i == 0:
            out[f"{name}_PORT"] = url
        prefix = f"{name}_PORT_{p['port']}_{proto.upper()}"
        out[prefix] = url
        out[f"{prefix}_PROTO"] = proto.lower()
        out[f"{prefix}_PORT"] = str(p["port"])
        out[f"{prefix}_ADDR"] = ip
    return out


def container_env(
    docs: list[dict[str, Any]], pod: dict[str, Any], container: dict[str, Any]
) -> dict[str, str]:
    """A container's environment as the kubelet builds it: envFrom ConfigMaps, then env, then
    (enableServiceLinks unless false) the service variables of every Service of the namespace
    that the container does not define itself (the kubelet adds a service variable only
    ``if _, present := tmpEnv[k]; !present``)."""
    env: dict[str, str] = {}
    for ref in container.get("envFrom", []):
        if "configMapRef" in ref:
            env.update(one(docs, "ConfigMap", ref["configMapRef"]["name"])["data"])
    for e in container.get("env", []):
        env[e["name"]] = e.get("value", "from-" + next(iter(e.get("valueFrom", {"x": 0}))))
    if pod.get("enableServiceLinks", True):
        for svc in (d for d in docs if d["kind"] == "Service"):
            for k, v in service_link_env(svc).items():
                env.setdefault(k, v)
    return env


def load_with(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Any:
    """The settings a container of the image loads with ``env``: the image's defaults file
    below the container's ``KVGOV_*`` (``test_image_defaults.as_the_image``)."""
    from tests.security.test_image_defaults import as_the_image

    for key in list(os.environ):
        if key.startswith("KVGOV_"):
            monkeypatch.delenv(key)
    as_the_image(monkeypatch, **{k: v for k, v in env.items() if k.startswith("KVGOV_")})
    return load_settings()


# -- service links: kvgov-control's variables stopped every sidecar and the Job ----------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_links_leave_kvgovs_settings_alone(
    overlay: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a real cluster the kubelet adds ``KVGOV_CONTROL_SERVICE_HOST``, ``KVGOV_CONTROL_PORT``
    ... (the shipped Service ``kvgov-control``) to every container of every pod of the
    namespace; ``load_settings`` refuses unknown ``KVGOV_*`` names, so ``kvgov serve`` and the
    Job's ``kvgov db upgrade`` both stop. ``podman kube play`` (tests/e2e) sets no service
    variables, so nothing caught it. Any Service named ``kvgov-*`` that someone who can create
    Services in the namespace adds does the same to pods started later."""
    docs = render(overlay)
    for kind, name, cname in (
        ("Deployment", "kvgov-inference", "kvgov"),
        ("Job", "kvgov-migrate", "migrate"),
    ):
        pod = one(docs, kind, name)["spec"]["template"]["spec"]
        c = containers(pod)[cname]
        env = container_env(docs, pod, c)
        injected = sorted(k for k in env if k.startswith("KVGOV_CONTROL_"))
        try:
            load_with(env, monkeypatch)
        except ConfigError as exc:
            pytest.fail(
                f"{overlay}: {kind} {name} container {cname}: kvgov refuses to start with the"
                f" kubelet's service-link variables {injected}: {exc}"
            )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_service_someone_adds_cannot_reach_kvgovs_settings(overlay: str) -> None:
    """Attacker (b) allowed to create Services in the namespace (a CI bot, a tenant of a shared
    namespace): ``kubectl create service clusterip kvgov-anything --tcp=1:1`` puts
    ``KVGOV_ANYTHING_*`` into every kvgov container started afterwards (a rollout, a node
    drain, any restart) and none starts. Only ``enableServiceLinks: false`` on the pod keeps
    the namespace's Services out of the environment."""
    docs = render(overlay)
    for kind, name in (("Deployment", "kvgov-inference"), ("Job", "kvgov-migrate")):
        pod = one(docs, kind, name)["spec"]["template"]["spec"]
        assert pod.get("enableServiceLinks") is False, (
            f"{overlay}: {kind} {name} has enableServiceLinks "
            f"{pod.get('enableServiceLinks', 'unset (true)')}"
        )


# -- vLLM's port admits every pod of a labelled namespace, not the gateway only ------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_the_gateway_pods_reach_vllm(overlay: str) -> None:
    """The gateway is the only party trusted to write ``kv_transfer_params`` (tenant and user
    tags, acting user, sensitivity: docs/lmcache.md, "Why server-side"). The NetworkPolicy
    admits port 8000 from *every* pod of *every* namespace labelled
    ``kvgov.io/inference-clients=true`` (docs/deploy.md step 2 labels "the namespaces whose
    clients call vLLM"): any such pod calls vLLM directly with tags of its choosing and reads
    and writes as another tenant or user (hits, timing, forged provenance in the ledger). The
    rule must narrow to the gateway's pods (a podSelector with labels)."""
    docs = render(overlay)
    policy = one(docs, "NetworkPolicy", "kvgov-inference")["spec"]
    peers = [
        peer
        for rule in policy["ingress"]
        if any(p["port"] in (8000, "http") for p in rule["ports"])
        for peer in rule["from"]
    ]
    assert peers, "no rule admits vLLM's port"
    for peer in peers:
        selector = peer.get("podSelector") or {}
        assert selector.get("matchLabels") or selector.get("matchExpressions"), (
            f"{overlay}: port 8000 admits every pod of {peer}: not only the gateway"
        )


# -- images: by digest, and the overlays' names take effect --------------------------------


def production_images(docs: list[dict[str, Any]]) -> dict[str, str]:
    pod = one(docs, "Deployment", "kvgov-inference")["spec"]["template"]["spec"]
    job = one(docs, "Job", "kvgov-migrate")["spec"]["template"]["spec"]
    images = {c["name"]: c["image"] for c in containers(pod).values()}
    return images | {f"job/{c['name']}": c["image"] for c in containers(job).values()}


def test_production_runs_the_images_its_overlay_names() -> None:
    """The base renamed ``kvgov`` to ``localhost/kvgov:dev`` before the production overlay's
    ``images:`` could match it, so production rendered the development images: a registry on
    each node's own loopback (a pull fails, or takes whatever image of that name the node holds
    or whatever answers on its 127.0.0.1), then mounting kvgov-keys."""
    overlay = (ROOT / "deploy/kubernetes/overlays/production/kustomization.yaml").read_text()
    import yaml

    wanted = {
        i["name"].removeprefix("kvgov.invalid/"): i for i in yaml.safe_load(overlay)["images"]
    }
    images = production_images(render("production"))
    expected = {
        "kvgov": f"{wanted['kvgov']['newName']}@{wanted['kvgov']['digest']}",
        "vllm": f"{wanted['vllm-kvgov']['newName']}@{wanted['vllm-kvgov']['digest']}",
        "opa": f"{wanted['opa']['newName']}@{wanted['opa']['digest']}",
    }
    wrong = {n: images[n] for n, i in expected.items() if images[n] != i}
    assert not wrong, f"production renders {wrong}, its overlay names {expected}"
    assert not any(i.startswith("localhost/") for i in images.values()), images


def test_development_runs_the_images_built_here() -> None:
    docs = render("development")
    pod = one(docs, "Deployment", "kvgov-inference")["spec"]["template"]["spec"]
    images = {c["name"]: c["image"] for c in containers(pod).values()}
    assert images == {
        "vllm": "localhost/vllm-kvgov:dev",
        "kvgov-keys": "localhost/kvgov:dev",
        "kvgov": "localhost/kvgov:dev",
    }


def test_an_operators_digest_pin_takes_effect(tmp_path: Path) -> None:
    """docs/deploy.md step 8: an overlay of one's own on production pins its digest by naming
    the production overlay's placeholder. Before, the base had renamed the image first and the
    operator's pin matched nothing: the fleet ran ``localhost/kvgov:dev``."""
    import shutil
    import subprocess

    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    tree = tmp_path / "kubernetes"
    shutil.copytree(ROOT / "deploy/kubernetes", tree)
    mine = tree / "overlays" / "mine"
    mine.mkdir()
    digest = "sha256:" + "ab" * 32
    (mine / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\n"
        "kind: Kustomization\n"
        "resources: [../production]\n"
        "images:\n"
        "  - {name: registry.example.com/kvgov/kvgov, newName: registry.example.com/kvgov/kvgov,"
        f" digest: '{digest}'}}\n"
    )
    out = subprocess.run(
        [kubectl, "kustomize", str(mine)], capture_output=True, text=True, check=True, timeout=60
    )
    import yaml

    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    images = production_images(docs)
    kvgov = {n: i for n, i in images.items() if n in ("kvgov", "kvgov-keys", "job/migrate")}
    assert all(i == f"registry.example.com/kvgov/kvgov@{digest}" for i in kvgov.values()), kvgov


def test_production_images_are_pinned_by_digest() -> None:
    """Every image the production overlay runs (kvgov and vLLM hold keys, tokens and KV
    plaintext; OPA holds the token and sees every decision's input) is a mutable tag: whoever
    can push to that tag (the registry, a CI credential, Docker Hub for OPA) replaces the
    code at the next pull (a rescheduled pod, a new node). The overlay's own comment and
    docs/deploy.md step 8 say "pin digests"; the shipped overlay pins none."""
    images = production_images(render("production"))
    unpinned = {n: i for n, i in images.items() if not re.search(r"@sha256:[0-9a-f]{64}$", i)}
    assert not unpinned, f"images by tag: {unpinned}"


def test_the_engine_image_is_built_from_what_its_builder_names() -> None:
    """The engine image (the vLLM container: its engine token, every user's KV) defaulted to
    ``vllm-openai:latest`` and to ``kvgov[lmcache]`` of any version from the index: whoever moves
    that tag or uploads that name builds it. Both arguments are now required. (The sidecar's
    ``BASE_IMAGE`` keeps a tag default for a first build; docs/deploy.md asks for a digest.)"""
    engine = (ROOT / "deploy/engine/Containerfile").read_text()
    problems = []
    vllm = re.search(r"^ARG VLLM_IMAGE(=\S+)?$", engine, re.M)
    assert vllm is not None
    if vllm[1]:
        problems.append(f"VLLM_IMAGE defaults to {vllm[1][1:]}")
    spec = re.search(r"^ARG KVGOV_SPEC(=\S+)?$", engine, re.M)
    assert spec is not None
    if spec[1]:
        problems.append(f"KVGOV_SPEC defaults to {spec[1][1:]}")
    assert 'test -n "${KVGOV_SPEC}"' in engine  # an empty one stops the build, said why
    assert not problems, problems


# -- a whole Secret mounted where one key is needed -----------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_secret_volume_names_its_items(overlay: str) -> None:
    """``kvgov-database`` is mounted whole into the sidecar (and the Job): whatever else an
    operator keeps in that Secret (the owner's URL as a second key, a ``password``, a client
    key) lands in the sidecar's filesystem too, where docs/deploy.md promises the owner's
    credentials never go. Every other Secret volume lists its items."""
    docs = render(overlay)
    whole = []
    for kind, name in (("Deployment", "kvgov-inference"), ("Job", "kvgov-migrate")):
        pod = one(docs, kind, name)["spec"]["template"]["spec"]
        for v in pod["volumes"]:
            if "secret" in v and not v["secret"].get("items"):
                whole.append(
                    f"{kind}/{name}: volume {v['name']} = Secret {v['secret']['secretName']}"
                )
    assert not whole, whole


# -- the filesystem tier's disk (review r16, finding 1) ---------------------------------------

#: the failure while the tier had no bound (the tier and the journal on the 20Gi ``state``)
UNBOUNDED = (
    "the filesystem tier on the 20Gi state emptyDir has no size bound: a tenant's unique"
    " prompts fill it and the kubelet evicts the pod (0-1 s grace), taking the journal with it"
)
_QUANTITY = re.compile(r"([0-9]+)(Ki|Mi|Gi|Ti)?")
_MIB = 1 << 20
#: ``kvgov_ledger_journal_bytes`` past this pages (docs/deploy.md, "What to alert on")
JOURNAL_ALERT = 10 << 30


def quantity(text: str) -> int:
    """Bytes of a Kubernetes quantity as the manifests write sizes (``20Gi``)."""
    match = _QUANTITY.fullmatch(text)
    assert match is not None, f"unexpected quantity {text!r}"
    power = {None: 0, "Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40}[match.group(2)]
    return int(match.group(1)) << power


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_filesystem_tier_and_the_journal_fit_their_volumes(
    overlay: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The filesystem tier wrote every put (only its TTL removed entries) on the ``state``
    emptyDir beside the ledger journal: past the volume's ``sizeLimit`` the kubelet evicts
    the pod with a 0-1 s grace period, and the journal's acknowledged events and the chain's
    final checkpoint go with it. Now the tier has a bound (``tiers.filesystem_max_bytes``)
    and a disk emptyDir of its own with room for it (its fan-out directories and a crash's
    leftovers: 5 % at least); the journal keeps ``state``, with room for twice the journal
    size at which docs/deploy.md's alert fires (a database that falls behind grows it)."""
    from kvgov.config import TierSettings

    docs = render(overlay)
    pod = one(docs, "Deployment", "kvgov-inference")["spec"]["template"]["spec"]
    kvgov = containers(pod)["kvgov"]
    env = dict(container_env(docs, {**pod, "enableServiceLinks": False}, kvgov))
    settings = load_with(env, monkeypatch)
    assert "filesystem" in settings.tiers.chain
    assert "filesystem_max_bytes" in TierSettings.model_fields, UNBOUNDED
    bound = settings.tiers.filesystem_max_bytes
    assert bound is not None, "the manifests set no KVGOV_TIERS__FILESYSTEM_MAX_BYTES"
    volumes = {v["name"]: v for v in pod["volumes"]}

    def mount_of(path: Path) -> dict[str, Any]:
        """The kvgov container's mount that holds ``path`` (the deepest one)."""
        holding = [m for m in kvgov["volumeMounts"] if path.is_relative_to(m["mountPath"])]
        assert holding, f"{path} is on no volume (the root filesystem is read-only)"
        return max(holding, key=lambda m: len(Path(m["mountPath"]).parts))

    tier_mount, journal_mount = (
        mount_of(settings.filesystem_tier_path),
        mount_of(settings.journal_path),
    )
    assert tier_mount["name"] != journal_mount["name"], (
        f"the filesystem tier shares the {tier_mount['name']} volume with the journal"
    )
    # a directory kvgov makes inside the mount (the mount's own root is not private)
    assert settings.filesystem_tier_path != Path(tier_mount["mountPath"])
    tier = volumes[tier_mount["name"]]["emptyDir"]
    assert "medium" not in tier, "a memory emptyDir would count against the pod's memory"
    room = quantity(tier["sizeLimit"])
    assert room >= bound * 1.05, f"tiers.filesystem_max_bytes={bound} on a {tier['sizeLimit']}"
    assert room <= bound * 1.25, "most of the tier's volume is left unused"
    journal = volumes[journal_mount["name"]]["emptyDir"]
    assert "medium" not in journal  # disk: survives container restarts
    # an idle journal holds a segment or two; one whose database is away grows until the
    # alert of docs/deploy.md (10 GiB, "half the state sizeLimit") and must not be evicted there
    segments = 2 * settings.ledger.journal_segment_mib * _MIB
    assert quantity(journal["sizeLimit"]) >= max(2 * JOURNAL_ALERT, segments + JOURNAL_ALERT)
    # nothing but kvgov mounts either (vLLM writes its own volumes: not kvgov's bound)
    for name, c in containers(pod).items():
        if name != "kvgov":
            used = {m["name"] for m in c.get("volumeMounts", [])}
            assert tier_mount["name"] not in used and journal_mount["name"] not in used, name


# -- what r8 checked and found sound ---------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_sound_isolation_of_the_vllm_container(overlay: str) -> None:
    """What vLLM's container can reach on the file level, and the pod's identity: passes."""
    docs = render(overlay)
    pod = one(docs, "Deployment", "kvgov-inference")["spec"]["template"]["spec"]
    by_name = containers(pod)
    vols = {v["name"]: v for v in pod["volumes"]}
    assert not pod.get("shareProcessNamespace")
    assert pod["automountServiceAccountToken"] is False
    sa = one(docs, "ServiceAccount", pod["serviceAccountName"])
    assert sa.get("automountServiceAccountToken") is False
    vllm = by_name["vllm"]
    vllm_vols = {m["name"] for m in vllm["volumeMounts"]}
    # vLLM shares exactly the socket's emptyDir with kvgov; its Secret is its own token only
    shared = vllm_vols & {m["name"] for m in by_name["kvgov"]["volumeMounts"]}
    assert shared == {"socket"}
    secrets = {
        vols[n]["secret"]["secretName"]: vols[n]["secret"] for n in vllm_vols if "secret" in vols[n]
    }
    assert list(secrets) == ["kvgov-engine-tokens"]
    assert [i["key"] for i in secrets["kvgov-engine-tokens"]["items"]] == ["engine-token"]
    assert not any("secretKeyRef" in e.get("valueFrom", {}) for e in vllm.get("env", []))
    assert vllm["securityContext"]["runAsUser"] != pod["securityContext"]["runAsUser"]
    # the copies of the keys: a memory emptyDir that kvgov-keys and kvgov alone mount
    holders = {n for n, c in by_name.items() if any(m["name"] == "keys" for m in c["volumeMounts"])}
    assert holders == {"kvgov-keys", "kvgov"}
    for c in by_name.values():
        assert "hostPath" not in str([vols[m["name"]] for m in c["volumeMounts"]])
        assert not c.get("ports") or all("hostPort" not in p for p in c["ports"])


def test_sound_settings_need_the_job_and_pod_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the service variables, the rendered settings load (the shipped checks hold)."""
    docs = render("production")
    pod = one(docs, "Deployment", "kvgov-inference")["spec"]["template"]["spec"]
    env = dict(container_env(docs, {**pod, "enableServiceLinks": False}, containers(pod)["kvgov"]))
    settings = load_with(env, monkeypatch)
    assert settings.dataplane.host == ""
    assert Path(str(settings.dataplane.unix_path)).parent.as_posix() == "/run/kvgov"


def test_the_base_applied_alone_pulls_nothing() -> None:
    """Review r9: with the images' mapping moved to the overlays, the base named bare
    ``kvgov`` / ``vllm-kvgov``, which a cluster resolves to ``docker.io/library/...:latest``
    (or its unqualified-search registries). Its logical names are under ``kvgov.invalid``, a
    registry that never resolves."""
    docs = render_dir(ROOT / "deploy/kubernetes/base")
    pod = one(docs, "Deployment", "kvgov-inference")["spec"]["template"]["spec"]
    job = one(docs, "Job", "kvgov-migrate")["spec"]["template"]["spec"]
    images = [c["image"] for spec in (pod, job) for c in containers(spec).values()]
    assert images and all(i.startswith("kvgov.invalid/") for i in images), images

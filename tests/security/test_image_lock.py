"""The sidecar image installs exactly the reviewed dependencies (attacker review: the build
stage ran ``pip install /src``, resolving kvgov's dependencies from whatever the index served
at build time, unpinned and unhashed).

Attacker: whoever controls or poisons what the index serves on the day of a build (a
compromised mirror or proxy, a hijacked release, a typosquatted transitive dependency that
appears in a new version's metadata). What the build installs runs in every sidecar pod with
the pod's KEK and ledger credentials.

The door holds when the build stage installs ``deploy/image/requirements.lock`` (and the build
tools' ``build.lock``) with ``--require-hashes --no-deps`` and kvgov itself with ``--no-deps
--no-index``, the lock pins every package of the closure with its sha256, and nothing else can
be fetched. Offline: these tests read files and the test venv's metadata only; building the
image from the lock is ``tests/e2e/test_image.py``'s.

The lock also holds the ``redis`` extra (redis, hiredis; attacker review: without it, a sidecar
configured with a Redis tier refused to start, ``tests/e2e/test_image_redis.py``), and what its
closure needs on the image's own Python, Debian bookworm's 3.11.2, which the venv's newer 3.11
does not (redis requires async-timeout below 3.11.3).
"""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import NormalizedName, canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "deploy/image/requirements.lock"
BUILD_LOCK = ROOT / "deploy/image/build.lock"
CONTAINERFILE = ROOT / "Containerfile"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
#: the extras the image installs beside [project.dependencies] (deploy/image/lock.py)
IMAGE_EXTRAS = ("redis",)
#: the image's Pythons besides the venv's: Debian bookworm's python3 (deploy/image/lock.py)
IMAGE_PYTHONS = ("3.11.2",)
#: marker environments the lock covers: this interpreter's, then each image Python's
ENVIRONMENTS: list[dict[str, str]] = [
    {},
    *({"python_full_version": v, "python_version": v.rsplit(".", 1)[0]} for v in IMAGE_PYTHONS),
]
#: one locked requirement: ``name==version`` and one or more sha256, nothing else (no index
#: option, no URL, no editable, no marker that could skip it)
LOCKED = re.compile(
    r"(?P<name>[a-z0-9]+(?:[-_.][a-z0-9]+)*)==(?P<version>[A-Za-z0-9.+!-]+)"
    r"(?P<hashes>(?: --hash=sha256:[0-9a-f]{64})+)"
)


def lock_lines(path: Path) -> list[str]:
    """The lock's logical lines: continuations joined, comments and blank lines dropped."""
    assert path.is_file(), f"{path.relative_to(ROOT)} is missing: the image installs unlocked"
    text = re.sub(r"\\\n", " ", path.read_text())
    lines = (re.sub(r"\s+", " ", line.split("#", 1)[0]).strip() for line in text.splitlines())
    return [line for line in lines if line]


def pins(path: Path) -> dict[NormalizedName, Version]:
    """Every package the lock pins, by canonical name; fails on any line not strictly locked."""
    out: dict[NormalizedName, Version] = {}
    for line in lock_lines(path):
        m = LOCKED.fullmatch(line)
        assert m, f"{path.name}: not `name==version --hash=sha256:...`: {line[:120]}"
        name = canonicalize_name(m["name"])
        assert name not in out, f"{path.name}: {name} pinned twice"
        out[name] = Version(m["version"])
    return out


def test_every_lock_line_is_pinned_and_hashed() -> None:
    for path in (LOCK, BUILD_LOCK):
        locked = pins(path)
        assert locked, f"{path.name} pins nothing"
        for line in lock_lines(path):
            digests = re.findall(r"--hash=sha256:([0-9a-f]{64})", line)
            assert len(digests) == len(set(digests)) >= 1, line[:120]


def _image_roots() -> list[str]:
    """What the image installs kvgov for: [project.dependencies] and the image's extras."""
    extras = PYPROJECT["project"]["optional-dependencies"]
    return [*PYPROJECT["project"]["dependencies"], *(r for x in IMAGE_EXTRAS for r in extras[x])]


def _applies(req: Requirement, parent_extras: set[str], environments: list[dict[str, str]]) -> bool:
    if not req.marker:
        return True
    return any(
        req.marker.evaluate({**env, "extra": e}) for e in parent_extras for env in environments
    )


def test_every_runtime_dependency_is_satisfied_by_a_pin() -> None:
    locked = pins(LOCK)
    for spec in _image_roots():
        req = Requirement(spec)
        if req.marker and not req.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(req.name)
        assert name in locked, f"{spec} is not in the lock"
        assert req.specifier.contains(locked[name], prereleases=True), (
            f"the lock pins {name}=={locked[name]}, which pyproject's {spec!r} excludes"
        )


def test_build_lock_holds_pip_and_the_build_backend_and_no_runtime_package() -> None:
    build = pins(BUILD_LOCK)
    assert "pip" in build
    for spec in PYPROJECT["build-system"]["requires"]:
        req = Requirement(spec)
        name = canonicalize_name(req.name)
        assert name in build and req.specifier.contains(build[name]), spec
    # the build stage uninstalls build.lock's packages: none may be one the sidecar runs
    assert set(build).isdisjoint(pins(LOCK)), set(build) & set(pins(LOCK))


def test_the_lock_holds_the_redis_tier_client_with_hashes() -> None:
    """A Redis tier needs redis and hiredis in the image (their absence made the sidecar refuse
    to start), each pinned with sha256 hashes like every line."""
    locked = pins(LOCK)
    hashed = {
        canonicalize_name(m["name"]): m["hashes"]
        for line in lock_lines(LOCK)
        if (m := LOCKED.fullmatch(line))
    }
    for spec in PYPROJECT["project"]["optional-dependencies"]["redis"]:
        req = Requirement(spec)
        name = canonicalize_name(req.name)
        assert name in locked, f"the Redis tier's {name} is not in the image's lock"
        assert req.specifier.contains(locked[name]), f"{name}=={locked[name]} excludes {spec}"
        assert re.findall(r"--hash=sha256:[0-9a-f]{64}", hashed[name]), name
    assert {"redis", "hiredis"} <= set(locked)


def test_the_lock_holds_no_engine_or_test_package() -> None:
    extras = PYPROJECT["project"]["optional-dependencies"]
    runtime = {canonicalize_name(Requirement(r).name) for r in _image_roots()}
    off_limits = {canonicalize_name(n) for n in ("torch", "lmcache")}
    for extra in ("lmcache", "test", "dev"):
        off_limits |= {canonicalize_name(Requirement(r).name) for r in extras[extra]}
    off_limits -= runtime  # a test tool the sidecar itself requires would be a runtime package
    assert {"torch", "lmcache", "pytest", "hypothesis"} <= off_limits
    assert not off_limits & set(pins(LOCK)), off_limits & set(pins(LOCK))


def _installed_closure() -> dict[NormalizedName, Version | None]:
    """kvgov's runtime dependencies as the test venv holds them: [project.dependencies] and the
    image's extras of this checkout and their requirements (extras followed, markers for this
    interpreter and the image's Pythons). A requirement only an image Python needs is not
    installed here: it maps to None (its own requirements are not followed)."""
    found: dict[NormalizedName, Version | None] = {}
    extras: dict[NormalizedName, set[str]] = {}
    todo = [(Requirement(r), {""}) for r in _image_roots()]
    while todo:
        req, parent_extras = todo.pop()
        if not _applies(req, parent_extras, ENVIRONMENTS):
            continue
        name = canonicalize_name(req.name)
        if not _applies(req, parent_extras, ENVIRONMENTS[:1]):
            found.setdefault(name, None)  # the image's Python needs it, this venv does not
            continue
        wanted = {"", *req.extras}
        if wanted <= extras.get(name, set()):
            continue
        extras.setdefault(name, set()).update(wanted)
        dist = metadata.distribution(name)
        found[name] = Version(dist.version)
        todo += [(Requirement(r), set(extras[name])) for r in dist.requires or []]
    return found


def test_the_lock_is_the_closure_the_tests_ran_against() -> None:
    """The lock misses no dependency (the image's ``pip check`` would fail the build) and pins
    the versions this venv holds: ``make install`` installs the venv under the lock, so the
    suite tests what the image ships. A venv built otherwise: run ``make install``. What only
    the image's Python needs (async-timeout, for redis below 3.11.3) must be locked too."""
    installed = _installed_closure()
    locked = pins(LOCK)
    missing = sorted(set(installed) - set(locked))
    assert missing == [], f"dependencies the lock misses: {missing}"
    stray = sorted(set(locked) - set(installed))
    assert stray == [], f"locked packages nothing requires: {stray}"
    drift = {
        n: f"lock {locked[n]}, venv {v}"
        for n, v in installed.items()
        if v is not None and locked[n] != v
    }
    assert drift == {}, f"the venv is not the lock (make install, or make lock): {drift}"


def _stages() -> dict[str, list[str]]:
    """The Containerfile's instructions per stage (continuations joined, comments dropped)."""
    text = "\n".join(
        line for line in CONTAINERFILE.read_text().splitlines() if not line.lstrip().startswith("#")
    )
    instructions = [" ".join(i.split()) for i in re.sub(r"\\\n", " ", text).splitlines()]
    stages: dict[str, list[str]] = {}
    current: list[str] = []
    for ins in filter(None, instructions):
        if m := re.fullmatch(r"FROM \S+ AS (\S+)", ins, flags=re.IGNORECASE):
            current = stages.setdefault(m[1], [])
        current.append(ins)
    return stages


def _pip_commands(instructions: list[str]) -> list[str]:
    runs = [i.removeprefix("RUN ") for i in instructions if i.startswith("RUN ")]
    return [c.strip() for r in runs for c in re.split(r"&&|;|\|\|", r) if "pip " in c]


def test_the_build_stage_installs_only_the_lock() -> None:
    stages = _stages()
    assert set(stages) == {"build", "runtime"}, set(stages)
    build = stages["build"]
    assert any(i.startswith("COPY ") and "deploy/image/requirements.lock" in i for i in build), (
        "the lock is not copied into the build stage"
    )
    commands = _pip_commands(build)
    installs = [c for c in commands if re.search(r"\bpip install\b", c)]
    for cmd in installs:
        args = cmd.split()
        locked = "--require-hashes" in args and "--no-deps" in args and "-r" in args
        local = "--no-deps" in args and "--no-index" in args
        assert locked or local, f"an install that may fetch beyond the lock: {cmd}"
        assert "--upgrade" not in args and "-U" not in args, cmd
    lock_installs = [
        i for i, c in enumerate(commands) if "--require-hashes" in c and "requirements.lock" in c
    ]
    assert lock_installs, "requirements.lock is not installed with --require-hashes"
    check = [i for i, c in enumerate(commands) if re.search(r"\bpip check\b", c)]
    assert check and check[0] > max(i for i, c in enumerate(commands) if "pip install" in c), (
        "no `pip check` after the installs: a lock missing a dependency would build"
    )
    assert _pip_commands(stages["runtime"]) == [], "the runtime stage runs pip"


def test_the_build_context_carries_the_locks() -> None:
    """``.dockerignore`` excludes everything but what it names: the locks must be named."""
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    for lock in (LOCK, BUILD_LOCK):
        assert f"!{lock.relative_to(ROOT)}" in ignore, lock.name


@pytest.mark.parametrize("path", [LOCK, BUILD_LOCK], ids=lambda p: p.name)
def test_a_tampered_lock_line_is_refused(path: Path, tmp_path: Path) -> None:
    """The line check itself can fail: an index option, a URL and an unhashed pin."""
    for bad in (
        "--extra-index-url https://evil.example/simple",
        "kvgov-helper @ https://evil.example/x.whl",
        "aiohttp==3.14.5",
    ):
        tampered = tmp_path / path.name
        tampered.write_text(path.read_text() + bad + "\n")
        with pytest.raises(AssertionError, match="not `name==version"):
            pins(tampered)

#!/usr/bin/env python3
"""Write the sidecar image's hash-locked requirements (``make lock``; docs/deploy.md, "The lock").

The image's build stage installs nothing but these two files (``pip install --require-hashes
--no-deps``), so what runs in every sidecar pod, beside the pod's KEK and ledger credentials, is
the reviewed set in git rather than whatever the index serves on the day of the build:

- ``requirements.lock``: kvgov's ``[project.dependencies]``, the extras the image installs too
  (``IMAGE_EXTRAS``: ``redis``, the Redis tier's client) and their closure (never the other
  extras: no torch, no lmcache, no test tools), what the sidecar runs;
- ``build.lock``: pip and pyproject's ``[build-system] requires``, which the build stage uses to
  build kvgov's own wheel from the checkout and removes before the runtime stage.

pip resolves (``pip install --dry-run --ignore-installed --only-binary=:all: --report``) for the
interpreter that runs this script: run it with CPython 3.11 on Linux, the image's Python, since
markers and wheel tags depend on it. A dependency only an older 3.11 needs (Debian bookworm's
``python3`` is 3.11.2, ``IMAGE_PYTHONS``; redis requires async-timeout below 3.11.3) is invisible
to that resolution, so the closure is walked again with the markers of each of ``IMAGE_PYTHONS``
and what only they need is resolved too. Each chosen version is then locked with the sha256 of
every file of that version the configured indexes list (``pip config list``: index-url and
extra-index-url), as ``pip-compile --generate-hashes`` does, so an aarch64 build finds its wheels'
hashes too. A file name that two indexes list with different hashes stops it: one of them serves
another file under that name.

Pins already in the lock are kept (passed to pip as constraints) unless ``--upgrade``; a file is
rewritten only when its content changes, so ``make install`` (which installs the venv under the
lock) reinstalls only after a real change.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import ssl
import subprocess
import sys
import tempfile
import tomllib
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement
from packaging.utils import (
    InvalidSdistFilename,
    InvalidWheelFilename,
    NormalizedName,
    canonicalize_name,
    parse_sdist_filename,
    parse_wheel_filename,
)
from packaging.version import Version

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
RUNTIME_LOCK = HERE / "requirements.lock"
BUILD_LOCK = HERE / "build.lock"
DEFAULT_INDEX = "https://pypi.org/simple/"
PIN = re.compile(r"^([A-Za-z0-9._-]+)==(\S+)")
#: kvgov's extras the image installs beside ``[project.dependencies]``: ``redis`` (redis,
#: hiredis), without which a sidecar configured with a Redis tier refuses to start
IMAGE_EXTRAS = ("redis",)
#: the Pythons the image may run besides the one running this script: Debian bookworm's
#: ``python3`` (the debootstrap base of ``make image``, and what the stages install on a base
#: without one). Markers are evaluated for this interpreter and each of these.
IMAGE_PYTHONS = ("3.11.2",)
#: marker environments beside this interpreter's (an empty override)
_ENVIRONMENTS: list[dict[str, str]] = [
    {},
    *(
        {"python_full_version": v, "python_version": ".".join(v.split(".")[:2])}
        for v in IMAGE_PYTHONS
    ),
]
#: rounds of re-resolution for dependencies only another image Python needs
_MAX_ROUNDS = 5


class LockError(Exception):
    """The lock cannot be written as asked; the message says why."""


def _say(message: str) -> None:
    sys.stderr.write(f"lock: {message}\n")


def _pip_config() -> dict[str, str]:
    """pip's effective settings, ``scope.key`` to value (environment over files)."""
    out = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    config: dict[str, str] = {}
    for line in out.splitlines():
        key, _, value = line.partition("=")
        config[key.strip()] = value.strip().strip("'\"")
    return config


def _setting(config: dict[str, str], key: str) -> str | None:
    for scope in (":env:", "install", "global"):
        if f"{scope}.{key}" in config:
            return config[f"{scope}.{key}"]
    return None


def index_urls(config: dict[str, str]) -> list[str]:
    """The indexes pip resolves from here: index-url (PyPI unless set), then extra-index-url."""
    urls = [_setting(config, "index-url") or DEFAULT_INDEX]
    urls += (_setting(config, "extra-index-url") or "").split()
    return [u if u.endswith("/") else u + "/" for u in urls]


def resolve(roots: list[str], constraints: list[str]) -> list[dict[str, Any]]:
    """pip's resolution of ``roots`` (wheels only, nothing installed counts), as its report."""
    with tempfile.TemporaryDirectory(prefix="kvgov-lock-") as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--dry-run"]
        cmd += ["--ignore-installed", "--only-binary=:all:", "--report", str(report)]
        if constraints:
            pins = Path(tmp) / "constraints.txt"
            pins.write_text("".join(f"{c}\n" for c in constraints))
            cmd += ["--constraint", str(pins)]
        # roots and pins come from pyproject.toml and the locks, never from the network
        proc = subprocess.run(  # noqa: S603
            [*cmd, *roots], capture_output=True, text=True, check=False
        )
        if proc.returncode != 0:
            raise LockError(
                f"pip could not resolve {roots} within the kept pins (--upgrade resolves "
                f"anew):\n{proc.stderr.strip()}"
            )
        items: list[dict[str, Any]] = json.loads(report.read_text())["install"]
        return items


def _applies(req: Requirement, parent_extras: set[str], environments: list[dict[str, str]]) -> bool:
    """Whether ``req`` holds for one of the parent's extras under one of the environments."""
    if not req.marker:
        return True
    return any(
        req.marker.evaluate({**env, "extra": e}) for e in parent_extras for env in environments
    )


@dataclass
class Closure:
    """What requires each resolved package, and the requirements pip could not have resolved
    because only another of the image's Pythons needs them (their markers exclude this one)."""

    via: dict[NormalizedName, set[str]]
    elsewhere: list[str]


def closure(roots: list[str], items: list[dict[str, Any]]) -> Closure:
    """Each resolved package and what requires it, walked with the markers of this interpreter
    and of ``IMAGE_PYTHONS``; fails if pip chose one no root reaches, or missed one this
    interpreter needs."""
    meta = {canonicalize_name(i["metadata"]["name"]): i["metadata"] for i in items}
    via: dict[NormalizedName, set[str]] = {}
    extras: dict[NormalizedName, set[str]] = {}
    elsewhere: set[str] = set()
    todo = [(Requirement(r), "kvgov", {""}) for r in roots]
    while todo:
        req, parent, parent_extras = todo.pop()
        if not _applies(req, parent_extras, _ENVIRONMENTS):
            continue
        name = canonicalize_name(req.name)
        if name not in meta:
            if _applies(req, parent_extras, _ENVIRONMENTS[:1]):
                raise LockError(f"{parent} requires {req}, which pip did not resolve")
            unmarked = copy.copy(req)
            unmarked.marker = None
            elsewhere.add(str(unmarked))
            continue
        via.setdefault(name, set()).add(parent)
        wanted = {"", *req.extras}
        if wanted <= extras.get(name, set()):
            continue
        extras.setdefault(name, set()).update(wanted)
        for dep in meta[name].get("requires_dist") or []:
            todo.append((Requirement(dep), str(name), set(extras[name])))
    stray = set(meta) - set(via)
    if stray:
        raise LockError(f"pip resolved packages nothing requires: {sorted(stray)}")
    return Closure(via, sorted(elsewhere))


class _Anchors(HTMLParser):
    """File names and sha256 fragments of a PEP 503 simple page."""

    def __init__(self) -> None:
        super().__init__()
        self.files: list[tuple[str, str | None]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        href = dict(attrs).get("href")
        if tag == "a" and href:
            url, _, fragment = href.partition("#")
            name = urllib.parse.unquote(url.rsplit("/", 1)[-1])
            digest = fragment.removeprefix("sha256=") if fragment.startswith("sha256=") else None
            self.files.append((name, digest))


def _simple_page(index: str, project: str, context: ssl.SSLContext) -> list[tuple[str, str]]:
    """(file name, sha256) of a project's files on one index; [] if it does not list it."""
    url = urllib.parse.urljoin(index, f"{project}/")
    if url.startswith("file:"):
        page = Path(urllib.request.url2pathname(urllib.parse.urlparse(url).path)) / "index.html"
        if not page.is_file():
            return []
        body, kind = page.read_text(), "text/html"
    else:
        accept = "application/vnd.pypi.simple.v1+json, text/html;q=0.1"
        request = urllib.request.Request(url, headers={"Accept": accept})  # noqa: S310
        try:
            with urllib.request.urlopen(request, timeout=60, context=context) as resp:  # noqa: S310
                body, kind = resp.read().decode(), resp.headers.get_content_type()
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return []
            raise
    if kind == "application/vnd.pypi.simple.v1+json":
        files = json.loads(body)["files"]
        return [
            (f["filename"], f["hashes"]["sha256"])
            for f in files
            if "sha256" in f.get("hashes", {}) and not f.get("yanked")
        ]
    parser = _Anchors()
    parser.feed(body)
    return [(name, digest) for name, digest in parser.files if digest]


def _version_of(filename: str) -> tuple[NormalizedName, Version] | None:
    try:
        if filename.endswith(".whl"):
            name, version, _, _ = parse_wheel_filename(filename)
            return name, version
        name, version = parse_sdist_filename(filename)
        return name, version
    except (InvalidWheelFilename, InvalidSdistFilename):
        return None


@dataclass(frozen=True)
class Indexes:
    """Where pip looks here, and the CA bundle it trusts (pip's ``cert``)."""

    urls: list[str]
    context: ssl.SSLContext


def file_hashes(name: NormalizedName, version: str, indexes: Indexes) -> dict[str, str]:
    """Every file of ``name==version`` the indexes list, file name to sha256."""
    found: dict[str, str] = {}
    for index in indexes.urls:
        for filename, digest in _simple_page(index, name, indexes.context):
            if _version_of(filename) != (name, Version(version)):
                continue
            if found.setdefault(filename, digest) != digest:
                raise LockError(
                    f"{filename} has two sha256 on the configured indexes ({found[filename]} "
                    f"and {digest} on {index}): one index serves another file under that name"
                )
    return found


def render(
    title: str,
    items: list[dict[str, Any]],
    via: dict[NormalizedName, set[str]],
    hashes: dict[NormalizedName, dict[str, str]],
) -> str:
    lines = [
        f"# {title}",
        "# Generated by deploy/image/lock.py (`make lock`) for CPython 3.11 on Linux: every file",
        "# of each version that the index lists is hashed. Do not edit; review changes as a diff.",
    ]
    for item in sorted(items, key=lambda i: canonicalize_name(i["metadata"]["name"])):
        name = canonicalize_name(item["metadata"]["name"])
        version = item["metadata"]["version"]
        digests = sorted(set(hashes[name].values()))
        lines.append(f"{name}=={version} \\")
        lines += [f"    --hash=sha256:{d} \\" for d in digests[:-1]]
        lines.append(f"    --hash=sha256:{digests[-1]}")
        lines.append(f"    # via {', '.join(sorted(via[name]))}")
    return "\n".join(lines) + "\n"


def kept_pins(lock: Path) -> list[str]:
    """``name==version`` of every package an existing lock pins."""
    if not lock.is_file():
        return []
    return [m.group(0) for line in lock.read_text().splitlines() if (m := PIN.match(line))]


def write_lock(
    lock: Path,
    title: str,
    roots: list[str],
    constraints: list[str],
    indexes: Indexes,
) -> bool:
    """Resolve, hash and write one lock; True if its content changed."""
    extra_roots: list[str] = []
    for _ in range(_MAX_ROUNDS):
        items = resolve([*roots, *extra_roots], constraints)
        found = closure(roots, items)
        if not found.elsewhere:
            break
        # only another image Python needs these: resolve them too, as roots of their own
        extra_roots = sorted({*extra_roots, *found.elsewhere})
    else:
        raise LockError(f"still unresolved after {_MAX_ROUNDS} rounds: {found.elsewhere}")
    via = found.via
    hashes: dict[NormalizedName, dict[str, str]] = {}
    for item in items:
        name = canonicalize_name(item["metadata"]["name"])
        version = item["metadata"]["version"]
        hashes[name] = file_hashes(name, version, indexes)
        chosen = item["download_info"].get("archive_info", {}).get("hashes", {}).get("sha256")
        if chosen not in hashes[name].values():
            url = item["download_info"]["url"]
            raise LockError(f"{name}=={version}: the file pip chose ({url}) is on no index")
        _say(f"{name}=={version} ({len(hashes[name])} files)")
    text = render(title, items, via, hashes)
    if lock.is_file() and lock.read_text() == text:
        return False
    lock.write_text(text)
    return True


def _merge(kept: list[str], extra: list[str]) -> list[str]:
    """The kept pins, overridden by name where ``--constraint`` pins the same package."""
    pins = {canonicalize_name(p.split("==")[0]): p for p in kept}
    pins.update({canonicalize_name(p.split("==")[0]): p for p in extra})
    return sorted(pins.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upgrade", action="store_true", help="resolve anew, keeping no pin")
    parser.add_argument(
        "--constraint",
        type=Path,
        action="append",
        default=[],
        help="extra pins for pip (e.g. `pip freeze` of the tested venv); repeatable",
    )
    args = parser.parse_args(argv)
    if sys.implementation.name != "cpython" or sys.version_info[:2] != (3, 11):
        _say("run it with CPython 3.11, the image's Python")
        return 2
    if not sys.platform.startswith("linux"):
        _say("run it on Linux, the image's platform")
        return 2
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    optional = pyproject["project"]["optional-dependencies"]
    extra = [line for c in args.constraint for line in c.read_text().splitlines()]
    extra = [line.strip() for line in extra if PIN.match(line)]
    config = _pip_config()
    indexes = Indexes(
        index_urls(config), ssl.create_default_context(cafile=_setting(config, "cert"))
    )
    targets = [
        (
            RUNTIME_LOCK,
            (
                "The sidecar's runtime dependencies: kvgov's [project.dependencies], its "
                f"{', '.join(IMAGE_EXTRAS)} extra and their closure."
            ),
            [
                *pyproject["project"]["dependencies"],
                *(r for x in IMAGE_EXTRAS for r in optional[x]),
            ],
        ),
        (
            BUILD_LOCK,
            "What the image's build stage builds kvgov's wheel with; removed before runtime.",
            ["pip", *pyproject["build-system"]["requires"]],
        ),
    ]
    try:
        for lock, title, roots in targets:
            kept = [] if args.upgrade else kept_pins(lock)
            changed = write_lock(lock, title, roots, _merge(kept, extra), indexes)
            state = "written" if changed else "unchanged"
            _say(f"{lock.relative_to(ROOT)} {state}")
    except LockError as exc:
        _say(str(exc))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

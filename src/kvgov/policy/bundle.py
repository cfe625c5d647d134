"""Load and validate the policies and the data document an engine runs (a "bundle").

Sources: the operator's ``policy.policy_dir`` (every ``*.rego`` below it) or the policies
shipped in ``kvgov/policy/rego``; the data document from ``policy.data_file``, else a
``data.json`` in the policy directory, else the shipped example. Files ending in ``_test.rego``
are Rego unit tests: ``kvgov policy test`` runs them, engines do not load them.

Everything is checked at startup: unparsable Rego raises :class:`PolicyError` naming the file
and line, a data document of the wrong shape names the file and the field, and a policy
without ``data.kvgov.authz.decision`` is refused. Startup stops on any of them.

A running sidecar loads them again off the event loop (:func:`off_loop`): checking the policies
compiles them, milliseconds during which every connection would otherwise wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import re
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

from kvgov.errors import ConfigError, PolicyError
from kvgov.follow import file_stamp
from kvgov.policy.interfaces import DECISION_RULE, POLICY_PACKAGE, PolicyRevision, document_digest
from kvgov.privatefs import read_guarded_file

_LOCATION = re.compile(r"-->\s*(?P<file>[^\s:]+):(?P<line>\d+):(?P<col>\d+)")
_PACKAGE = re.compile(r"^package\s+([\w.]+)", re.MULTILINE)
_TEST_RULE = re.compile(r"^(test_\w+)\b", re.MULTILINE)
_KNOWN_SCOPES = ("tenant", "user")

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class RegoModule:
    name: str
    source: str

    @property
    def package(self) -> str | None:
        match = _PACKAGE.search(self.source)
        return match.group(1) if match else None

    def test_rules(self) -> list[str]:
        """``data.<package>.test_*`` paths of the test rules in this module."""
        package = self.package
        if package is None:
            return []
        names = dict.fromkeys(_TEST_RULE.findall(self.source))
        return [f"data.{package}.{name}" for name in names]


@dataclass(frozen=True, slots=True)
class PolicyBundle:
    """Policies plus data, with the revisions recorded on every decision."""

    modules: tuple[RegoModule, ...]
    tests: tuple[RegoModule, ...]
    #: the data document; engines mount it at ``data.kvgov.config``
    config: Mapping[str, Any]
    revision: PolicyRevision
    policy_source: str
    data_source: str

    def data_document(self) -> dict[str, Any]:
        """The whole ``data`` document the engines load."""
        return {"kvgov": {"config": self.config}}


async def off_loop(work: Callable[[], _T]) -> _T:
    """``work()`` on a worker thread (``asyncio.to_thread``), for loading and compiling policies
    while the event loop goes on serving.

    regorus objects are bound to the thread that made them: one dropped on another thread
    raises ("unsendable, but is being dropped on another thread"). When ``work`` raises (invalid
    Rego), the frames its traceback holds may still hold the half-checked engine, and the
    exception travels to the loop's thread; their locals are cleared here, on the worker, first.
    """

    def run() -> _T:
        try:
            return work()
        except BaseException as exc:
            seen: set[int] = set()
            error: BaseException | None = exc
            while error is not None and id(error) not in seen:
                seen.add(id(error))
                traceback.clear_frames(error.__traceback__)
                error = error.__cause__ or error.__context__
            raise

    return await asyncio.to_thread(run)


def source_stamp(policy_dir: Path | None = None, data_file: Path | None = None) -> object:
    """What :func:`load_bundle` would read, as file identities and times
    (:func:`kvgov.follow.file_stamp`): cheap to take often, and different whenever an operator
    changed a source. The shipped sources never change."""
    paths: list[Path] = []
    if policy_dir is not None:
        with contextlib.suppress(OSError):
            paths += sorted(p for p in policy_dir.rglob("*") if not p.name.startswith(".."))
    if data_file is not None:
        paths.append(data_file)
    return file_stamp(paths)


#: the data source of the packaged example data document (tenants ``demo``, ``acme``,
#: ``initech``): what runs when the operator named none. Production refuses it at start
SHIPPED_DATA_SOURCE = "kvgov/policy/rego/data.json (shipped)"


def operator_data_file(policy_dir: Path | None, data_file: Path | None) -> Path | None:
    """The data document an operator named: ``data_file``, else a ``data.json`` in
    ``policy_dir``; None means :func:`load_bundle` falls back to the shipped example."""
    if data_file is None and policy_dir is not None and (policy_dir / "data.json").is_file():
        return policy_dir / "data.json"
    return data_file


def load_bundle(
    policy_dir: Path | None = None,
    data_file: Path | None = None,
    *,
    check: bool = True,
    shipped_data: bool = True,
) -> PolicyBundle:
    """Read and validate policies and data; raises :class:`PolicyError` naming what is wrong.

    ``check=False`` skips parsing the Rego (regorus, which holds the GIL throughout: ~12 ms for
    the shipped test module): for a look at the sources' revision only, as the policy follower
    takes before it reloads an engine, which checks them itself. ``shipped_data=False``
    (outside development): no operator data document is an error, never the packaged example,
    at start or at a reload (a ConfigMap whose ``data.json`` went missing must not turn a
    running production sidecar's policy into the example's, where tenant ``demo`` admits
    every engine)."""
    if policy_dir is None:
        modules, tests = _packaged_modules()
        policy_source = "kvgov/policy/rego (shipped)"
        manifest_revision = None
    else:
        modules, tests = _dir_modules(policy_dir)
        policy_source = str(policy_dir)
        manifest_revision = _manifest_revision(policy_dir)
    data_file = operator_data_file(policy_dir, data_file)
    if data_file is None and not shipped_data:
        raise PolicyError(
            "no policy data: policy.data_file is unset and policy.policy_dir holds no"
            " data.json; the packaged example data (tenant 'demo' admits every engine) is for"
            " development only"
        )
    if data_file is None:
        raw = resources.files("kvgov.policy").joinpath("rego", "data.json").read_text("utf-8")
        config = _parse_data(raw, SHIPPED_DATA_SOURCE)
        data_source = SHIPPED_DATA_SOURCE
    else:
        config = _parse_data(_read(data_file), str(data_file))
        data_source = str(data_file)
    if check:
        check_modules(modules + tests, config)
    return PolicyBundle(
        modules=modules,
        tests=tests,
        config=config,
        revision=PolicyRevision(
            policy=_policy_revision(modules, manifest_revision),
            data=_data_revision(config),
        ),
        policy_source=policy_source,
        data_source=data_source,
    )


def _read(path: Path) -> str:
    """An operator's policy source (a module, the data document, the manifest), checked on
    the file opened as every file kvgov trusts is (:func:`kvgov.privatefs.read_guarded_file`):
    refused when its group or others may write it or a user but this process's or root owns
    it, since whoever can write a policy source decides who may read which tenant's cache."""
    try:
        raw = read_guarded_file(path, "policy source", secret=False)
    except ConfigError as exc:
        raise PolicyError(exc.message, hint=exc.hint) from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PolicyError(f"{path} is not UTF-8 text") from exc


def _split(named: list[tuple[str, str]]) -> tuple[tuple[RegoModule, ...], tuple[RegoModule, ...]]:
    modules = tuple(RegoModule(n, s) for n, s in named if not n.endswith("_test.rego"))
    tests = tuple(RegoModule(n, s) for n, s in named if n.endswith("_test.rego"))
    return modules, tests


def _packaged_modules() -> tuple[tuple[RegoModule, ...], tuple[RegoModule, ...]]:
    root = resources.files("kvgov.policy").joinpath("rego")
    named = sorted(
        (entry.name, entry.read_text("utf-8"))
        for entry in root.iterdir()
        if entry.name.endswith(".rego")
    )
    return _split(named)


def _dir_modules(policy_dir: Path) -> tuple[tuple[RegoModule, ...], tuple[RegoModule, ...]]:
    if not policy_dir.is_dir():
        raise PolicyError(f"policy directory not found: {policy_dir}")
    files = sorted(
        p
        for p in policy_dir.rglob("*.rego")
        if not any(part.startswith(".") for part in p.relative_to(policy_dir).parts)
    )
    if not files:
        raise PolicyError(f"no .rego files in policy directory {policy_dir}")
    named = [(p.relative_to(policy_dir).as_posix(), _read(p)) for p in files]
    modules, tests = _split(named)
    if not modules:
        raise PolicyError(f"policy directory {policy_dir} holds only tests (*_test.rego)")
    return modules, tests


def _manifest_revision(policy_dir: Path) -> str | None:
    manifest = policy_dir / ".manifest"
    if not manifest.is_file():
        return None
    try:
        revision = json.loads(_read(manifest)).get("revision")
    except (ValueError, AttributeError) as exc:
        raise PolicyError(f"{manifest} is not a JSON object") from exc
    return revision if isinstance(revision, str) and revision else None


def _policy_revision(modules: tuple[RegoModule, ...], label: str | None) -> str:
    h = hashlib.sha256()
    for module in sorted(modules, key=lambda m: m.name):
        h.update(module.name.encode() + b"\0" + module.source.encode() + b"\0")
    digest = f"sha256:{h.hexdigest()[:16]}"
    return f"{label}+{digest}" if label else digest


def _data_revision(config: Mapping[str, Any]) -> str:
    digest = f"sha256:{document_digest(config)[:16]}"
    label = config.get("revision")
    return f"{label}+{digest}" if isinstance(label, str) and label else digest


# -- data document -----------------------------------------------------------------------


def _parse_data(raw: str, source: str) -> dict[str, Any]:
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise PolicyError(
            f"invalid JSON in data file {source} line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from exc
    except RecursionError:
        raise PolicyError(f"invalid JSON in data file {source}: nested too deeply") from None
    try:  # a lone surrogate escape ("\ud800") is no text: the Rego engine would crash on it
        json.dumps(config, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise PolicyError(
            f"invalid data file {source}: it holds a string that is not text (a lone"
            " surrogate escape such as \\ud800)"
        ) from None
    problems = data_problems(config)
    if problems:
        raise PolicyError(
            f"invalid data document {source}:\n" + "\n".join(f"  {p}" for p in problems),
            hint="see docs/policy.md for the data document's shape",
        )
    if not isinstance(config, dict):  # pragma: no cover - data_problems refuses it
        raise PolicyError(f"invalid data document {source}")
    return config


def _str_list(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def data_problems(config: object) -> list[str]:
    """What is wrong with a data document (empty when it is fine). Unknown keys are allowed:
    operators' own policies may read their own data."""
    if not isinstance(config, dict):
        return ["the document must be a JSON object"]
    problems: list[str] = []
    if "revision" in config and not isinstance(config["revision"], str):
        problems.append("revision: must be a string")
    if not _str_list(config.get("tiers")):
        problems.append("tiers: must be a list of tier names")
    classes = config.get("classes")
    if not isinstance(classes, dict) or not classes:
        problems.append("classes: must be an object of sensitivity classes")
        classes = {}
    default = config.get("default_sensitivity", "internal")
    if not isinstance(default, str) or (classes and default not in classes):
        problems.append("default_sensitivity: must name one of the classes")
    for name, cls in classes.items():
        where = f"classes.{name}"
        if not isinstance(cls, dict):
            problems.append(f"{where}: must be an object")
            continue
        cacheable = cls.get("cacheable", True)
        if not isinstance(cacheable, bool):
            problems.append(f"{where}.cacheable: must be true or false")
        if cacheable is not False and not _count(cls.get("max_ttl_s")):
            problems.append(f"{where}.max_ttl_s: must be a whole number of seconds >= 0")
        if "tiers" in cls and not _str_list(cls["tiers"]):
            problems.append(f"{where}.tiers: must be a list of tier names")
        if cls.get("scope", "tenant") not in _KNOWN_SCOPES:
            problems.append(f"{where}.scope: must be one of {', '.join(_KNOWN_SCOPES)}")
        if not isinstance(cls.get("requires_tenant_allow", False), bool):
            problems.append(f"{where}.requires_tenant_allow: must be true or false")
    tenants = config.get("tenants")
    if not isinstance(tenants, dict):
        problems.append("tenants: must be an object keyed by tenant id")
        tenants = {}
    for name, tenant in tenants.items():
        where = f"tenants.{name}"
        if not isinstance(tenant, dict):
            problems.append(f"{where}: must be an object")
            continue
        if not isinstance(tenant.get("enabled", False), bool):
            problems.append(f"{where}.enabled: must be true or false")
        if not _str_list(tenant.get("engines", [])):
            problems.append(f"{where}.engines: must be a list of engine ids")
        for key in ("allowed_labels", "tiers"):
            if key in tenant and not _str_list(tenant[key]):
                problems.append(f"{where}.{key}: must be a list of strings")
        ttl = tenant.get("max_ttl_s", {})
        if not isinstance(ttl, dict) or not all(_count(v) for v in ttl.values()):
            problems.append(f"{where}.max_ttl_s: must map class names to seconds >= 0")
    return problems


# -- Rego ---------------------------------------------------------------------------------


def rego_error_text(exc: BaseException) -> str:
    """A regorus error message without the Rust backtrace it may carry."""
    text = str(exc).split("Stack backtrace:", 1)[0]
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def _located(exc: BaseException, fallback: str) -> PolicyError:
    text = rego_error_text(exc)
    match = _LOCATION.search(text)
    if match is None:
        return PolicyError(f"invalid Rego in {fallback}: {text}")
    summary = next(
        (ln.split("error:", 1)[1].strip() for ln in text.splitlines() if "error:" in ln), text
    )
    return PolicyError(
        f"invalid Rego in {match['file']} line {match['line']} column {match['col']}: "
        f"{summary}\n{text}"
    )


def check_modules(modules: tuple[RegoModule, ...], config: Mapping[str, Any]) -> None:
    """Parse every module and evaluate the decision once; raises :class:`PolicyError`."""
    import regorus

    engine = regorus.Engine()
    for module in modules:
        try:
            engine.add_policy(module.name, module.source)
        except RuntimeError as exc:
            raise _located(exc, module.name) from exc
    engine.add_data({"kvgov": {"config": dict(config)}})
    rule = f"data.{POLICY_PACKAGE}.{DECISION_RULE}"
    if f"data.{POLICY_PACKAGE}" not in engine.get_packages():
        raise PolicyError(f"no module declares `package {POLICY_PACKAGE}`")
    engine.set_input({})
    try:
        result = engine.eval_rule(rule)
    except RuntimeError as exc:
        raise _located(exc, rule) from exc
    if not isinstance(result, dict) or not isinstance(result.get("allowed"), bool):
        raise PolicyError(
            f"{rule} must always be an object with a boolean `allowed` (got {result!r} for an "
            "empty input)",
            hint="give the decision rule a `default` so that it is never undefined",
        )

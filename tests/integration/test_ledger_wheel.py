"""``upgrade()`` from an installed wheel: the migrations ship with the package.

Builds a wheel from a copy of the project (``pip wheel --no-deps --no-build-isolation``),
installs it with ``--no-deps`` into a fresh virtual environment whose only other path entry
is this environment's site-packages (for the dependencies; its ``.pth`` files, among them
the editable install of the checkout, are not processed), and migrates a SQLite database
from a directory outside any checkout, through the API and through ``kvgov db upgrade``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

from kvgov.db.engine import head_revision

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ("pyproject.toml", "README.md", "alembic.ini", "src", "migrations")

PROBE = """
import json, sys
import kvgov
from kvgov.db.engine import current_revision, migrations_dir, upgrade
url = sys.argv[1]
upgrade(url)
print(json.dumps({
    "kvgov": kvgov.__file__,
    "migrations": str(migrations_dir()),
    "revision": current_revision(url),
}))
"""


def _run(*args: str | Path, cwd: Path, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        [str(a) for a in args],
        check=False,
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_upgrade_from_an_installed_wheel(tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "*.pyc")
    for name in SHIPPED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, project / name, ignore=ignore)
        else:
            shutil.copy2(src, project / name)
    wheels = tmp_path / "wheels"
    pip = (sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input")
    _run(*pip, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", wheels, ".", cwd=project)
    [wheel] = wheels.glob("kvgov-*.whl")

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    _run(
        *pip,
        "--python",
        python,
        "install",
        "--no-deps",
        "--no-build-isolation",
        "-q",
        wheel,
        cwd=tmp_path,
    )
    target = Path(
        _run(
            python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))", cwd=tmp_path
        ).strip()
    )
    (target / "kvgov-deps.pth").write_text(sysconfig.get_path("purelib") + "\n")

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVGOV_", "PYTHON"))}
    url = f"sqlite:///{(elsewhere / 'api.db').as_posix()}"
    probe = json.loads(_run(python, "-c", PROBE, url, cwd=elsewhere, env=env))
    assert Path(probe["kvgov"]).is_relative_to(env_dir)  # the wheel, not the checkout
    assert Path(probe["migrations"]).is_relative_to(env_dir)
    assert probe["revision"] == head_revision()  # the checkout's newest migration
    assert (Path(probe["migrations"]).parent / "alembic.ini").is_file()

    cli_url = f"sqlite:///{(elsewhere / 'cli.db').as_posix()}"
    out = _run(
        env_dir / "bin" / "kvgov",
        "db",
        "upgrade",
        cwd=elsewhere,
        env={**env, "KVGOV_DATABASE_URL": cli_url, "KVGOV_DATA_DIR": str(elsewhere)},
    )
    assert head_revision() in out

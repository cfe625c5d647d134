"""The image's privilege stripping, run for real (``tests/security/test_image_privileges.py``
says why it matters): the built image holds no file with file capabilities and no setuid or
setgid file, and the Containerfile's own stripping step, run again in a container of that image
over files planted there (a copy of ``true`` carrying ``cap_net_raw+ep`` as Debian's ``ping``
does, one in the copied venv too, and a setuid copy), leaves none of them.

The debootstrap base has no capability-bearing binary of its own, so the image scan alone
would pass with or without the step: the planted files are what show the step works (the scan
before the step must see them, or the test proves nothing and fails).
"""

from __future__ import annotations

import pytest

from tests.e2e import containers as c
from tests.security.test_image_privileges import strip_step

pytestmark = [pytest.mark.container, pytest.mark.slow]

CAPPED = ("/usr/local/bin/kvgov-capped", "/opt/kvgov/bin/kvgov-capped")
SETUID = "/usr/local/bin/kvgov-setuid"

#: as root in the container: copies of ``true``, two with a version-2 ``security.capability``
#: xattr granting CAP_NET_RAW (13) permitted and effective, one setuid root
_PLANT = f"""
import os, shutil, struct
cap = struct.pack("<5I", 0x02000001, 1 << 13, 0, 0, 0)
for path in {CAPPED!r}:
    shutil.copy("/usr/bin/true", path)
    os.setxattr(path, "security.capability", cap, follow_symlinks=False)
shutil.copy("/usr/bin/true", {SETUID!r})
os.chmod({SETUID!r}, 0o4755)
"""


def test_image_has_no_capability_or_setuid_file(kvgov_image: str) -> None:
    assert c.files_with_capabilities(kvgov_image) == [], "file capabilities in the image"
    setuid = c.podman(
        "run", "--rm", "--user", "0", "--network=none", "--no-healthcheck",
        "--entrypoint", "find", kvgov_image, "/", "-xdev", "-perm", "/6000", "-type", "f",
    )  # fmt: skip
    assert setuid.stdout.split() == [], "setuid/setgid files in the image"


def test_the_containerfile_step_strips_planted_capabilities_and_setuid(kvgov_image: str) -> None:
    script = (
        'python3 -B -c "$PLANT" && python3 -B -c "$SCAN" && find / -xdev -perm /6000 -type f'
        f" && echo --- && {strip_step()}"
        ' && python3 -B -c "$SCAN" && find / -xdev -perm /6000 -type f'
    )
    proc = c.podman(
        "run", "--rm", "--user", "0", "--network=none", "--no-healthcheck",
        "--cap-add=SETFCAP", "-e", f"PLANT={_PLANT}", "-e", f"SCAN={c.FILE_CAPS_SCAN}",
        "--entrypoint", "sh", kvgov_image, "-c", script,
        check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    before, _, after = proc.stdout.partition("---")
    assert sorted(before.split()) == sorted([*CAPPED, SETUID]), "the plant did not take"
    assert after.split() == [], f"left by the Containerfile's step: {after.split()}"

"""The sidecar image keeps no file that raises privileges at exec (attacker review: the image
stripped setuid/setgid bits but only *detected* file capabilities, in a test, so a base whose
binaries carry a ``security.capability`` xattr, Debian's ``ping`` with ``cap_net_raw`` for one,
would ship it, and ``tests/e2e/test_image.py``'s scan passed only because the debootstrap base
happens to have none).

Attacker: code running as the sidecar's uid (a dependency's bug, a compromised wheel) in a
container started without ``no_new_privs`` (a plain ``podman run`` or ``docker run``, a
platform that does not set ``allowPrivilegeEscalation: false``): exec'ing a binary with file
capabilities hands it those capabilities, up to the container's bounding set, without any setuid
bit; setuid/setgid files do the same for root.

The door holds when the runtime stage's last change to the root filesystem, run as root after
every ``COPY``, removes both from every file of the root filesystem. Offline here (the
Containerfile's text); ``tests/e2e/test_image_privileges.py`` runs that very step in the built
image over planted files, and scans the image.
"""

from __future__ import annotations

import re

from tests.security.test_image_lock import _stages

#: the xattr the kernel reads file capabilities from
CAP_XATTR = "security.capability"


def strip_step() -> str:
    """The runtime stage's step that strips file capabilities, as its shell command; fails
    when there is none, or more than one."""
    runtime = _stages()["runtime"]
    steps = [i for i in runtime if i.startswith("RUN ") and CAP_XATTR in i]
    assert steps, "the runtime stage has no step that strips file capabilities"
    assert len(steps) == 1, steps
    return steps[0].removeprefix("RUN ")


def test_the_runtime_stage_strips_file_capabilities_and_setuid_last_as_root() -> None:
    runtime = _stages()["runtime"]
    step = strip_step()
    at = runtime.index(f"RUN {step}")
    # the whole root filesystem, not one folder
    assert re.search(r"\bfind / -xdev\b", step), step
    assert "removexattr" in step, f"{CAP_XATTR} is read, never removed: {step}"
    assert "-perm /6000" in step and "chmod a-s" in step, "setuid/setgid left to another step"
    # after everything that adds files (the venv from the build stage included) ...
    adds = [i for i, ins in enumerate(runtime) if re.match(r"(COPY|ADD|RUN) ", ins)]
    assert adds[-1] == at, f"files are added after the stripping step: {runtime[at + 1 :]}"
    # ... and as root (a USER before it would make it fail, or skip what it cannot read)
    assert not any(ins.startswith("USER ") for ins in runtime[:at]), "stripped as non-root"
    assert any(ins.startswith("USER ") for ins in runtime[at:]), "the image runs as root"

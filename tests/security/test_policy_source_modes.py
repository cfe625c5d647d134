"""Attack: an operator's policy sources (``policy.data_file``, the modules and manifest under
``policy.policy_dir``) were read with a plain ``read_text``, unlike every other file kvgov
takes a trust from (``kvgov.privatefs.read_guarded_file``). Whoever could write a data document
its group or others may write (a shared host path, a volume mounted ``0666``) decided which
engines may read which tenant's cache: the sidecar loaded it at start and on every change.

Now a policy source is refused, at start and on reload, when its group or others may write it
(or a user but kvgov's or root owns it: not testable here, the suite runs as root); a refused
reload leaves the policy in force. Real regorus throughout.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvgov.errors import PolicyError
from kvgov.policy.bundle import load_bundle
from kvgov.policy.embedded import EmbeddedPolicyEngine
from tests.unit.test_policy_cache_ttl import ALLOW


def _data_file(tmp_path: Path, mode: int) -> tuple[Path, dict[str, Any]]:
    config: dict[str, Any] = json.loads(json.dumps(load_bundle().config))
    path = tmp_path / "data.json"
    path.write_text(json.dumps(config))
    path.chmod(mode)
    return path, config


@pytest.mark.parametrize("mode", [0o666, 0o646, 0o664], ids=["world", "others", "group"])
def test_a_data_document_others_may_write_is_refused_at_start(tmp_path: Path, mode: int) -> None:
    data, _ = _data_file(tmp_path, mode)
    try:
        load_bundle(None, data)
    except PolicyError as exc:
        assert "writable by" in exc.message and str(data) in exc.message
        assert "tenants" not in exc.message  # never what the file holds
    else:
        pytest.fail(f"a policy data document of mode {mode:04o} was loaded: its writers decide")


def test_a_module_others_may_write_is_refused(tmp_path: Path) -> None:
    policy = tmp_path / "policy"
    policy.mkdir()
    for module in load_bundle().modules:
        (policy / module.name).write_text(module.source)
        (policy / module.name).chmod(0o644)
    load_bundle(policy, None)  # as a ConfigMap mounts them: root's, 0644
    victim = policy / load_bundle().modules[0].name
    victim.chmod(0o666)
    with pytest.raises(PolicyError, match="writable by"):
        load_bundle(policy, None)


async def test_a_reload_of_a_data_document_made_writable_keeps_the_policy_in_force(
    tmp_path: Path,
) -> None:
    data, config = _data_file(tmp_path, 0o644)
    engine = EmbeddedPolicyEngine.from_paths(None, data)
    revision = engine.revision
    config["revision"] = "planted"
    data.write_text(json.dumps(config))
    data.chmod(0o666)
    with pytest.raises(PolicyError, match="writable by"):
        await engine.reload()
    assert engine.revision == revision, "a data document others may write was put in force"
    assert engine.decide_sync(ALLOW).allowed
    data.chmod(0o644)  # the operator fixes the mode: the change loads
    assert (await engine.reload()).data.startswith("planted")

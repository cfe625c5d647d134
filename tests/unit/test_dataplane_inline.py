"""Where the data plane seals and opens: the CPUs it may use, and the threshold they imply."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvgov.config import Settings
from kvgov.proxy.dataplane.plans import (
    INLINE_ALL,
    INLINE_CRYPTO_BYTES,
    inline_crypto_bytes,
    usable_cpus,
)


def _affinity() -> int:
    return len(os.sched_getaffinity(0))


def test_a_cgroup_quota_caps_the_cpus(tmp_path: Path) -> None:
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # 1.5 CPUs: two may run at once
    assert usable_cpus(tmp_path) == min(2, _affinity())
    (tmp_path / "cpu.max").write_text("20000 100000\n")  # a fifth of one: still one
    assert usable_cpus(tmp_path) == 1


@pytest.mark.parametrize("content", ["max 100000\n", "garbage\n", None])
def test_no_quota_means_the_affinity(tmp_path: Path, content: str | None) -> None:
    if content is not None:
        (tmp_path / "cpu.max").write_text(content)
    assert usable_cpus(tmp_path) == _affinity()


def test_the_threshold_follows_the_cpus_unless_configured() -> None:
    assert inline_crypto_bytes(None, cpus=1) == INLINE_ALL
    assert inline_crypto_bytes(None, cpus=2) == INLINE_ALL
    assert inline_crypto_bytes(None, cpus=3) == INLINE_CRYPTO_BYTES
    assert inline_crypto_bytes(0, cpus=1) == 0  # configured: as given
    assert inline_crypto_bytes(8 << 20, cpus=64) == 8 << 20


def test_the_setting_refuses_a_negative_size() -> None:
    with pytest.raises(ValueError, match="inline_crypto_bytes"):
        Settings(dataplane={"inline_crypto_bytes": -1})

"""Fixtures of the end-to-end tests."""

from __future__ import annotations

import pytest

from tests.e2e import containers


@pytest.fixture(scope="session")
def kvgov_image() -> str:
    """The sidecar image, built once per session (skips without a container runtime)."""
    return containers.build_image()

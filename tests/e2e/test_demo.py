"""``kvgov demo`` end to end: a real sidecar and two real LMCache engines, in one command."""

from __future__ import annotations

import pytest

pytest.importorskip("lmcache")

from typer.testing import CliRunner

from kvgov.cli.main import build_app

pytestmark = [pytest.mark.lmcache, pytest.mark.slow]


def test_demo_runs_every_step_and_reports_success() -> None:
    result = CliRunner().invoke(build_app(), ["demo"])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "512 of 512 tokens loaded from kvgov; KV bytes identical: True" in out
    assert "0 tokens hit: another tenant's keys never match" in out
    assert "policy denied the put: 0 tokens cached" in out
    assert out.count("created by req-1") == 2
    assert "all steps behaved as expected" in out
    assert "alice" not in out.split("provenance of req-2")[1]  # pseudonyms only

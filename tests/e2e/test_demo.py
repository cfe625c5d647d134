"""``kvgov demo`` end to end: a real sidecar and two real LMCache engines, in one command.

Checks every step the demo prints, the right to be forgotten included: the purge runs through
the sidecar's purge service and completes, its signed receipt verifies, the purged user's
prompts get 0 hits on both engines while another user's still hit, and the ledger verifies.
"""

from __future__ import annotations

import re

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
    assert "alice" not in out.split("provenance of req-2")[1].split("\n6.")[0]  # pseudonyms only

    purge = out.split("asks to be forgotten")[1].split("\n8.")[0]
    assert re.search(r"purge [0-9a-f]{8}: completed in \d+\.\d s", purge), purge
    # alice's 2 shared chunks and her private one, from the sidecar's memory tier
    assert "entries purged: 3; deleted per tier: memory 3 (verified absent)" in purge
    assert re.search(r"keys destroyed: u:acme:[0-9a-f]+\.\.\. v1 ", purge), purge
    assert "engines acknowledged EVICT: vllm-1, vllm-2" in purge
    assert re.search(r"ledger: erasure event at seq \d+, signed checkpoint at seq \d+", purge)
    assert "receipt signature: valid (Ed25519" in purge
    assert "NOT DONE" not in purge
    assert "alice" not in purge.split("\n", 2)[2]  # the receipt names her pseudonym only

    after = out.split("\n8. after the purge")[1].split("\n9.")[0]
    assert "alice's prompt: 0 tokens hit on vllm-1, 0 on vllm-2" in after
    assert "alice's private history: 0 tokens hit on vllm-1, 0 on vllm-2" in after
    assert "erin's prompt: still 512 of 512 tokens hit on vllm-1, 512 on vllm-2" in after

    ledger = out.split("\n9. ledger integrity")[1]
    assert re.search(r"ok: \d+ events, [1-9]\d* signed checkpoint\(s\); every hash and", ledger)
    assert "BROKEN" not in ledger
    assert "all steps behaved as expected" in out

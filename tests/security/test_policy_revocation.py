"""An engine revoked in the policy keeps its access until the sidecar restarts.

Attack (review s10): an operator removes an engine from a tenant's ``engines`` (its token
leaked, the engine was decommissioned) by updating the policy data: a ConfigMap updated in
place, as ``docs/deploy.md`` says. The running sidecar had loaded its policy at start and
never read it again, and its decision cache kept serving the allows it had given: the revoked
engine went on reading and writing the tenant's cache until the next restart. Now the sidecar
follows its policy sources (``policy.reload_interval_s``), reloads on a change and drops its
cached decisions; a change that does not load leaves the policy in force answering.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from kvgov.proxy.app import Sidecar, build_sidecar
from kvgov.types import EventKind
from kvgov.wire import RequestContext
from tests.security import doors
from tests.security.doors import engine, events, run

pytestmark = pytest.mark.postgres

CTX = RequestContext(request_id="req-revoke", user="u1")
#: how often the sidecar looks at its policy sources here (the default is 10 s)
EVERY_S = 0.2
#: generous: many intervals, on a loaded CI machine
WITHIN_S = 15.0


def _revoked(data: dict[str, Any]) -> str:
    data = json.loads(json.dumps(data))
    data["tenants"]["acme"]["engines"] = ["lm-acme"]  # vllm-acme removed
    data["revision"] = "security-doors-revoked"
    return json.dumps(data)


def _poll(check: Any, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(EVERY_S / 2)
    return False


@asynccontextmanager
async def _sidecar(tmp_path: Path, db: doors.ProdDatabase) -> AsyncIterator[tuple[Sidecar, Path]]:
    """A production sidecar that looks at its policy data file every ``EVERY_S``."""
    st = doors.settings(tmp_path, db)
    st = st.model_copy(
        update={"policy": st.policy.model_copy(update={"reload_interval_s": EVERY_S})}
    )
    assert st.policy.data_file is not None
    sc = await build_sidecar(st)
    await sc.start()
    try:
        yield sc, st.policy.data_file
    finally:
        await sc.stop()


async def test_an_engine_removed_from_a_tenant_loses_access_without_a_restart(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    async with _sidecar(tmp_path, prod_db) as (sc, data_file):
        original = json.loads(data_file.read_text())
        acme, globex = engine(sc, "tok-acme"), engine(sc, "tok-globex")
        a_key, g_key = doors.key(1, "acme"), doors.key(2, "globex")
        value = b"acme's prompt KV " * 4096
        assert (await run(acme.put, a_key, value, CTX)).ok
        # allowed: now a cached allow
        assert doors.value_of(await run(acme.get, a_key, CTX)) == value
        assert (await run(globex.put, g_key, value, CTX)).ok

        # the operator revokes vllm-acme from acme
        doors.replace_file(data_file, _revoked(original))

        def acme_refused() -> bool:
            return acme.get(a_key, CTX) is None

        assert await run(_poll, acme_refused, WITHIN_S), (
            "the revoked engine still reads the tenant's cache"
        )
        assert not (await run(acme.put, doors.key(3, "acme"), value, CTX)).ok
        # the denial is on record, under the new data revision
        await sc.pipeline.recorded()
        assert sc.writer is not None
        await sc.writer.flush()
        denies = [
            e
            for e in events(sc, EventKind.POLICY_DECISION)
            if e.attrs.get("allowed") is False
            and str(e.attrs.get("data_revision", "")).startswith("security-doors-revoked")
        ]
        assert denies, "no denial recorded under the new policy data"
        # another tenant's engine is untouched
        assert doors.value_of(await run(globex.get, g_key, CTX)) == value
        acme.close()
        globex.close()


async def test_a_policy_change_that_does_not_load_leaves_the_policy_in_force(
    tmp_path: Path, prod_db: doors.ProdDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    """Invalid data (a half-written file, a typo) is refused and logged once, not every
    interval; the policy in force keeps answering; the next valid change is taken."""
    caplog.set_level(logging.ERROR, logger="kvgov.policy.watch")
    async with _sidecar(tmp_path, prod_db) as (sc, data_file):
        original = json.loads(data_file.read_text())
        acme = engine(sc, "tok-acme")
        a_key = doors.key(1, "acme")
        value = b"acme's prompt KV " * 4096
        assert (await run(acme.put, a_key, value, CTX)).ok
        doors.replace_file(data_file, '{"tenants": ')
        await run(time.sleep, 10 * EVERY_S)
        refused = [r for r in caplog.records if r.getMessage() == "policy.reload_refused"]
        assert len(refused) == 1, "an invalid change must be logged, once"
        assert doors.value_of(await run(acme.get, a_key, CTX)) == value
        doors.replace_file(data_file, _revoked(original))

        def acme_refused() -> bool:
            return acme.get(a_key, CTX) is None

        assert await run(_poll, acme_refused, WITHIN_S), "the valid change was not taken"
        acme.close()


async def test_a_change_is_parsed_once_not_once_more_by_the_followers_look(
    tmp_path: Path, prod_db: doors.ProdDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Parsing the Rego (regorus) holds the GIL, and so the event loop, for milliseconds: the
    follower's look reads the revision only, and the reload that follows checks the sources
    itself. It used to parse them twice per change (the look, then the reload)."""
    from kvgov.policy import bundle

    parsed: list[int] = []
    check = bundle.check_modules

    def counting(*args: Any, **kwargs: Any) -> None:
        parsed.append(1)
        check(*args, **kwargs)

    async with _sidecar(tmp_path, prod_db) as (sc, data_file):
        monkeypatch.setattr(bundle, "check_modules", counting)
        acme = engine(sc, "tok-acme")
        a_key = doors.key(1, "acme")
        assert (await run(acme.put, a_key, b"kv " * 30_000, CTX)).ok
        doors.replace_file(data_file, _revoked(json.loads(data_file.read_text())))

        def acme_refused() -> bool:
            return acme.get(a_key, CTX) is None

        assert await run(_poll, acme_refused, WITHIN_S), "the change was not taken"
        await run(time.sleep, 5 * EVERY_S)  # more looks at the unchanged sources
        assert len(parsed) == 1, f"the change was parsed {len(parsed)} times"
        acme.close()

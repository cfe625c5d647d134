"""An engine id a purge receipt would show as another engine.

Attack (last session's list): a receipt's ``engines`` step names a kvgov-wire engine by its
bare id and the ``lm://`` listener's engine as ``lm:<id>``. Engine ids come from the operator's
token map (``dataplane.engine_tokens``, or its file, read again while the sidecar runs) and,
where no tokens are configured, from the HELLO itself. A wire engine named ``lm:10.0.0.5`` read
in a receipt like the ``lm://`` engine (which is never sent EVICT); ids with control or
format characters or surrounding blanks could pass for another engine in a receipt, a log line
or the dashboard. Now such an id is refused wherever it enters: settings validation, start-up
from a token file, a token file reloaded at run time (the entry alone is left out, logged and
counted; the other tokens keep serving) and a HELLO without tokens.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvgov.config import load_settings
from kvgov.errors import ConfigError
from kvgov.proxy.app import build_sidecar
from kvgov.proxy.dataplane.server import WireServer
from kvgov.wire import RequestContext
from kvgov.wire.codec import ErrorCode, WireError
from tests.security import doors
from tests.security.doors import engine, run

# the Secrets these tests write are their user's alone, as kvgov requires
pytestmark = pytest.mark.usefixtures("private_umask")

CTX = RequestContext(request_id="req-engine-ids", user="u1")
VALUE = b"acme's prompt KV " * 256
EVERY_S = 0.2
WITHIN_S = 15.0

#: ids a receipt, a log line or the dashboard would show as something they are not
CONFUSING = {
    "lm-prefix": "lm:10.0.0.5",
    "lm-prefix-upper": "LM:10.0.0.5",
    "lm-prefix-fullwidth": "\uff4c\uff4d:10.0.0.5",
    "newline": "vllm-0\nvllm-1",
    "bidi-override": "vllm-\u202e0",
    "zero-width": "vllm-0\u200b",
    "blank-around": " vllm-0",
    "too-long": "v" * 129,
    "nul": "eng\x00",
}


@pytest.mark.parametrize("engine_id", list(CONFUSING.values()), ids=list(CONFUSING))
def test_a_hello_without_tokens_cannot_name_a_confusing_engine(engine_id: str) -> None:
    """Where the HELLO's id becomes the identity (a local peer, development)."""
    server: Any = SimpleNamespace(
        config=SimpleNamespace(engine_tokens={}, allow_anonymous=True),
        _token_ids={},
        tokens_configured=False,
    )
    conn: Any = SimpleNamespace(unix=False, peer_uid=None)
    with pytest.raises(WireError) as err:
        WireServer.authenticate(server, {"engine": engine_id}, conn)
    assert err.value.error is ErrorCode.UNAUTHENTICATED
    assert WireServer.authenticate(server, {"engine": "vllm-0"}, conn).engine == "vllm-0"


@pytest.mark.parametrize("engine_id", list(CONFUSING.values()), ids=list(CONFUSING))
def test_settings_refuse_a_confusing_engine_id(engine_id: str) -> None:
    with pytest.raises(ConfigError, match="engine id") as exc:
        load_settings(dataplane={"engine_tokens": {"s3cret-tok": engine_id}})
    assert "s3cret-tok" not in exc.value.diagnostics()


pg = pytest.mark.postgres


@pg
async def test_start_up_refuses_a_token_file_naming_an_lm_engine(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    tokens = tmp_path / "engine-tokens.json"
    tokens.write_text(json.dumps({**doors.TOKENS, "tok-lm": "lm:10.0.0.5"}))
    st = doors.settings(tmp_path, prod_db)
    dp = st.dataplane.model_copy(update={"engine_tokens": {}, "engine_tokens_file": tokens})
    with pytest.raises(ConfigError, match='begins with "lm:"') as exc:
        await build_sidecar(st.model_copy(update={"dataplane": dp}))
    assert str(tokens) in str(exc.value)
    assert "tok-lm" not in exc.value.diagnostics()


@pg
async def test_a_reloaded_token_file_leaves_out_an_lm_engine_and_serves_the_others(
    tmp_path: Path, prod_db: doors.ProdDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    """The operator (or whoever edits the Secret) renames acme's engine ``lm:10.0.0.5``: that
    entry is refused (its token opens nothing, its connections close), logged and counted,
    and globex's engine goes on being served on the connection it had."""
    caplog.set_level(logging.WARNING)
    tokens = tmp_path / "engine-tokens.json"
    tokens.write_text(json.dumps(doors.TOKENS))
    st = doors.settings(tmp_path, prod_db)
    dp = st.dataplane.model_copy(
        update={
            "engine_tokens": {},
            "engine_tokens_file": tokens,
            "engine_tokens_reload_interval_s": EVERY_S,
        }
    )
    sc = await build_sidecar(st.model_copy(update={"dataplane": dp}))
    await sc.start()
    acme, globex = engine(sc, "tok-acme"), engine(sc, "tok-globex")
    try:
        assert (await run(acme.put, doors.key(1, "acme"), VALUE, CTX)).ok
        assert (await run(globex.put, doors.key(2, "globex"), VALUE, CTX)).ok
        doors.replace_file(tokens, json.dumps({**doors.TOKENS, "tok-acme": "lm:10.0.0.5"}))

        def refused() -> bool:
            return any(r.getMessage() == "dataplane.tokens.entries_refused" for r in caplog.records)

        assert await doors.until(refused, WITHIN_S), "the lm: entry was taken without a word"
        record = next(
            r for r in caplog.records if r.getMessage() == "dataplane.tokens.entries_refused"
        )
        assert "tok-acme" not in str(vars(record))
        counted = sc.metrics.registry.get_sample_value(
            "kvgov_dataplane_engine_tokens_refused_total"
        )
        assert counted == 1
        named = {c.identity.engine for c in sc.server.connections if c.identity is not None}
        assert "lm:10.0.0.5" not in named
        assert "vllm-acme" not in named, "the refused token's connections stay open"
        again = engine(sc, "tok-acme")
        try:
            with pytest.raises(WireError) as err:
                await run(again.get, doors.key(1, "acme"), CTX)
        finally:
            again.close()
        assert err.value.error is ErrorCode.UNAUTHENTICATED
        assert doors.value_of(await run(globex.get, doors.key(2, "globex"), CTX)) == VALUE
    finally:
        acme.close()
        globex.close()
        await sc.stop()

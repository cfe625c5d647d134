"""An engine token removed from the sidecar's token file keeps working until a restart.

Attack (review s10): an engine's token leaks; the operator removes it from the mounted Secret
(``dataplane.engine_tokens_file``). The sidecar had read the file at start only: the leaked
token still opened new connections, and the connections it had opened went on, until the next
restart. Now the sidecar follows the file (``dataplane.engine_tokens_reload_interval_s``): a
removed token opens no new connection and the connections it opened are closed, while the
other engines' connections stay; a file that does not read leaves the tokens in force.

Review r16 (finding 3): the shipped layout has one token, so removing the leaked one leaves
``{}``; that file was refused as "no tokens" and the leaked token kept working until a restart.
A file that reads but holds no valid token now revokes every token, and the sidecar then admits
nobody, not even the Unix socket peer of its own uid that a sidecar never given tokens admits.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

from kvgov.config import Settings
from kvgov.proxy.app import Sidecar, build_sidecar
from kvgov.wire import RequestContext
from kvgov.wire.codec import ErrorCode, WireError
from tests.security import doors
from tests.security.doors import engine, run

pytestmark = [pytest.mark.postgres, pytest.mark.usefixtures("private_umask")]

CTX = RequestContext(request_id="req-token-revoke", user="u1")
EVERY_S = 0.2
WITHIN_S = 15.0
VALUE = b"acme's prompt KV " * 1024


def _settings(tmp_path: Path, db: doors.ProdDatabase, **dataplane: Any) -> tuple[Settings, Path]:
    """A production sidecar's settings with its engine tokens in a file it looks at every
    ``EVERY_S``; and the file."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    tokens = tmp_path / "engine-tokens.json"
    tokens.write_text(json.dumps(doors.TOKENS))
    st = doors.settings(tmp_path, db, **dataplane)
    dp = st.dataplane.model_copy(
        update={
            "engine_tokens": {},
            "engine_tokens_file": tokens,
            "engine_tokens_reload_interval_s": EVERY_S,
        }
    )
    return st.model_copy(update={"dataplane": dp}), tokens


@asynccontextmanager
async def _sidecar(
    tmp_path: Path, db: doors.ProdDatabase, **dataplane: Any
) -> AsyncIterator[tuple[Sidecar, Path]]:
    st, tokens = _settings(tmp_path, db, **dataplane)
    sc = await build_sidecar(st)
    await sc.start()
    try:
        yield sc, tokens
    finally:
        await sc.stop()


def _engines(sc: Sidecar) -> dict[str, set[int]]:
    """The sidecar's authenticated connections, by engine (their ids)."""
    out: dict[str, set[int]] = {}
    for conn in sc.server.connections:
        if conn.identity is not None:
            out.setdefault(conn.identity.engine, set()).add(id(conn))
    return out


def _refused_within(client: Any, seconds: float) -> WireError | None:
    """Poll ``client`` until a request is refused as unauthenticated; that refusal, or None."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            client.get(doors.key(1, "acme"), CTX)
        except WireError as exc:
            if exc.error is ErrorCode.UNAUTHENTICATED:
                return exc
        time.sleep(EVERY_S / 2)
    return None


async def test_a_token_removed_from_the_file_opens_nothing_and_its_connections_close(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    async with _sidecar(tmp_path, prod_db) as (sc, tokens):
        acme, globex = engine(sc, "tok-acme"), engine(sc, "tok-globex")
        assert (await run(acme.put, doors.key(1, "acme"), VALUE, CTX)).ok
        assert (await run(globex.put, doors.key(2, "globex"), VALUE, CTX)).ok
        before = _engines(sc)
        assert before.get("vllm-acme") and before.get("vllm-globex")

        revoked = {t: e for t, e in doors.TOKENS.items() if t != "tok-acme"}
        doors.replace_file(tokens, json.dumps(revoked))

        refused = await run(_refused_within, acme, WITHIN_S)
        assert refused is not None, "the removed token still opens connections"
        assert "vllm-acme" not in _engines(sc), "the removed token's connections stay open"
        # the other engine's connection was never closed: the same one answers
        assert doors.value_of(await run(globex.get, doors.key(2, "globex"), CTX)) == VALUE
        assert _engines(sc)["vllm-globex"] & before["vllm-globex"]
        acme.close()
        globex.close()


async def test_a_token_file_that_does_not_read_leaves_the_tokens_in_force(
    tmp_path: Path, prod_db: doors.ProdDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    async with _sidecar(tmp_path, prod_db) as (sc, tokens):
        acme = engine(sc, "tok-acme")
        assert (await run(acme.put, doors.key(1, "acme"), VALUE, CTX)).ok
        doors.replace_file(tokens, '{"tok-acme": ')  # half written
        await run(time.sleep, 10 * EVERY_S)
        refused = [r for r in caplog.records if r.getMessage() == "dataplane.tokens.reload_refused"]
        assert len(refused) == 1, "a token file that does not read must be logged, once"
        assert "tok-acme" not in refused[0].getMessage() + str(vars(refused[0]))
        assert doors.value_of(await run(acme.get, doors.key(1, "acme"), CTX)) == VALUE
        acme.close()


async def test_a_token_revoked_during_its_handshake_is_refused_at_its_end(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    """The sidecar answers a HELLO naming a token with its challenge; the token is revoked
    before the engine's proof arrives: the proof, right as it is, opens nothing."""
    from kvgov.wire.codec import PROTOCOL_VERSION, FrameType
    from tests.security.doors import RawWire

    async with _sidecar(tmp_path, prod_db) as (sc, _):
        first, answer = doors.token_hello("tok-acme", {"engine": "x", "version": PROTOCOL_VERSION})
        raw = RawWire(sc.server.tcp_port or 0)
        try:
            raw.send(FrameType.HELLO, 1, first)
            challenge = await run(raw.read)
            proof = answer(challenge.meta)
            revoked = {t: e for t, e in doors.TOKENS.items() if t != "tok-acme"}
            sc.server.replace_tokens({t: SecretStr(e) for t, e in revoked.items()})
            raw.send(FrameType.HELLO, 1, proof)
            refused = await run(raw.read)
        finally:
            raw.close()
        assert refused.error == "unauthenticated"
        assert "vllm-acme" not in _engines(sc)


@pytest.mark.parametrize(
    "bad",
    [
        json.dumps(doors.TOKENS)[:-1] + ', "\\ud83d": "x"}',  # half a surrogate pair
        "[" * 100_000,  # nested beyond the parser's recursion
    ],
    ids=["lone-surrogate", "deep-nesting"],
)
async def test_a_token_file_that_breaks_the_reader_does_not_stop_later_revocations(
    tmp_path: Path, prod_db: doors.ProdDatabase, bad: str
) -> None:
    """(review s10) Only a ConfigError was caught: a token that is no text raised deeper, a
    deeply nested file raised RecursionError, the follower task ended, and the leaked token
    removed afterwards (as ``docs/deploy.md`` says) kept working."""
    async with _sidecar(tmp_path, prod_db) as (sc, tokens):
        follower = next(t for t in sc._tasks if t.get_name() == "kvgov-engine-tokens")
        acme = engine(sc, "tok-acme")
        assert (await run(acme.put, doors.key(1, "acme"), VALUE, CTX)).ok
        doors.replace_file(tokens, bad)
        await run(time.sleep, 5 * EVERY_S)
        assert not follower.done(), "the token follower died"
        assert doors.value_of(await run(acme.get, doors.key(1, "acme"), CTX)) == VALUE
        revoked = {t: e for t, e in doors.TOKENS.items() if t != "tok-acme"}
        doors.replace_file(tokens, json.dumps(revoked))
        assert await run(_refused_within, acme, WITHIN_S) is not None, "the leaked token works"
        acme.close()


#: files that parse to a JSON object holding no token the sidecar would take: emptied, or
#: left with an entry whose engine id is refused (``lm:...``, :mod:`kvgov.engine_ids`)
EMPTIED = ["{}", '{"tok-new": "lm:vllm"}']


@pytest.mark.parametrize("emptied", EMPTIED, ids=["empty-object", "only-refused-ids"])
async def test_emptying_the_token_file_revokes_every_token(
    tmp_path: Path, prod_db: doors.ProdDatabase, emptied: str, caplog: pytest.LogCaptureFixture
) -> None:
    """(review r16, finding 3) The shipped layout has one token for the whole Deployment; an
    operator revokes it, as ``docs/deploy.md`` says, by removing it from the Secret: the file
    becomes ``{}`` (or keeps an entry whose id is refused). That file was refused as "no
    tokens" and the leaked token kept working, open connections and all, until a restart."""
    caplog.set_level(logging.INFO)
    async with _sidecar(tmp_path, prod_db) as (sc, tokens):
        acme, globex = engine(sc, "tok-acme"), engine(sc, "tok-globex")
        try:
            async with doors.control_up(sc, "tok-demo"):
                assert (await run(acme.put, doors.key(1, "acme"), VALUE, CTX)).ok
                assert (await run(globex.put, doors.key(2, "globex"), VALUE, CTX)).ok
                assert set(_engines(sc)) == {"vllm-acme", "vllm-globex", "vllm-demo"}
                assert sc.server.controls

                doors.replace_file(tokens, emptied)

                refused = await run(_refused_within, acme, WITHIN_S)
                assert refused is not None, (
                    "every token removed from the file, and the leaked one still opens connections"
                )
                assert await doors.until(lambda: not _engines(sc), WITHIN_S), (
                    f"connections opened with revoked tokens stay open: {_engines(sc)}"
                )
                assert not sc.server.controls, "a revoked engine's control channel stays open"
                assert await run(_refused_within, globex, 2.0) is not None
        finally:
            acme.close()
            globex.close()
        logged = [r for r in caplog.records if r.getMessage() == "dataplane.tokens.all_revoked"]
        assert len(logged) == 1 and logged[0].levelno == logging.ERROR, (
            "revoking every engine token must be logged, once, as an error"
        )
        assert not any(
            t in r.getMessage() + str(vars(r)) for r in caplog.records for t in doors.TOKENS
        )


async def test_after_every_token_is_revoked_a_unix_peer_of_the_sidecars_uid_is_refused(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    """The fix must not fall back to what a sidecar configured without tokens does: on its Unix
    socket, admit a peer of its own uid (or root) as whatever engine it names. Once tokens were
    configured, an empty map admits nobody (``engine tokens revoked``)."""
    from kvgov.wire.codec import PROTOCOL_VERSION, FrameType
    from tests.security.doors import RawWire

    short = Path(tempfile.mkdtemp(prefix="kvr-"))  # a socket path must stay short
    sock = short / "d.sock"
    try:
        async with _sidecar(tmp_path, prod_db, unix_path=str(sock)) as (sc, tokens):
            acme = engine(sc, "tok-acme")
            try:
                assert (await run(acme.put, doors.key(1, "acme"), VALUE, CTX)).ok
                doors.replace_file(tokens, "{}")
                revoked = await run(_refused_within, acme, WITHIN_S)
                assert revoked is not None, "every token removed, and the leaked one still works"
            finally:
                acme.close()
            for hello in (
                {"version": PROTOCOL_VERSION, "engine": "vllm-acme"},
                {"version": PROTOCOL_VERSION, "engine": "vllm-acme", "role": "control"},
            ):
                raw = RawWire.unix(str(sock))
                try:
                    raw.send(FrameType.HELLO, 1, hello)
                    reply = await run(raw.read)
                    assert reply.error == "unauthenticated", (
                        f"a token-less HELLO from the sidecar's own uid was admitted after every"
                        f" token was revoked: {reply.meta}"
                    )
                    assert "revoked" in str(reply.meta.get("message", "")), reply.meta
                    assert await run(raw.closed_by_peer)
                finally:
                    raw.close()
            raw = RawWire.unix(str(sock))
            try:
                reply = await run(raw.hello, "tok-acme")
                assert reply.error == "unauthenticated", reply.meta
            finally:
                raw.close()
            assert not _engines(sc)
    finally:
        shutil.rmtree(short, ignore_errors=True)


async def test_a_valid_token_file_after_a_revocation_restores_admission(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    """Revoking every token is not a dead end: the file the operator writes next (the new
    token) is taken, and only it opens connections."""
    async with _sidecar(tmp_path, prod_db) as (sc, tokens):
        acme = engine(sc, "tok-acme")
        try:
            assert (await run(acme.put, doors.key(1, "acme"), VALUE, CTX)).ok
            doors.replace_file(tokens, "{}")
            assert await run(_refused_within, acme, WITHIN_S) is not None, "the leaked token works"
        finally:
            acme.close()
        doors.replace_file(tokens, json.dumps({"tok-acme-2": "vllm-acme"}))
        fresh = engine(sc, "tok-acme-2")
        try:

            def admitted() -> bool:
                try:
                    return doors.value_of(fresh.get(doors.key(1, "acme"), CTX)) == VALUE
                except WireError:
                    return False

            assert await run(doors.wait_for, admitted, WITHIN_S), "the new token opens nothing"
        finally:
            fresh.close()
        stale = engine(sc, "tok-acme")
        try:
            with pytest.raises(WireError) as err:
                await run(stale.get, doors.key(1, "acme"), CTX)
        finally:
            stale.close()
        assert err.value.error is ErrorCode.UNAUTHENTICATED

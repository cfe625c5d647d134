"""The runtime database role forges provenance: a chain under a trusted key, events after a
writer's close.

Attack (review s9, item 2): with only the runtime role's documented grants (SELECT/INSERT on
``chains`` and ``ledger_events``; no signing key, no superuser), the unkeyed SHA-256 chain and
the public keys in ``chains`` let an attacker (a) register a NEW chain under a trusted node's
public key holding fabricated events (a ``user:data:purged``, ``kv:get`` provenance naming any
request) and (b) append events after a writer's final checkpoint. ``verify_trusted`` (what
``kvgov audit verify``, ``/v1/audit/verify`` and the dashboard run) reported both ok: unsigned
events were not a failure. Now a chain needs a genesis signed by its key (``no_genesis``), and
events written while no writer session held the chain open fail (``after_close``)
(:mod:`kvgov.ledger.seals`). The honest life of a chain (clean stops, restarts, a crash and
its restart) still verifies.

Every test connects as the runtime role a production sidecar uses (``prod_db``).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from typer.testing import CliRunner

from kvgov.cli.main import build_app
from kvgov.db.engine import make_engine, utcnow
from kvgov.db.models import Chain, LedgerEvent, table
from kvgov.errors import LedgerError
from kvgov.ledger.chain import GENESIS_HASH, ChainedFields, link, public_key_bytes
from kvgov.ledger.checkpoint import write_checkpoint
from kvgov.ledger.events import Event
from kvgov.ledger.trust import verify_trusted
from kvgov.ledger.verify import ChainReport, Problem, VerifyReport
from kvgov.ledger.writer import LedgerWriter
from kvgov.types import EventKind, Outcome
from tests.security.doors import ProdDatabase

pytestmark = pytest.mark.postgres

NODE_KEY = Ed25519PrivateKey.generate()  # the honest node's signing key (never Mallory's)
TRUSTED = {public_key_bytes(NODE_KEY)}
PEM = NODE_KEY.private_bytes(
    serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
).decode()


def _put(i: int) -> Event:
    return Event(kind=EventKind.KV_PUT, tenant="acme", key_digest=f"{i:064x}", outcome=Outcome.OK)


async def _write(url: str, chain_id: str, n: int, *, checkpoint: bool = True) -> None:
    """An honest writer's whole session: start, ``n`` events, a checkpoint, a clean close."""
    engine = make_engine(url)
    writer = LedgerWriter(engine, chain_id=chain_id, signing_key=NODE_KEY)
    try:
        await writer.start()
        for i in range(n):
            await writer.append(_put(i))
        if checkpoint:
            assert await writer.write_checkpoint() is not None
    finally:
        await writer.close()
        engine.dispose()


CRASHING_CHILD = textwrap.dedent(
    """
    import asyncio, sys
    from cryptography.hazmat.primitives import serialization
    from kvgov.db.engine import make_engine
    from kvgov.ledger.events import Event
    from kvgov.ledger.writer import LedgerWriter
    from kvgov.types import EventKind, Outcome

    async def main(url, pem, chain_id, n, tail, exclusive):
        key = serialization.load_pem_private_key(pem.encode(), password=None)
        flags = {"exclusive": True} if exclusive == "1" else {}
        writer = LedgerWriter(make_engine(url), chain_id=chain_id, signing_key=key, **flags)
        await writer.start()
        for i in range(int(n)):
            await writer.append(Event(kind=EventKind.KV_PUT, tenant="acme",
                                      key_digest=f"{i:064x}", outcome=Outcome.OK))
        await writer.write_checkpoint()  # a periodic checkpoint...
        for _ in range(int(tail)):  # ...events after it, and the process dies
            await writer.append(Event(kind=EventKind.KV_GET, tenant="acme",
                                      outcome=Outcome.HIT))
        sys.stdout.write("written\\n")
        sys.stdout.flush()
        await asyncio.sleep(3600)

    asyncio.run(main(*sys.argv[1:]))
    """
)


def _crash(
    url: str,
    chain_id: str,
    n: int,
    *,
    tail: int = 1,
    exclusive: bool = False,
    pem: str = PEM,
) -> None:
    """A writer signing with ``pem`` (the honest node's key by default) that writes ``n``
    events, a checkpoint and ``tail`` events more, then is killed (``kill -9``): no final
    checkpoint, no close."""
    args = [chain_id, str(n), str(tail), "01"[exclusive]]
    child = subprocess.Popen(
        [sys.executable, "-c", CRASHING_CHILD, url, pem, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        assert line == "written\n", child.stderr.read() if child.stderr else ""
        os.kill(child.pid, signal.SIGKILL)
    finally:
        if child.poll() is None:
            child.kill()
        child.wait(timeout=30)
        for stream in (child.stdout, child.stderr):
            if stream is not None:
                stream.close()


def _forge(
    conn: sa.Connection,
    chain_id: str,
    start_seq: int,
    prev: str,
    events: list[dict[str, Any]],
    occurred_at: datetime,
) -> None:
    """Events as the runtime role writes them: correct seq, prev_hash and (unkeyed) hash."""
    chained = set(ChainedFields.__dataclass_fields__) - {"attrs_json"}
    base: dict[str, Any] = dict.fromkeys(
        (
            "tenant",
            "actor",
            "request_id",
            "key_digest",
            "tier",
            "nbytes",
            "outcome",
            "reason",
            "decision_id",
            "policy_revision",
            "principal",
            "payload_digest",
        )
    )
    base |= {"attrs": {}, "encoding_version": 1}
    for i, ev in enumerate(events):
        values = {
            **base,
            **ev,
            "chain_id": chain_id,
            "seq": start_seq + i,
            "prev_hash": prev,
            "occurred_at": occurred_at,
        }
        values["hash"] = prev = link(ChainedFields(**{k: values[k] for k in chained}))
        conn.execute(table(LedgerEvent).insert().values(**values))


def _head(conn: sa.Connection, chain_id: str) -> tuple[int, str]:
    ev = table(LedgerEvent)
    seq, digest = conn.execute(
        sa.select(ev.c.seq, ev.c.hash)
        .where(ev.c.chain_id == chain_id)
        .order_by(ev.c.seq.desc())
        .limit(1)
    ).one()
    return int(seq), str(digest)


FRAMED = [
    {
        "kind": EventKind.USER_DATA_PURGED.value,
        "tenant": "acme",
        "outcome": Outcome.OK.value,
        "reason": "completed",
    },
    {
        "kind": EventKind.KV_GET.value,
        "tenant": "acme",
        "request_id": "req-framed",
        "key_digest": "f" * 64,
        "outcome": Outcome.HIT.value,
    },
]


@pytest.fixture
def runtime(prod_db: ProdDatabase) -> Iterator[sa.Engine]:
    """The runtime role's engine (what a compromised sidecar pod or a leaked Secret gives)."""
    engine = make_engine(prod_db.url)
    try:
        yield engine
    finally:
        engine.dispose()


def _cli_env(prod_db: ProdDatabase, data_dir: Path) -> dict[str, str]:
    """The node's CLI: its database URL (the runtime role) and its signing key."""
    key_path = data_dir / "ledger-signing.key"
    key_path.write_text(PEM)
    key_path.chmod(0o600)
    return {"KVGOV_DATABASE_URL": prod_db.url, "KVGOV_DATA_DIR": str(data_dir)}


def _verify(engine: sa.Engine, **kw: Any) -> VerifyReport:
    return verify_trusted(engine, TRUSTED, **kw)


def _chain(report: VerifyReport, chain_id: str) -> ChainReport:
    return next(c for c in report.chains if c.chain_id == chain_id)


def _problems(chain: ChainReport) -> set[Problem]:
    return {f.problem for f in chain.findings}


# -- (a) a new chain under a trusted key ----------------------------------------------------


def test_runtime_role_cannot_forge_a_chain_under_a_trusted_key(
    prod_db: ProdDatabase, runtime: sa.Engine
) -> None:
    asyncio.run(_write(prod_db.url, "node-a", 3))
    with runtime.begin() as conn:
        pub = conn.execute(sa.select(table(Chain).c.public_key)).scalar_one()
        conn.execute(
            table(Chain)
            .insert()
            .values(chain_id="sidecar-7", public_key=pub, created_at=utcnow(), description=None)
        )
        _forge(conn, "sidecar-7", 1, GENESIS_HASH, FRAMED, utcnow())
    report = _verify(runtime)
    forged = _chain(report, "sidecar-7")
    assert not report.ok, (
        f"audit verify: ok; forged chain sidecar-7 passes ({forged.events} events,"
        f" {forged.checkpoints} checkpoints, key of the trusted node)"
    )
    assert forged.first_bad is not None
    assert forged.first_bad.problem is Problem.NO_GENESIS, forged.to_dict()
    assert forged.genesis == "missing"
    assert _chain(report, "node-a").ok  # the honest chain beside it is not blamed

    # `kvgov audit checkpoint` (every chain of the node's key) does not vouch for it either
    with pytest.raises(LedgerError, match="no genesis signed by this key"):
        write_checkpoint(runtime, "sidecar-7", NODE_KEY)


def test_a_copied_genesis_does_not_vouch_for_a_forged_chain(
    prod_db: ProdDatabase, runtime: sa.Engine
) -> None:
    from kvgov.db.models import ChainSeal  # new in migration 0006

    asyncio.run(_write(prod_db.url, "node-a", 2))
    seals = table(ChainSeal)
    with runtime.begin() as conn:
        pub = conn.execute(sa.select(table(Chain).c.public_key)).scalar_one()
        honest_created = conn.execute(sa.select(table(Chain).c.created_at)).scalar_one()
        conn.execute(
            table(Chain)
            .insert()
            .values(chain_id="sidecar-8", public_key=pub, created_at=honest_created)
        )
        _forge(conn, "sidecar-8", 1, GENESIS_HASH, FRAMED, utcnow())
        # the honest chain's genesis and open, replayed for the forged chain
        for row in conn.execute(sa.select(seals).where(seals.c.chain_id == "node-a")).all():
            conn.execute(seals.insert().values({**row._mapping, "chain_id": "sidecar-8"}))
    forged = _chain(_verify(runtime), "sidecar-8")
    assert Problem.NO_GENESIS in _problems(forged), forged.to_dict()
    assert Problem.BAD_SIGNATURE in _problems(forged)


# -- (b) events after a writer's close ------------------------------------------------------


@pytest.mark.parametrize("age", [timedelta(0), timedelta(days=30)], ids=["now", "backdated"])
def test_runtime_role_cannot_extend_a_closed_chain(
    prod_db: ProdDatabase, runtime: sa.Engine, age: timedelta
) -> None:
    asyncio.run(_write(prod_db.url, "cli-run-1", 3))  # a finished writer: checkpoint, close
    closed = _chain(_verify(runtime), "cli-run-1")
    assert closed.ok and closed.unsigned_events == 0, closed.to_dict()
    with runtime.begin() as conn:
        seq, head = _head(conn, "cli-run-1")
        _forge(conn, "cli-run-1", seq + 1, head, FRAMED[1:], utcnow() - age)
    report = _verify(runtime)
    chain = _chain(report, "cli-run-1")
    assert not report.ok, (
        f"audit verify: ok; event appended after the final checkpoint passes"
        f" ({chain.unsigned_events} unsigned)"
    )
    assert closed.closed  # before the attack: its writer closed it, nothing may follow
    assert chain.first_bad is not None
    assert chain.first_bad.problem is Problem.AFTER_CLOSE, chain.to_dict()
    assert chain.first_bad.seq == seq + 1
    with pytest.raises(LedgerError, match="appended after its writer closed it"):
        write_checkpoint(runtime, "cli-run-1", NODE_KEY)

    # the writer's next start does not launder them: they stay after the close
    asyncio.run(_write(prod_db.url, "cli-run-1", 1))
    again = _chain(_verify(runtime), "cli-run-1")
    assert again.first_bad is not None and again.first_bad.problem is Problem.AFTER_CLOSE


def test_the_cli_and_the_api_doors_fail_the_forgeries(
    prod_db: ProdDatabase, runtime: sa.Engine, tmp_path: Path
) -> None:
    """``kvgov audit verify`` exits 1 and names the chain and why."""
    asyncio.run(_write(prod_db.url, "node-a", 2))
    with runtime.begin() as conn:
        pub = conn.execute(sa.select(table(Chain).c.public_key)).scalar_one()
        conn.execute(
            table(Chain).insert().values(chain_id="sidecar-7", public_key=pub, created_at=utcnow())
        )
        _forge(conn, "sidecar-7", 1, GENESIS_HASH, FRAMED, utcnow())
        seq, head = _head(conn, "node-a")
        _forge(conn, "node-a", seq + 1, head, FRAMED[1:], utcnow())
    env = _cli_env(prod_db, tmp_path)
    result = CliRunner().invoke(build_app(), ["audit", "verify"], env=env)
    assert result.exit_code == 1, result.output
    assert "BROKEN sidecar-7: no_genesis at seq 1" in result.output
    assert f"BROKEN node-a: after_close at seq {seq + 1}" in result.output


# -- a crashed writer's chain: the unsigned tail is bounded ---------------------------------


def test_a_tail_appended_to_a_crashed_chain_fails_once_stale(
    prod_db: ProdDatabase, runtime: sa.Engine
) -> None:
    """A writer killed without a close leaves an unsigned tail; events the runtime role
    appends to it cannot be told from the writer's own until the writer restarts (which signs
    over the tail) or the tail outlives the bound."""
    _crash(prod_db.url, "node-b", 3)
    with runtime.begin() as conn:
        seq, head = _head(conn, "node-b")
        _forge(conn, "node-b", seq + 1, head, FRAMED[1:], utcnow())
    fresh = _chain(_verify(runtime), "node-b")
    assert fresh.ok and fresh.unsigned_events == 2, fresh.to_dict()  # within the bound
    later = _chain(_verify(runtime, now=utcnow() + timedelta(hours=2)), "node-b")
    assert later.first_bad is not None
    assert later.first_bad.problem is Problem.STALE_UNSIGNED, later.to_dict()
    assert later.first_bad.seq == seq  # the crashed writer's own last event, unsigned too
    assert _chain(
        _verify(runtime, now=utcnow() + timedelta(hours=2), max_unsigned_age=None), "node-b"
    ).ok

    # dated in the future, to dodge the bound: fails at once
    _crash(prod_db.url, "node-c", 1, tail=0)
    with runtime.begin() as conn:
        seq, head = _head(conn, "node-c")
        _forge(conn, "node-c", seq + 1, head, FRAMED[1:], utcnow() + timedelta(days=365))
    future = _chain(_verify(runtime), "node-c")
    assert future.first_bad is not None, future.to_dict()
    assert future.first_bad.problem is Problem.STALE_UNSIGNED
    assert "in the future" in future.first_bad.detail


def test_an_exclusive_restart_ends_the_crashed_session(
    prod_db: ProdDatabase, runtime: sa.Engine
) -> None:
    """A writer holding its chain alone (a sidecar with its journal's lock) ends every earlier
    session when it opens: after it closes, nothing may follow, crash or not."""
    _crash(prod_db.url, "node-d", 2, exclusive=True)

    async def restart() -> None:
        engine = make_engine(prod_db.url)
        writer = LedgerWriter(engine, chain_id="node-d", signing_key=NODE_KEY, exclusive=True)
        try:
            await writer.start()
            await writer.append(_put(9))
        finally:
            await writer.close()
            engine.dispose()

    asyncio.run(restart())
    assert _chain(_verify(runtime), "node-d").ok
    with runtime.begin() as conn:
        seq, head = _head(conn, "node-d")
        _forge(conn, "node-d", seq + 1, head, FRAMED[1:], utcnow())
    chain = _chain(_verify(runtime), "node-d")
    assert chain.first_bad is not None and chain.first_bad.problem is Problem.AFTER_CLOSE


# -- the honest life of a chain -------------------------------------------------------------


def test_honest_stops_restarts_and_a_crash_verify(
    prod_db: ProdDatabase, runtime: sa.Engine
) -> None:
    chain_id = "node-honest"

    async def session(n: int, *, checkpoint_on_close: bool) -> None:
        engine = make_engine(prod_db.url)
        writer = LedgerWriter(engine, chain_id=chain_id, signing_key=NODE_KEY)
        try:
            await writer.start()
            for i in range(n):
                await writer.append(_put(i))
        finally:
            await writer.close(checkpoint=checkpoint_on_close)
            engine.dispose()

    asyncio.run(session(3, checkpoint_on_close=True))  # start, events, clean stop
    first = _chain(_verify(runtime), chain_id)
    assert first.ok and first.genesis == "signed" and first.closed, first.to_dict()
    assert first.unsigned_events == 0

    asyncio.run(session(2, checkpoint_on_close=False))  # restart, more events, clean stop
    second = _chain(_verify(runtime), chain_id)
    assert second.ok and second.closed and second.unsigned_events == 0, second.to_dict()
    assert second.head_seq == 5 and second.sessions == 2

    _crash(prod_db.url, chain_id, 2)  # restart, events, a checkpoint, one more, kill -9
    crashed = _chain(_verify(runtime), chain_id)
    assert crashed.ok and not crashed.closed, crashed.to_dict()
    assert crashed.unsigned_events == 1  # the event after the last checkpoint

    asyncio.run(session(1, checkpoint_on_close=False))  # the restart signs over the tail
    report = _verify(runtime)
    final = _chain(report, chain_id)
    assert report.ok, report.to_dict()
    assert final.closed and final.unsigned_events == 0 and final.sessions == 4
    assert final.head_seq == 5 + 3 + 1
    # long after, still intact: nothing is unsigned
    assert _verify(runtime, now=utcnow() + timedelta(days=30)).ok


def test_a_legacy_chain_is_vouched_for_by_its_checkpoint_and_adopted(
    prod_db: ProdDatabase, runtime: sa.Engine, tmp_path: Path
) -> None:
    """A chain written before seals existed (simulated: its seals removed as the superuser)
    verifies on its old checkpoint; its writer's next start signs its genesis. One with no
    checkpoint is not vouched for until an operator adopts it."""
    asyncio.run(_write(prod_db.url, "old-a", 2))
    asyncio.run(_write(prod_db.url, "old-b", 2, checkpoint=False))
    with psycopg.connect(prod_db.superuser_dsn, autocommit=True) as su:
        su.execute("SET session_replication_role = replica")  # the append-only guard off
        su.execute("DELETE FROM chain_seals")
    report = _verify(runtime)
    assert _chain(report, "old-a").ok and _chain(report, "old-a").genesis == "legacy"
    assert _chain(report, "old-b").first_bad is not None
    assert _chain(report, "old-b").first_bad.problem is Problem.NO_GENESIS  # type: ignore[union-attr]

    asyncio.run(_write(prod_db.url, "old-a", 1))  # the upgraded writer restarts
    assert _chain(_verify(runtime), "old-a").genesis == "signed"

    env = _cli_env(prod_db, tmp_path)
    refused = CliRunner().invoke(build_app(), ["audit", "checkpoint"], env=env)
    assert refused.exit_code == 1 and "old-b: NOT signed" in refused.output, refused.output
    adopted = CliRunner().invoke(
        build_app(), ["audit", "checkpoint", "--chain", "old-b", "--adopt"], env=env
    )
    assert adopted.exit_code == 0, adopted.output
    assert "old-b: genesis signed" in adopted.output
    assert _verify(runtime).ok


def test_a_cli_writer_beside_a_live_sidecar_leaves_its_chain_intact(
    prod_db: ProdDatabase, runtime: sa.Engine
) -> None:
    """``kvgov token create`` on the sidecar's host writes to the sidecar's chain while the
    sidecar serves: the CLI cannot take the chain's writer lock, so its open ends nothing and
    its close leaves the sidecar's session open."""

    async def run() -> None:
        engine = make_engine(prod_db.url)
        sidecar = LedgerWriter(engine, chain_id="node-e", signing_key=NODE_KEY)
        try:
            await sidecar.start()
            await sidecar.append(_put(1))
            await _write(prod_db.url, "node-e", 1, checkpoint=False)  # the CLI, start to close
            for i in range(3):
                await sidecar.append(_put(i))
            assert _chain(_verify(runtime), "node-e").ok  # before the next checkpoint
            assert await sidecar.write_checkpoint() is not None
        finally:
            await sidecar.close()
            engine.dispose()

    asyncio.run(run())
    report = _verify(runtime)
    chain = _chain(report, "node-e")
    assert report.ok and chain.closed and chain.sessions == 2, report.to_dict()


def test_a_live_writer_whose_session_was_ended_resumes_it(
    prod_db: ProdDatabase, runtime: sa.Engine
) -> None:
    """Another writer claiming the chain (its lock lost with a database restart, say) ends the
    live writer's session; the live writer opens a new one from there in its next transaction
    that finds the head moved (before its own rows: review r11, F2), or else at its next
    checkpoint, so its own events stay covered."""

    async def run() -> None:
        engine = make_engine(prod_db.url)
        live = LedgerWriter(engine, chain_id="node-f", signing_key=NODE_KEY)
        try:
            await live.start()
            await live.append(_put(1))
            other = LedgerWriter(engine, chain_id="node-f", signing_key=NODE_KEY, exclusive=True)
            await other.start()
            await other.append(_put(2))
            await other.close()
            await live.append(_put(3))  # the head moved: it re-opens in that transaction
            assert _chain(_verify(runtime), "node-f").first_bad is None
            # a claim that writes nothing moves no head: the next row is not covered ...
            other = LedgerWriter(engine, chain_id="node-f", signing_key=NODE_KEY, exclusive=True)
            await other.start()
            await other.close()
            await live.append(_put(4))
            gap = _chain(_verify(runtime), "node-f")
            assert gap.first_bad is not None and gap.first_bad.problem is Problem.AFTER_CLOSE
            assert await live.write_checkpoint() is not None  # ... until it resumes, then signs
            await live.append(_put(5))
        finally:
            await live.close()
            engine.dispose()

    asyncio.run(run())
    report = _verify(runtime)
    assert report.ok and _chain(report, "node-f").closed, report.to_dict()


def test_the_cli_default_bound_is_the_ledgers() -> None:
    from kvgov.cli.audit import DEFAULT_MAX_UNSIGNED_AGE_S
    from kvgov.ledger.seals import DEFAULT_MAX_UNSIGNED_AGE

    assert timedelta(seconds=DEFAULT_MAX_UNSIGNED_AGE_S) == DEFAULT_MAX_UNSIGNED_AGE

"""Attack (review r13, F1): a purge escapes under a signed ``completed`` receipt through a dead
pod's chain.

The receipt's cross-check (:mod:`kvgov.services.purge.trail`, :mod:`kvgov.ledger.purge_trail`)
took a step's ``purge:step`` event from any chain a trusted key vouches for, at any position a
writer session covers. A writer killed without a close (a pod lost and rescheduled under a new
name: a new chain, the old one never reopened) leaves a session that covers every later position
for ever. Whoever holds the runtime database role (every sidecar pod) then:

1. marks a new job's ``tiers`` and ``keys`` steps ``completed`` with plausible details before an
   executor takes them (UPDATE on ``purge_steps``), so they never run;
2. chains the matching ``purge:step`` events on the dead chain (INSERT on ``ledger_events``,
   correct unkeyed hashes).

The fleet's key signed ``completed`` ("6 entries purged, key destroyed") while the user's chunks
stayed in the tiers under a data key that still opens them. ``late_evictions`` (the job's
document) read ``purge:evict:late`` events the same way.

Now an event counts only at or below a head signed while the writer session holding it was
live (a checkpoint signed before the session ended, its close or foreign seal): a dead chain's
appended rows are never signed over, and the exclusive open of a writer restarted on the chain
(which signs over the crashed tail, as ``audit verify`` accepts) does not vouch for them either.
Each step's executor signs its own chain's head before the step is marked finished, and the
sidecar signs its head after a late EVICT's event, so honest purges still sign ``completed``.

Postgres, as the runtime role a sidecar has (``runtime_role``).
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization

from kvgov.db import sidecars
from kvgov.db.engine import make_sessionmaker, utcnow
from kvgov.db.purge_views import JobView, PurgeRequest, StepName
from kvgov.keys.keyring import Keyring
from kvgov.ledger.chain import public_key_bytes
from kvgov.ledger.events import Event
from kvgov.ledger.trust import verify_trusted
from kvgov.ledger.writer import LedgerWriter
from kvgov.services.purge.build import make_service, writer_checkpointer
from kvgov.services.purge.documents import read_detail
from kvgov.services.purge.ports import KeyringShredder
from kvgov.types import EventKind, Outcome, PurgeState
from tests.integration.test_purge_service import Env, N
from tests.security import doors
from tests.security import test_receipt_forgery as forgery
from tests.security.test_chain_forgery import _crash, _forge, _head
from tests.security.test_purge_late_evict import (
    LocalTier,
    _down_during_purge,
    _metric,
    _sidecar,
)
from tests.security.test_receipt_forgery import _receipt, _tamper

# the purge world and the runtime role of the receipt's other attacks (their fixtures)
env = forgery.env
runtime_role = forgery.runtime_role

pytestmark = pytest.mark.postgres

DEAD = "kvgov-inference-7d9f-old"  # a pod that was lost; its replacement has another name


def _pod_killed(env: Env, chain_id: str) -> None:
    """A sidecar's writer under the fleet's key: starts (its signed, exclusive open), writes
    two events and a checkpoint, then is killed with ``kill -9``: no close."""
    pem = env.key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()
    url = env.engine.url.render_as_string(hide_password=False)
    _crash(url, chain_id, 2, tail=0, exclusive=True, pem=pem)


def _chain_on(env: Env, role: str, chain_id: str, events: list[dict[str, Any]]) -> int:
    """As the runtime role: ``events`` correctly chained on ``chain_id``'s head. Returns the
    position of the first."""
    with env.engine.begin() as conn:
        conn.exec_driver_sql(f'SET LOCAL ROLE "{role}"')
        seq, head = _head(conn, chain_id)
        _forge(conn, chain_id, seq + 1, head, events, datetime.now(UTC))
    return seq + 1


def _step_event(job: JobView, step: str, detail: dict[str, Any]) -> dict[str, Any]:
    """The ``purge:step`` event an executor would chain for ``step`` ending with ``detail``."""
    return {
        "kind": "purge:step",
        "tenant": job.tenant,
        "actor": job.subject,
        "outcome": "ok",
        "reason": "completed",
        "principal": "sidecar",
        "attrs": {
            "purge_id": job.id,
            "step": step,
            "sidecar_id": None,
            "attempt": 1,
            "summary": read_detail(StepName(step), detail).summary(),
        },
    }


async def _skip_tiers_and_keys(env: Env, role: str, chain_id: str) -> tuple[Any, JobView, int]:
    """Seed alice, make her purge, mark its ``tiers`` and ``keys`` steps done before any
    executor takes them and chain their events on ``chain_id``. Returns the service, the job
    and the position of the first forged event."""
    await env.seed("acme", "alice")
    alice = env.pseudo.user("acme", "alice")
    service = env.service()
    job = await service.create(PurgeRequest(tenant="acme", user="alice"))
    key = env.keyring.current("acme", alice)
    details = {
        "tiers": {
            "executed_by": "test",
            "tiers": ["memory", "filesystem"],
            "deleted": {"memory": N, "filesystem": N},
            "entries_in_scope": N,
            "newly_purged": N,
            "verified": True,
            "keys_forgotten": 1,
        },
        "keys": {
            "executed_by": "test",
            "destroyed": [{"key_id": key.key_id, "version": key.version}],
        },
    }
    for step, detail in details.items():  # "done": they never run
        _tamper(env, role, job.id, step, state="completed", detail=detail)
    events = [_step_event(job, step, detail) for step, detail in details.items()]
    return service, job, _chain_on(env, role, chain_id, events)


async def _still_opens(env: Env) -> bytes | None:
    """Alice's first chunk, opened with a fresh keyring (what any pod opens it with), if it
    is still in the memory tier and its data key still opens it."""
    digest = env.digests[("acme", "alice")][0]
    stored = await env.memory.get(digest)
    if stored is None:
        return None
    return bytes(Keyring(env.store, env.kek).open(stored, tenant="acme", cache_key=digest.encode()))


def _refused(r: dict[str, Any]) -> bool:
    """The receipt names both skipped steps as not done."""
    lines = list(r["incomplete"])
    return r["state"] != "completed" and all(
        any(line.startswith(f"{s}:") for line in lines) for s in ("tiers", "keys")
    )


async def test_events_chained_on_a_dead_pods_chain_do_not_get_a_purge_signed_completed(
    env: Env, runtime_role: str
) -> None:
    _pod_killed(env, DEAD)
    service, job, seq = await _skip_tiers_and_keys(env, runtime_role, DEAD)
    job = await asyncio.wait_for(service.wait(job.id), 30)
    r = _receipt(env, job)  # a genuine signature of the fleet's key
    opened = await _still_opens(env)
    report = verify_trusted(env.engine, [public_key_bytes(env.key)])  # the 1 h bound
    assert _refused(r), (
        f"receipt signed {r['state']!r} (entries_purged={r['entries_purged']}, "
        f"keys_destroyed={r['keys_destroyed']}, incomplete={r['incomplete']}) while alice's "
        f"chunk is still in the memory tier and opens ({len(opened or b'')} bytes): the "
        f"purge:step events the runtime role chained at {DEAD}:{seq}.. were accepted; "
        f"audit verify ok={report.ok}"
    )
    assert opened is not None  # what the receipt now admits: the data stayed


async def test_a_restart_on_the_dead_chain_does_not_vouch_for_what_was_chained_before_it(
    env: Env, runtime_role: str
) -> None:
    """A writer restarted on the same chain (a container restarted in its pod: same name, same
    chain) signs its exclusive open over the crashed session's tail, forged rows included, and
    checkpoints from there: ``audit verify`` accepts that tail, the receipt must not."""
    _pod_killed(env, DEAD)
    service, job, seq = await _skip_tiers_and_keys(env, runtime_role, DEAD)
    restarted = LedgerWriter(env.engine, chain_id=DEAD, signing_key=env.key, exclusive=True)
    await restarted.start()  # a journaled sidecar's writer is exclusive
    try:
        await restarted.write_checkpoint()  # at the open's head, the forged rows' last
        await restarted.append(Event(kind=EventKind.SIDECAR_STARTED, outcome=Outcome.OK))
        await restarted.write_checkpoint()
        job = await asyncio.wait_for(service.wait(job.id), 30)
    finally:
        await restarted.close()
    r = _receipt(env, job)
    report = verify_trusted(env.engine, [public_key_bytes(env.key)])
    assert _refused(r), (
        f"receipt signed {r['state']!r} (incomplete={r['incomplete']}): the purge:step events "
        f"chained at {DEAD}:{seq}.. while its writer was down were accepted once the restart "
        f"signed over them; audit verify ok={report.ok}"
    )
    assert await _still_opens(env) is not None


async def test_a_late_evict_chained_on_a_dead_pods_chain_is_not_in_the_jobs_document(
    env: Env, runtime_role: str
) -> None:
    await env.seed("acme", "alice")
    _pod_killed(env, DEAD)
    service = env.service()
    job = await service.create(PurgeRequest(tenant="acme", user="alice"))
    job = await asyncio.wait_for(service.wait(job.id), 30)
    late = {
        "kind": "purge:evict:late",
        "tenant": "acme",
        "outcome": "ok",
        "reason": "reconnected",
        "principal": "sidecar:sc-a",
        "attrs": {
            "purge_id": job.id,
            "step": "engines",
            "engine": "vllm-acme",
            "digests": N,
            "removed": N,
        },
    }
    seq = _chain_on(env, runtime_role, DEAD, [late])
    listed = await service.late_evictions(job)
    assert listed == [], (
        f"the job's document lists {[(e.engine, e.removed) for e in listed]} reached late: the "
        f"purge:evict:late event the runtime role chained at {DEAD}:{seq} was accepted"
    )


async def test_steps_another_pod_ran_are_signed_before_the_receipt_is_built(env: Env) -> None:
    """No attacker: pod B runs its own steps on its own chain and pod A builds the receipt.
    Each executor signs its chain's head before its step is finished, so the receipt A signs
    finds B's events signed (nothing else signs B's chain here: no periodic checkpoints)."""
    await env.seed("acme", "alice")
    with make_sessionmaker(env.engine).begin() as s:
        sidecars.heartbeat(s, "sc-b", now=utcnow(), chain_id="pod-b")
    pod_b = LedgerWriter(env.engine, chain_id="pod-b", signing_key=env.key)
    await pod_b.start()
    try:
        b = make_service(
            env.settings,
            sessions=make_sessionmaker(env.engine),
            sink=pod_b,
            tiers=[env.memory, env.fs],
            shredder=KeyringShredder(env.keyring),
            signing_key=env.key,
            pseudonymize=env.pseudo.user,
            checkpoint=writer_checkpointer(pod_b, env.engine, "pod-b"),
            sidecar_id="sc-b",
            principal="sidecar:sc-b",
        )
        a = env.service()
        job = await a.create(PurgeRequest(tenant="acme", user="alice"))
        assert await a.run_until_idle(job.id) == 2  # keys, tiers: the ledger step waits for B
        for _ in range(3):  # tiers@sc-b, engines@sc-b, gpu@sc-b (the ledger step is left)
            step = await b.run_one(job.id)
            assert step is not None and step.sidecar_id == "sc-b"
        job = await asyncio.wait_for(a.wait(job.id), 30)
    finally:
        await pod_b.close()
    r = _receipt(env, job)
    assert job.state is PurgeState.COMPLETED, r["incomplete"]
    assert r["sidecars"] == ["sc-b"]
    assert verify_trusted(env.engine, [public_key_bytes(env.key)]).ok


async def test_a_late_evict_the_sidecar_records_is_in_the_jobs_document_at_once(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    """No attacker: the sidecar signs its head right after recording a late EVICT, so the
    job's document lists it without waiting for the next periodic checkpoint."""
    async with _sidecar(tmp_path, prod_db) as sc:
        assert sc.purge is not None
        local = LocalTier()
        acme, _, (job,) = await _down_during_purge(sc, local, {0xD1: "alice"})
        channel = acme.control(local.on_evict, reconnect_delay=0.1)  # the channel is back
        try:
            assert await doors.run(channel.connected.wait, 10)
            assert await doors.until(lambda: _metric(sc, "delivered") == 1, 10)
            listed = []
            for _ in range(250):  # its head is signed a moment after it is counted
                if listed := await sc.purge.service.late_evictions(job):
                    break
                await asyncio.sleep(0.02)
        finally:
            channel.close()
            acme.close()
    assert [(e.engine, e.removed) for e in listed] == [("vllm-acme", 1)]

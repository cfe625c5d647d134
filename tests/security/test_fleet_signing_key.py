"""A known limit, pinned: one pod's files forge another pod's chain, and ``audit verify`` says ok
(review r13, F3; ``docs/threat-model.md``, actors table, "a compromised sidecar pod").

The seals (genesis, open, close, foreign) defend against "the holder of the runtime database
role (a sidecar pod, its Secret)" (``docs/threat-model.md``, actors table): it "cannot sign".
But the signing key is per FLEET and every inference pod holds it beside the runtime role's
password (``docs/deploy.md``, "Per-pod and per-fleet identity": Secret ``kvgov-keys/signing.key``
mounted into every ``kvgov`` container; ``deploy/kubernetes/base/inference.yaml``). So whoever
reads one pod's files (a compromised kvgov container, a debug shell, a node that hosts one
pod) holds the key of EVERY chain in the fleet, not only its own pod's.

The attack, as pod B against live pod A: open a session of its own on A's chain with the fleet
key (what a ``kvgov token`` command beside A does: a non-exclusive signed open), append made-up
rows, close. A's watch finds the rows "explained" by that session, seals nothing, logs nothing,
and signs over them at its next checkpoint; ``audit verify`` (CLI, API, dashboard) is ok for
good: no ``foreign_append``, no ``stale_unsigned``. The same key signs purge receipts.

Nothing short of per-pod signing keys enrolled off the pod can close this, so the test is a
strict xfail: it documents the attack, and it fails (XPASS) the day the attack stops working,
so that the threat model and this mark are updated together.
"""

from __future__ import annotations

import asyncio

import pytest

from kvgov.ledger.chain import public_key_bytes
from kvgov.ledger.seals import close_session, new_session
from kvgov.ledger.writing.replay import register_chain
from tests.security.test_chain_forgery import FRAMED, NODE_KEY, _put
from tests.security.test_foreign_append import (
    Ledger,
    _append_forged,
    _seals,
    _verify,
    _writer,
    ledger,
)

__all__ = ["ledger"]  # the fixture (Postgres as the runtime role, and SQLite)

FLEET_KEY = NODE_KEY  # the one ``signing.key`` every pod of the fleet mounts


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="known limit: one signing key per fleet, in every pod (docs/threat-model.md, actors)",
)
def test_another_pods_key_file_forges_a_live_chain_that_verifies(ledger: Ledger) -> None:
    forged: list[int] = []

    async def run() -> None:
        writer, engine = await _writer(ledger.url, "pod-a")  # live pod A
        try:
            for i in range(3):
                await writer.append(_put(i))
            # pod B: its runtime role and its own copy of the fleet's signing key
            session = new_session()
            register_chain(
                ledger.attacker,
                "pod-a",
                public_key_bytes(FLEET_KEY),
                description=None,
                journaled=False,
                signing_key=FLEET_KEY,
                session=session,
                exclusive=False,
            )
            forged.extend(_append_forged(ledger.attacker, "pod-a", FRAMED))
            close_session(ledger.attacker, "pod-a", FLEET_KEY, session)
            for i in range(3, 5):
                await writer.append(_put(i))  # pod A goes on, re-chained on the forged rows
            assert await writer.write_checkpoint() is not None
        finally:
            await writer.close()
            engine.dispose()

    asyncio.run(run())
    report = _verify(ledger.attacker)
    chain = next(c for c in report.chains if c.chain_id == "pod-a")
    assert not report.ok, (
        f"audit verify: ok over rows {forged} (a user:data:purged and a kv:get) that pod B "
        f"wrote into live pod A's chain with its copy of the fleet key; foreign seals: "
        f"{len(_seals(ledger.attacker, 'pod-a', 'foreign'))}, unsigned events: "
        f"{chain.unsigned_events}, closed={chain.closed}"
    )

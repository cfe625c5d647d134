"""Durability: every event the writer acknowledged survives ``kill -9`` of its process."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import sqlalchemy as sa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kvgov.db.engine import make_engine, upgrade
from kvgov.db.models import LedgerEvent
from kvgov.ledger.events import Event
from kvgov.ledger.verify import verify
from kvgov.ledger.writer import LedgerWriter
from kvgov.types import EventKind

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

CHILD = textwrap.dedent(
    """
    import asyncio, sys
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives import serialization
    from kvgov.db.engine import make_engine
    from kvgov.ledger.events import Event, EntryChange
    from kvgov.ledger.writer import LedgerWriter
    from kvgov.types import EventKind, EntryState

    async def main(url, pem):
        key = serialization.load_pem_private_key(pem.encode(), password=None)
        writer = LedgerWriter(make_engine(url), chain_id="victim", signing_key=key,
                              batch_max_events=200)
        await writer.start()

        async def one(i):
            entry = EntryChange(key_digest=f"{i:064x}", state=EntryState.LIVE, tenant="acme")
            done = await writer.append(Event(kind=EventKind.KV_PUT, tenant="acme",
                                             request_id=f"r{i}", nbytes=i, entry=entry))
            sys.stdout.write(f"ack {done.seq}\\n")
            sys.stdout.flush()

        i = 0
        while True:  # keep ~500 events in flight until killed
            await asyncio.gather(*(one(i + j) for j in range(500)))
            i += 500

    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
)


def test_acknowledged_events_survive_sigkill(db_url: str) -> None:
    upgrade(db_url)
    key = Ed25519PrivateKey.generate()
    from cryptography.hazmat.primitives import serialization

    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, db_url, pem],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    acked: list[int] = []
    assert child.stdout is not None
    try:
        for line in child.stdout:
            acked.append(int(line.split()[1]))
            if len(acked) >= 3000:
                os.kill(child.pid, signal.SIGKILL)  # mid-stream: more batches are in flight
                break
        acked += [int(line.split()[1]) for line in child.stdout]  # what it printed before dying
    finally:
        if child.poll() is None:
            child.kill()
        child.wait(timeout=30)
        assert child.stderr is not None
        err = child.stderr.read()
        child.stdout.close()
        child.stderr.close()
    assert child.returncode == -signal.SIGKILL, err
    assert len(acked) >= 3000

    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            stored = set(
                conn.execute(
                    sa.select(LedgerEvent.seq).where(LedgerEvent.chain_id == "victim")
                ).scalars()
            )
        assert set(acked) <= stored  # nothing acknowledged was lost
        assert stored == set(range(1, len(stored) + 1))  # and nothing half-written
        report = verify(engine)
        assert report.ok, report.to_dict()

        async def resume() -> int:
            writer = LedgerWriter(engine, chain_id="victim", signing_key=key)
            await writer.start()
            seq = (await writer.append(Event(kind=EventKind.SIDECAR_STARTED))).seq
            await writer.close()
            return seq

        assert asyncio.run(resume()) == len(stored) + 1  # restart continues the chain
        assert verify(engine).ok
    finally:
        engine.dispose()

"""Compose a :class:`PurgeService` from ``Settings``: for the CLI, and for a sidecar's parts.

The CLI's service reaches what needs no sidecar: the ledger database (its own ledger writer on a
chain of its own, so it never races a sidecar's writer on the same chain), the data-key store
(shredding needs no KEK), the tiers of ``tiers.chain`` other than the in-process memory tier
(filesystem and Redis are shared with the sidecar of the same configuration), and the vLLM
engines of ``purge.vllm_engines``. Engine connections exist only inside a sidecar
(:mod:`kvgov.services.purge.engines`).
"""

from __future__ import annotations

import base64
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Protocol

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from kvgov.config import Settings
from kvgov.connectors.tiers.base import Tier
from kvgov.ledger.checkpoint import CheckpointInfo as SignedCheckpoint
from kvgov.ledger.checkpoint import latest_checkpoint
from kvgov.ledger.events import EventSink
from kvgov.services.purge.ports import (
    Checkpointer,
    CheckpointInfo,
    EngineEvictor,
    KeyShredder,
    LocalIndex,
    NoEngines,
    NoLocalIndex,
    StoreShredder,
    TierSet,
)
from kvgov.services.purge.service import PurgeService
from kvgov.services.purge.steps import StepContext


def writer_checkpointer(writer: _Checkpointing, engine: Engine, chain_id: str) -> Checkpointer:
    """Sign the head of ``chain_id`` now and report the checkpoint it wrote, else (the head was
    signed already) the newest checkpoint of that chain that verifies under its key: never
    merely the newest row, which the runtime role can insert at any position."""

    async def run() -> CheckpointInfo | None:
        await writer.flush()
        signed = await writer.write_checkpoint()
        if signed is None:
            signed = latest_checkpoint(engine, chain_id)
        if signed is None:
            return None
        return CheckpointInfo(
            chain_id=signed.chain_id,
            seq=signed.seq,
            head_hash=signed.head_hash,
            signature=base64.b64encode(signed.signature).decode("ascii"),
        )

    return run


class _Checkpointing(Protocol):  # what writer_checkpointer needs of a LedgerWriter
    async def flush(self) -> None: ...

    async def write_checkpoint(self) -> SignedCheckpoint | None: ...


def make_service(
    settings: Settings,
    *,
    sessions: sessionmaker[Session],
    sink: EventSink,
    tiers: Sequence[Tier],
    shredder: KeyShredder,
    signing_key: object,
    pseudonymize: Callable[[str, str], str],
    checkpoint: Checkpointer | None,
    evictor: EngineEvictor | None = None,
    local_index: LocalIndex | None = None,
    sidecar_id: str | None = None,
    principal: str = "cli",
) -> PurgeService:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    if not isinstance(signing_key, Ed25519PrivateKey):
        raise TypeError("signing_key must be an Ed25519 private key")
    ctx = StepContext(
        settings=settings,
        sessions=sessions,
        sink=sink,
        tiers=TierSet(tiers),
        shredder=shredder,
        evictor=evictor or NoEngines(),
        local_index=local_index or NoLocalIndex(),
        sidecar_id=sidecar_id,
        principal=principal,
    )
    from kvgov.ledger.trust import trusted_keys

    return PurgeService(
        ctx,
        signing_key=signing_key,
        pseudonymize=pseudonymize,
        checkpoint=checkpoint,
        lease_s=settings.purge.step_lease_s,
        # the chains a receipt's steps may rest on: as audit verify trusts them
        trusted_keys=trusted_keys(settings),
    )


async def shared_tiers(settings: Settings) -> list[Tier]:
    """The configured tiers a process other than the sidecar can reach (not ``memory``)."""
    from kvgov.connectors.tiers.factory import REGISTRY, TierHooks

    out: list[Tier] = []
    for name in settings.tiers.chain:
        if name == "memory":
            continue
        out.append(await REGISTRY[name](settings, TierHooks()))
    return out


@asynccontextmanager
async def cli_service(settings: Settings, *, writer: bool = True) -> AsyncIterator[PurgeService]:
    """A service for ``kvgov purge``: its own ledger writer chain, shared tiers, no engines."""
    from kvgov.db.engine import make_engine, make_sessionmaker
    from kvgov.db.keystore import SqlKeyStore
    from kvgov.ledger.chain import load_signing_key
    from kvgov.ledger.keypin import pinned_pseudonymizer
    from kvgov.ledger.writer import LedgerWriter

    # another key than the fleet's would purge nobody and sign that it did: check it first
    pseudonymizer = pinned_pseudonymizer(settings)
    key = load_signing_key(settings.signing_key_path)
    engine = make_engine(settings.database_url, pool_size=2)
    chain_id = f"{settings.chain_id}/purge-cli/{uuid.uuid4().hex[:12]}"
    ledger = LedgerWriter(
        engine,
        chain_id=chain_id,
        signing_key=key,
        batch_max_events=settings.ledger.batch_max_events,
        description="kvgov purge (CLI)",
    )
    tiers = await shared_tiers(settings) if writer else []
    started = False
    try:
        if writer:
            await ledger.start()
            started = True
        yield make_service(
            settings,
            sessions=make_sessionmaker(engine),
            sink=ledger,
            tiers=tiers,
            shredder=StoreShredder(SqlKeyStore(engine)),
            signing_key=key,
            pseudonymize=pseudonymizer.user,
            checkpoint=writer_checkpointer(ledger, engine, chain_id),
            principal="cli",
        )
    finally:
        if started:
            await ledger.close(checkpoint=True)  # sign the head: `audit verify` trusts it
        for tier in tiers:
            await tier.close()
        engine.dispose()

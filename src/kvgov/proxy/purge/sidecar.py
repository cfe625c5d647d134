"""Wire the purge into a running sidecar: its tiers, keyring, index, engines and ledger writer.

:func:`attach_purge` builds the sidecar's :class:`PurgeService` and starts its
:class:`PurgeExecutor` from a :class:`PurgeWiring` (the sidecar's ``start`` builds it and calls
it when it has a ledger; ``stop`` cancels the task). The sidecar's purge steps use:

- its whole tier chain (memory included) and its :class:`Keyring` (so in-memory copies of
  shredded data keys are dropped too);
- its in-memory entry index, from which purged entries are dropped *before* the tiers are
  touched;
- its pipeline's erasure fences (:mod:`kvgov.proxy.dataplane.fences`), raised before the tier
  step reads its scope so that no put of that scope still arriving is made visible after it,
  and its ledger writer, flushed then so that the puts it acknowledged from its journal are in
  the scope it reads;
- ``WireServer.evict_on_engines`` to send EVICT to the connected engines that may hold the
  purged tenant's data (the policy admits them for it, or the ledger saw them store or read
  it) and wait for their ACKs;
- its :class:`~kvgov.proxy.purge.late.LateEvictions`, which keeps the EVICT an engine the
  step could not reach is owed and sends it once that engine's control channel is back.

EVICT names entries by the ledger's key digests alone: each engine recognises them among its
own local keys with the key-digest key it got on its control connection, so a purge reaches
the engines' local tiers whatever this process has seen since it (re)started.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvgov.proxy.dataplane.fences import Fence
from kvgov.services.purge.build import make_service, writer_checkpointer
from kvgov.services.purge.executor import PurgeExecutor
from kvgov.services.purge.ports import EngineEviction, KeyringShredder

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from kvgov.config import Settings
    from kvgov.connectors.tiers.base import Tier
    from kvgov.keys.keyring import Keyring
    from kvgov.ledger.writer import LedgerWriter
    from kvgov.proxy.purge.late import LateEvictions


class _Index(Protocol):
    def pop(self, digest: str) -> object: ...


class _Fences(Protocol):  # the sidecar's Pipeline
    def fence(self, job_id: str, fence: Fence) -> int: ...

    def lift(self, job_ids: Sequence[str]) -> None: ...

    @property
    def fenced_jobs(self) -> list[str]: ...

    def fenced_entries(self, fence: Fence) -> list[str]: ...


class _Server(Protocol):
    async def evict_on_engines(
        self,
        digests: Sequence[str],
        timeout_s: float,
        *,
        tenant: str,
        holders: Collection[str] = (),
    ) -> list[Any]: ...


class SidecarEngines:
    """The sidecar's :class:`LocalIndex` and :class:`LateEvictor` in one (``fences`` and
    ``settle``: its pipeline and its ledger writer's flush; without them, as for the TTL
    sweeper, nothing is fenced; ``late``: what keeps missed EVICTs, without it none is
    kept)."""

    def __init__(
        self,
        index: _Index,
        server: _Server,
        *,
        fences: _Fences | None = None,
        settle: Callable[[], Awaitable[None]] | None = None,
        late: LateEvictions | None = None,
    ) -> None:
        self._index = index
        self._server = server
        self._fences = fences
        self._settle = settle
        self._late = late

    def drop(self, key_digests: Sequence[str]) -> None:
        for digest in key_digests:
            self._index.pop(digest)

    def fence(self, job_id: str, tenant: str, subject: str | None, until: float) -> int:
        if self._fences is None:
            return 0
        return self._fences.fence(job_id, Fence(tenant, subject, until))

    def lift(self, job_ids: Sequence[str]) -> None:
        if self._fences is not None:
            self._fences.lift(job_ids)

    def fenced(self) -> list[str]:
        return self._fences.fenced_jobs if self._fences is not None else []

    async def settle(self) -> None:
        if self._settle is not None:
            await self._settle()

    def held(self, tenant: str, subject: str | None) -> list[str]:
        if self._fences is None:
            return []
        return self._fences.fenced_entries(Fence(tenant, subject, until=float("inf")))

    async def evict(
        self,
        tenant: str,
        key_digests: Sequence[str],
        timeout_s: float,
        holders: Collection[str] = (),
    ) -> list[EngineEviction]:
        results = await self._server.evict_on_engines(
            sorted(set(key_digests)), timeout_s, tenant=tenant, holders=holders
        )
        return [
            EngineEviction(
                engine=str(r.engine), acked=bool(r.acked), removed=int(r.removed), error=r.error
            )
            for r in results
        ]

    def owe(
        self, job_id: str, tenant: str, engines: Collection[str], key_digests: Sequence[str]
    ) -> None:
        if self._late is not None:
            self._late.owe(job_id, tenant, engines, key_digests)


@dataclass(frozen=True, slots=True)
class PurgeWiring:
    """What a sidecar's purge executor works with: its ledger, keyring, tiers, index and
    engine connections (the sidecar builds it; the purge never sees the sidecar itself)."""

    settings: Settings
    engine: Engine
    writer: LedgerWriter
    keyring: Keyring
    tiers: Sequence[Tier]
    index: _Index
    server: _Server
    pseudonymize: Callable[[str, str], str]
    sidecar_id: str
    #: its pipeline: the purge's erasure fences (None: none raised)
    fences: _Fences | None = None
    #: keeps the EVICTs engines missed until their control channel is back (None: none kept)
    late: LateEvictions | None = None
    #: told of each executor pass that failed (the sidecar counts them)
    on_error: Callable[[Exception], None] | None = None


async def attach_purge(w: PurgeWiring) -> PurgeExecutor:
    """Build and start the sidecar's purge executor."""
    from kvgov.db.engine import make_sessionmaker
    from kvgov.ledger.chain import load_signing_key

    engines = SidecarEngines(w.index, w.server, fences=w.fences, settle=w.writer.flush, late=w.late)
    service = make_service(
        w.settings,
        sessions=make_sessionmaker(w.engine),
        sink=w.writer,
        tiers=w.tiers,
        shredder=KeyringShredder(w.keyring),
        signing_key=load_signing_key(w.settings.signing_key_path),
        pseudonymize=w.pseudonymize,
        checkpoint=writer_checkpointer(w.writer, w.engine, w.writer.chain_id),
        evictor=engines,
        local_index=engines,
        sidecar_id=w.sidecar_id,
        principal=f"sidecar:{w.sidecar_id}",
    )
    executor = PurgeExecutor(
        service, sidecar_id=w.sidecar_id, chain_id=w.settings.chain_id, on_error=w.on_error
    )
    await executor.start()
    return executor

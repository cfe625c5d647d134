"""The sidecar's application factory: :func:`build_sidecar` composes every component from one
``Settings`` (ledger engine, writer, keyring, policy, tiers, pipeline, the kvgov wire server,
the ``lm://`` listener and the control plane). Nothing happens at import. A development sidecar
migrates its ledger schema itself; a production one never does: it refuses to start unless the
schema is current and its database role is a runtime role (``kvgov.db.roles``).

Lifecycle: ``sidecar = await build_sidecar(settings)``; ``await sidecar.start()``;
``await sidecar.stop()`` (stop accepting, drain in-flight puts, flush the ledger, close).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import time
from collections.abc import Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from typing import TYPE_CHECKING, Any

from sqlalchemy.exc import SQLAlchemyError

from kvgov import __version__
from kvgov.config import LOOPBACK_HOSTS, Settings, TransportUse
from kvgov.connectors.tiers.chain import TierChain
from kvgov.connectors.tiers.factory import build_tiers
from kvgov.db.engine import utcnow
from kvgov.errors import ConfigError, KvgovError
from kvgov.follow import file_stamp, follow
from kvgov.keys.keyring import Keyring
from kvgov.keys.store import WrappedKeyStore
from kvgov.ledger.events import Event, EventSink
from kvgov.ledger.pseudonym import Pseudonymizer, generate_pseudonym_key_file
from kvgov.policy.interfaces import PolicyEngine
from kvgov.proxy.dataplane.buffers import BufferPool
from kvgov.proxy.dataplane.index import EntryIndex
from kvgov.proxy.dataplane.limits import ConnectionLimits, DenialGate, SummaryLog
from kvgov.proxy.dataplane.metrics import DataPlaneMetrics
from kvgov.proxy.dataplane.pipeline import Pipeline
from kvgov.proxy.dataplane.plans import inline_crypto_bytes, usable_cpus
from kvgov.proxy.dataplane.records import Recorder
from kvgov.proxy.dataplane.sealers import KeyringSealer, Sealer
from kvgov.proxy.dataplane.server import WireServer
from kvgov.proxy.dataplane.unsafe import NullEventSink, PlaintextSealer
from kvgov.proxy.dataplane.upkeep import (
    expired,
    ledger_entries,
    reconcile,
    reconcile_shared_every,
    shared_tiers,
    sweep,
)
from kvgov.proxy.dataplane.wireconn import ServerConfig
from kvgov.types import Environment, EventKind, Outcome

if TYPE_CHECKING:
    import uvicorn
    from sqlalchemy import Engine

    from kvgov.ledger.writer import LedgerWriter
    from kvgov.proxy.api.app import ControlPlane
    from kvgov.proxy.api.verifier import LedgerVerifier
    from kvgov.proxy.dataplane.lm import LmServer
    from kvgov.proxy.purge.late import LateEvictions
    from kvgov.services.keys import KeyEventRecorder
    from kvgov.services.purge.executor import PurgeExecutor

log = logging.getLogger("kvgov.sidecar")

#: background tasks' names (also the ``task`` label of ``kvgov_background_task_errors``)
_EXECUTOR_TASK = "kvgov-purge-executor"
_RESTORE_TASK = "kvgov-late-evict-restore"

#: the name of the task reconciling the shared tiers while the sidecar runs
SHARED_RECONCILE_TASK = "kvgov-shared-reconcile"


@dataclass
class Sidecar:
    settings: Settings
    pipeline: Pipeline
    server: WireServer
    tiers: TierChain
    metrics: DataPlaneMetrics
    executor: ThreadPoolExecutor
    #: writes large replies to sockets (kvgov.proxy.dataplane.conn.StreamProtocol.send_plan)
    sender: ThreadPoolExecutor
    #: the ledger's writer and engine (None: an ungoverned benchmark sidecar)
    writer: LedgerWriter | None = None
    engine: Engine | None = None
    lm_server: LmServer | None = None
    sidecar_id: str = ""
    _tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    ready: bool = False
    #: the purge executor, None without a ledger
    purge: PurgeExecutor | None = None
    #: the EVICTs engines missed, sent when their control channel is back (with the purge)
    late_evictions: LateEvictions | None = None
    #: records the keys the keyring creates itself
    key_events: KeyEventRecorder | None = None
    #: the control plane's whole-ledger verifications, one at a time, their report kept
    #: (made with the first control plane; :mod:`kvgov.proxy.api.verifier`)
    verifier: LedgerVerifier | None = None
    #: the loop's exception handler before :meth:`start` replaced it (restored at stop)
    _loop_handler: tuple[Any] | None = None
    #: whether :meth:`start` got as far as recording ``sidecar:started``
    _started: bool = False
    #: whether :meth:`stop` was called (it runs once)
    _stopping: bool = False

    async def start(self) -> None:
        """Listen, start the background tasks, record ``sidecar:started``. A start that fails
        part-way stops what it started (listeners, tasks, the writer, flushed) before it
        raises: a listener bound before a later step failed stayed open."""
        try:
            await self._start()
        except BaseException:
            try:
                await self.stop(grace_s=0)
            except Exception as exc:  # noqa: BLE001 - the start's own error is the one to raise
                log.warning("sidecar.start.cleanup_failed", extra={"error": type(exc).__name__})
            raise

    async def _start(self) -> None:
        started = utcnow()  # the purge steps of this process owe in memory from here on
        dp = self.settings.dataplane
        self._watch_accept_errors()
        _descriptor_headroom(self.settings)
        await self.server.start(
            dp.host or None, dp.port, str(dp.unix_path) if dp.unix_path else None
        )
        if dp.lm_port >= 0:
            from kvgov.proxy.dataplane.lm import LmServer

            self.lm_server = LmServer(
                self.pipeline,
                engine_id=dp.lm_engine_id,
                tenants=dp.lm_tenants,
                limits=self.server.limits,  # one global cap over both listeners
                frame_timeout_s=dp.frame_timeout_s,
            )
            await self.lm_server.start(dp.lm_host, dp.lm_port)
        self._tasks.append(asyncio.create_task(self._sweeper(), name="kvgov-ttl-sweeper"))
        reconcile_s = self.settings.tiers.shared_reconcile_interval_s
        engine = self.engine
        recorded = self.settings.dataplane.events == "ledger"
        if engine is not None and recorded and reconcile_s > 0 and shared_tiers(self.tiers):
            # as at start (build_sidecar), again while running: shared tiers only
            self._tasks.append(
                asyncio.create_task(
                    reconcile_shared_every(
                        reconcile_s,
                        self.pipeline.index,
                        self.tiers,
                        self.pipeline.recorder,
                        lookup=partial(ledger_entries, engine),
                        principal=f"sidecar:{self.settings.chain_id}",
                        metrics=self.metrics,
                    ),
                    name=SHARED_RECONCILE_TASK,
                )
            )
        keyring = self.pipeline.keyring
        if self.engine is not None and self.writer is not None and keyring is not None:
            from kvgov.proxy.purge.sidecar import PurgeWiring, attach_purge

            self.late_evictions = self._late_evictions(self.writer)
            self.purge = await attach_purge(
                PurgeWiring(
                    settings=self.settings,
                    engine=self.engine,
                    writer=self.writer,
                    keyring=keyring,
                    tiers=self.tiers.tiers,
                    index=self.pipeline.index,
                    server=self.server,
                    pseudonymize=self.pipeline.pseudonymizer.user,
                    sidecar_id=self.sidecar_id,
                    fences=self.pipeline,
                    late=self.late_evictions,
                    on_error=partial(self._task_failed, _EXECUTOR_TASK),
                )
            )
        if self.purge is not None and self.purge.task is not None:
            self._tasks.append(self.purge.task)
        if self.purge is not None and self.late_evictions is not None:
            self._tasks.append(asyncio.create_task(self._restore_owed(started), name=_RESTORE_TASK))
        if self.engine is not None:  # after the purge executor has registered the row
            self._tasks.append(asyncio.create_task(self._heartbeat(), name="kvgov-heartbeat"))
        if self.pipeline.keyring is not None:
            self._tasks.append(
                asyncio.create_task(self._revalidate_keys(), name="kvgov-key-revalidation")
            )
        policy, every = self.pipeline.policy, self.settings.policy.reload_interval_s
        if policy is not None and every > 0 and self.settings.policy.engine != "unsafe-allow-all":
            from kvgov.policy.factory import configured_source_stamp, load_configured_bundle
            from kvgov.policy.watch import follow_sources

            # the follower's look reads the revision only; the reload checks and compiles
            load = partial(load_configured_bundle, self.settings, check=False)
            stamp = partial(configured_source_stamp, self.settings)
            self._tasks.append(
                asyncio.create_task(follow_sources(policy, load, every, stamp), name="kvgov-policy")
            )
        dp = self.settings.dataplane
        if dp.engine_tokens_file is not None and dp.engine_tokens_reload_interval_s > 0:
            self._tasks.append(
                asyncio.create_task(self._follow_engine_tokens(), name="kvgov-engine-tokens")
            )
        checkpoint_s = self.settings.ledger.checkpoint_interval_s
        if self.writer is not None and checkpoint_s > 0:
            from kvgov.ledger.checkpoint import periodic_checkpoints

            self._tasks.append(
                asyncio.create_task(
                    periodic_checkpoints(self.writer, checkpoint_s), name="kvgov-checkpoints"
                )
            )
        self.ready = True
        await self._record_lifecycle(EventKind.SIDECAR_STARTED)
        self._started = True
        log.info("sidecar.started", extra={"addresses": self.addresses})

    def _late_evictions(self, writer: LedgerWriter) -> LateEvictions:
        """What keeps the EVICTs engines missed, told of every control connection."""
        from kvgov.ledger.checkpoint import checkpoint_logged
        from kvgov.proxy.purge.late import LateEvictions

        purge = self.settings.purge
        late = LateEvictions(
            max_digests=purge.pending_evict_max_digests,
            ttl_s=purge.pending_evict_ttl_s,
            ack_timeout_s=purge.engine_ack_timeout_s,
            sink=writer,
            controls=lambda: list(self.server.controls),
            principal=f"sidecar:{self.sidecar_id}",
            metrics=self.metrics,
            sign=partial(checkpoint_logged, writer),
        )
        self.server.on_control = late.connected
        return late

    async def _restore_owed(self, started: datetime) -> None:
        """Owe engines again what this sidecar's purge steps before ``started`` still owe
        them, as the ledger proves it (a restart no longer loses it: ``docs/purge.md``, "Late
        evictions"): :func:`~kvgov.proxy.purge.restore.restore_owed`, one job at a time."""
        from kvgov.proxy.purge.restore import restore_owed

        assert self.purge is not None and self.late_evictions is not None
        await restore_owed(
            self.purge.service,
            self.late_evictions,
            sidecar_id=self.sidecar_id,
            before=started,
            retry_s=self.settings.tiers.sweep_interval_s,
            on_error=partial(self._task_failed, _RESTORE_TASK),
        )

    def _task_failed(self, task: str, _exc: BaseException) -> None:
        """Count a background task's failure (its caller logged it, by the error's type)."""
        self.metrics.task_errors.labels(task).inc()

    def control_plane(self) -> ControlPlane:
        """What the control plane may see of this sidecar (:func:`create_control_app`)."""
        from kvgov.proxy.api.app import ControlPlane, Ledger, Purges

        ledger = purges = None
        if self.engine is not None and self.writer is not None:
            if self.verifier is None:
                from kvgov.proxy.api.verifier import LedgerVerifier

                self.verifier = LedgerVerifier.from_settings(
                    self.settings.api, registry=self.metrics.registry
                )
            ledger = Ledger(
                self.engine, self.writer, self.pipeline.pseudonymizer, verifier=self.verifier
            )
            if self.purge is not None:
                refused = self.metrics.purges_refused
                purges = Purges(
                    self.purge.service,
                    self.purge.wake,
                    refused=lambda reason: refused.labels(reason).inc(),
                )
        return ControlPlane(
            settings=self.settings,
            is_ready=lambda: self.ready and not self.server.draining,
            metrics=self.metrics.registry,
            ledger=ledger,
            keyring=self.pipeline.keyring,
            purges=purges,
        )

    @property
    def addresses(self) -> list[str]:
        """Every listener, the ``lm://`` one included."""
        out = list(self.server.addresses)
        if self.lm_server is not None and self.lm_server.port is not None:
            out.append(f"lm://{self.settings.dataplane.lm_host}:{self.lm_server.port}")
        return out

    async def _record_lifecycle(self, kind: EventKind) -> None:
        """A ``sidecar:started``/``sidecar:stopped`` event: an auditor can tell which node ran,
        when, with which policy revision, tiers and governance switch."""
        if self.writer is None:
            return
        policy = self.pipeline.policy
        revision = policy.revision if policy is not None else None
        await self.writer.append(
            Event(
                kind=kind,
                principal=self.sidecar_id,
                outcome=Outcome.OK,
                policy_revision=revision.policy if revision is not None else None,
                attrs={
                    "version": __version__,
                    "data_revision": revision.data if revision is not None else None,
                    "governance": self.pipeline.governed,
                    "tiers": list(self.settings.tiers.chain),
                    "listeners": self.addresses,
                    "environment": str(self.settings.environment),
                },
            )
        )

    async def sweep(self) -> None:
        """One pass of the TTL and retention sweeper: with a ledger, through the purge's
        deletion path (deleted from every tier, verified gone, recorded as ``kv:expired``);
        without one (benchmarks), dropped unrecorded."""
        if self.late_evictions is not None:  # what is owed past its lifetime goes
            self.late_evictions.prune()
        if self.writer is None or self.engine is None:
            await sweep(self.pipeline.index, self.pipeline.tiers, self.pipeline.clock())
            return
        from kvgov.db.engine import make_sessionmaker
        from kvgov.proxy.purge.sidecar import SidecarEngines
        from kvgov.services.purge.ports import TierSet
        from kvgov.services.purge.retention import apply_retention
        from kvgov.services.purge.scope import ScopedEntry
        from kvgov.types import EntryState

        here = [
            (ScopedEntry(digest, EntryState.LIVE, (), None), tenant)
            for digest, tenant in await expired(
                self.pipeline.index, self.pipeline.tiers, self.pipeline.clock()
            )
        ]
        report = await apply_retention(
            make_sessionmaker(self.engine),
            TierSet(self.tiers.tiers),
            self.writer,
            now=utcnow(),
            principal=f"sidecar:{self.sidecar_id}",
            chain_id=self.settings.chain_id,
            expired_here=here,
            local_index=SidecarEngines(self.pipeline.index, self.server),
        )
        if report.ttl_expired or report.retention_expired:
            log.info(
                "sidecar.swept",
                extra={"ttl": report.ttl_expired, "retention": report.retention_expired},
            )

    async def _sweeper(self) -> None:
        interval = self.settings.tiers.sweep_interval_s
        while True:
            await asyncio.sleep(interval)
            try:
                await self.sweep()
            except Exception:
                log.exception("sidecar.sweep.failed")

    async def _heartbeat(self) -> None:
        """Refresh ``sidecars.last_seen_at`` on its own clock: purge jobs give their tier and
        engine steps only to sidecars seen within ``purge.sidecar_live_s``, and this must not
        depend on the purge executor's loop (a long purge step would make the sidecar look
        dead) nor on it being attached at all."""
        interval = heartbeat_interval_s(self.settings)
        loop = asyncio.get_running_loop()
        engine = self.engine
        if engine is None:
            return
        while True:
            beat = loop.run_in_executor(
                None, touch_sidecar, engine, self.sidecar_id, self.settings.chain_id
            )
            try:
                await asyncio.shield(beat)
            except asyncio.CancelledError:
                # stop() disposes of the engine next: let the beat in flight check its
                # connection back in first
                with contextlib.suppress(SQLAlchemyError, OSError):
                    await beat
                raise
            except (SQLAlchemyError, OSError) as exc:
                log.warning("sidecar.heartbeat.failed", extra={"error": type(exc).__name__})
            await asyncio.sleep(interval)

    async def _revalidate_keys(self) -> None:
        """Every ``keys.revalidate_interval_s``, in a worker thread, catch the keyring up with
        shreds and rotations done by other processes sharing the key store (``kvgov keys``, a
        purge run elsewhere, another sidecar): a destroyed key stops opening data (a get is a
        miss) and new data is sealed under the newest active version."""
        keyring = self.pipeline.keyring
        if keyring is None:
            return
        interval = self.settings.keys.revalidate_interval_s
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(interval)
            check = loop.run_in_executor(None, keyring.revalidate)
            try:
                await asyncio.shield(check)
            except asyncio.CancelledError:
                # stop() disposes of the engine next: let the check in flight finish first
                with contextlib.suppress(Exception):
                    await check
                raise
            except Exception:  # keep checking: a dead task would leave the window unbounded
                log.exception("sidecar.keys.revalidate_failed")

    async def _follow_engine_tokens(self) -> None:
        """Every ``dataplane.engine_tokens_reload_interval_s``, look at the engine token file
        (a mounted Secret); when it changed, read it and hand the tokens to the server, which
        closes the connections of removed ones. A file that does not read (half written, not
        JSON, not an object, an entry that is not a token naming a string) is refused and
        logged once, never its content; the tokens in force stay (:func:`kvgov.follow.follow`).
        An entry whose engine id is refused (:mod:`kvgov.engine_ids`: ``lm:...``, control
        characters) is left out, logged and counted (``kvgov_dataplane_engine_tokens_refused``),
        and the file's other tokens are taken: the left-out token opens nothing, and its
        connections are closed. A well-formed object left with no valid token (``{}``: the
        last token removed) revokes them all: every token connection is closed, every HELLO is
        refused (:meth:`~kvgov.proxy.dataplane.server.WireServer.authenticate`), and
        ``dataplane.tokens.all_revoked`` is logged as an error, until the file holds a token."""
        path = self.settings.dataplane.engine_tokens_file
        assert path is not None

        async def apply() -> None:
            tokens, refused = await asyncio.to_thread(
                partial(self.settings.read_engine_tokens, revoke_all=True)
            )
            if refused:
                self.metrics.engine_tokens_refused.inc(len(refused))
                log.warning(
                    "dataplane.tokens.entries_refused",
                    extra={"refused": len(refused), "reasons": sorted(set(refused))},
                )
            closed = self.server.replace_tokens(tokens)
            if not tokens:
                # an operator revoked the last token (the shipped layout has one): every
                # engine is cut off until the file holds a token again
                log.error(
                    "dataplane.tokens.all_revoked",
                    extra={"connections_closed": closed, "refused": len(refused)},
                )
                return
            log.info(
                "dataplane.tokens.reloaded",
                extra={"tokens": len(tokens), "connections_closed": closed},
            )

        await follow(
            partial(file_stamp, [path]),
            apply,
            self.settings.dataplane.engine_tokens_reload_interval_s,
            log=log,
            event="dataplane.tokens.reload_refused",
            refused=ConfigError,  # names the file and what is wrong, never a token
        )

    async def stop(self, grace_s: float = 30.0) -> None:
        """Stop accepting, drain in-flight requests, flush the ledger, close everything. Once:
        a second call (a caller's cleanup after a start that failed and stopped itself) returns
        at once."""
        if self._stopping:
            return
        self._stopping = True
        self.ready = False
        await self.server.stop_accepting()
        if self.lm_server is not None:
            await self.lm_server.stop_accepting()
        await self.server.drain(grace_s)
        if self.lm_server is not None:
            await self.lm_server.drain(grace_s)
        await self.pipeline.recorded()  # e.g. the denial summaries of the closed connections
        if self.late_evictions is not None:  # (their connections are closed: nothing to send)
            self.server.on_control = None
            await self.late_evictions.aclose()
        for task in self._tasks:
            await self._end_task(task)
        if self.key_events is not None:  # key events handed over but not yet submitted
            await self.key_events.drain()
        if self._started:  # (a start that failed part-way recorded no start either)
            with contextlib.suppress(KvgovError):  # a stop must finish even if the ledger cannot
                await self._record_lifecycle(EventKind.SIDECAR_STOPPED)
        if self.pipeline.policy is not None:
            await self.pipeline.policy.aclose()
        if self.writer is not None:  # a final checkpoint signs everything it wrote
            await self.writer.close(checkpoint=self.settings.ledger.checkpoint_interval_s > 0)
        await self.tiers.close()
        if self.pipeline.keyring is not None:
            self.pipeline.keyring.flush_usage()
        self.sender.shutdown(wait=True)
        self.executor.shutdown(wait=True)
        if self.engine is not None:
            self.engine.dispose()
        if self._loop_handler is not None:
            asyncio.get_running_loop().set_exception_handler(self._loop_handler[0])
            self._loop_handler = None
        log.info("sidecar.stopped")

    async def _end_task(self, task: asyncio.Task[Any]) -> None:
        """Cancel a background task and wait for it. A task that had died of an error is
        logged (by the error's type) and counted, and the stop goes on: it raised that error
        again here, before the writer's close (no final checkpoint, no close seal: review r14,
        F1)."""
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        except Exception as exc:  # noqa: BLE001 - the stop must reach the writer's close
            log.error(
                "sidecar.task.failed", extra={"task": task.get_name(), "error": type(exc).__name__}
            )
            self._task_failed(task.get_name(), exc)

    def _watch_accept_errors(self) -> None:
        """Count the listeners' accept() failures (descriptors or memory exhausted: asyncio
        stops accepting on that socket for a second and retries) and log them summarised,
        once per interval without a traceback, instead of one traceback per failure."""
        loop = asyncio.get_running_loop()
        previous = loop.get_exception_handler()
        summary = SummaryLog(logging.getLogger("kvgov.dataplane.server"))

        def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
            exc = context.get("exception")
            if context.get("message") == ACCEPT_OUT_OF_RESOURCES and isinstance(exc, OSError):
                self.metrics.accept_errors.inc()
                summary.note(
                    "dataplane.accept.out_of_resources",
                    level=logging.ERROR,
                    error=errno.errorcode.get(exc.errno or 0, str(exc.errno)),
                )
                return
            if previous is not None:
                previous(loop, context)
            else:
                loop.default_exception_handler(context)

        self._loop_handler = (previous,)
        loop.set_exception_handler(handler)

    async def evict_on_engines(
        self, keys: list[str], timeout_s: float, *, tenant: str, holders: Collection[str] = ()
    ) -> list[Any]:
        """EVICT the entries (key digests) on the control connections of the engines that
        may hold ``tenant``'s data (:meth:`WireServer.evict_on_engines`)."""
        return await self.server.evict_on_engines(keys, timeout_s, tenant=tenant, holders=holders)


def heartbeat_interval_s(settings: Settings) -> float:
    """A quarter of the liveness window, at most 10 s: three missed beats still count as live."""
    return min(10.0, settings.purge.sidecar_live_s / 4)


def touch_sidecar(engine: Engine, sidecar_id: str, chain_id: str) -> None:
    """One heartbeat (blocking: run it in a thread); this function owns the transaction."""
    from sqlalchemy.orm import Session

    from kvgov.db import sidecars
    from kvgov.db.engine import SQLITE_BEGIN_IMMEDIATE, utcnow

    with Session(engine) as session, session.begin():
        # read-then-write: on SQLite take the write lock up front, or a writer committing in
        # between makes the upgrade fail at once with "database is locked"
        session.connection(execution_options={SQLITE_BEGIN_IMMEDIATE: True})
        sidecars.heartbeat(session, sidecar_id, now=utcnow(), chain_id=chain_id)


def provisioning_problems(settings: Settings, *, signs: bool, own_policy: bool) -> list[str]:
    """What a sidecar outside development must find provisioned and does not (empty: none):
    the fleet's pseudonym key, its signing key (``signs``: it writes the ledger) and, for the
    configured policy (``own_policy``), a data document the operator named. Each names its
    setting; none quotes a key."""
    from kvgov.policy.bundle import operator_data_file

    problems: list[str] = []
    keys = [("ledger.pseudonym_key_path", settings.pseudonym_key_path, "pseudonym key")]
    if signs:
        keys.append(("ledger.signing_key_path", settings.signing_key_path, "signing key"))
    for name, path, what in keys:
        if not path.is_file():
            where = " (unset)" if getattr(settings.ledger, name.split(".")[1]) is None else ""
            problems.append(f"{name}{where}: no {what} at {path}")
    policy = settings.policy
    explicit = operator_data_file(policy.policy_dir, policy.data_file) is not None
    if own_policy and policy.engine != "unsafe-allow-all" and not explicit:
        problems.append(
            "policy.data_file is unset (and policy.policy_dir holds no data.json): the "
            "packaged example data (tenant 'demo' admits every engine) is for development"
        )
    return problems


async def _refuse_an_open_opa(settings: Settings) -> None:
    """Outside development, a token proves nothing if the OPA it goes to serves everyone: one
    started without ``--authentication=token --authorization=basic`` (an overlay of one's own)
    answers the pod's every container. Such an OPA stops start-up; one that cannot be asked
    now is left to the decisions, which deny while it cannot answer."""
    if settings.environment is Environment.DEVELOPMENT:
        return
    from kvgov.policy.opa import OPEN_PROBE_PATH, answers_without_token

    url = settings.policy.opa_url
    open_ = await answers_without_token(
        url, settings.policy.opa_timeout_s, opa_uids=settings.policy.opa_uids
    )
    if open_ is None:
        log.warning("policy.opa.unchecked", extra={"opa_url": url, "probe": OPEN_PROBE_PATH})
    elif open_:
        raise ConfigError(
            f"the OPA at {url} answers kvgov's decision request without a token"
            f" (POST {OPEN_PROBE_PATH} answered 200): every container that reaches it reads"
            " the policy and its data and asks any decision",
            hint="start OPA with --authentication=token --authorization=basic and the"
            " system.authz policy of deploy/kubernetes/overlays/production/opa-authz.rego"
            ' (docs/deploy.md, "OPA\'s own API")',
        )


async def build_sidecar(
    settings: Settings,
    *,
    policy: PolicyEngine | None = None,
    sink: EventSink | None = None,
) -> Sidecar:
    """Build (not start) a sidecar. ``policy``/``sink`` override the configured ones (tests).
    A build that fails (a misconfiguration found on the way) releases what it had made."""
    async with contextlib.AsyncExitStack() as undo:
        sidecar = await _build_sidecar(settings, policy, sink, undo)
        undo.pop_all()  # built: its stop() releases all of it from now on
        return sidecar


def _warn_unverified_transports(settings: Settings, *, ledger: bool) -> None:
    """Every start says which of its connections production admits beyond this host without
    verified TLS because a mesh opt-out says something else (mTLS) protects them: the
    operator's word, which nothing here can check (review r16, finding 2)."""
    uses: list[TransportUse] = ["runtime"] if ledger else []
    if "redis" in settings.tiers.chain:
        uses.append("redis")
    for found in settings.unverified_transports(*uses):
        event = "tiers.redis.tls_unverified" if found.use == "redis" else "database.tls.unverified"
        log.warning(
            event,
            extra={"setting": found.setting, "hosts": found.hosts, "opt_out": found.opt_out},
        )


async def _build_sidecar(
    settings: Settings,
    policy: PolicyEngine | None,
    sink: EventSink | None,
    undo: contextlib.AsyncExitStack,
) -> Sidecar:
    dp = settings.dataplane
    recorded = dp.events == "ledger"
    sealed = dp.sealer == "aes-256-gcm"
    unsafe = [
        name
        for name, on in (
            ("dataplane.sealer=unsafe-plaintext", not sealed),
            ("dataplane.events=unsafe-null", not recorded),
            ("policy.engine=unsafe-allow-all", settings.policy.engine == "unsafe-allow-all"),
        )
        if on
    ]
    if unsafe and settings.environment is not Environment.DEVELOPMENT:
        raise ConfigError(f"{', '.join(unsafe)}: benchmarks only; set environment=development")
    _warn_unverified_transports(settings, ledger=recorded or sealed)
    metrics = DataPlaneMetrics()
    executor = ThreadPoolExecutor(max_workers=dp.crypto_threads, thread_name_prefix="kvgov-crypto")
    sender = ThreadPoolExecutor(max_workers=dp.send_threads, thread_name_prefix="kvgov-send")
    undo.callback(executor.shutdown, wait=False)
    undo.callback(sender.shutdown, wait=False)
    settings.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    index = EntryIndex()
    engine = writer = key_events = None
    sealer: Sealer = PlaintextSealer()
    if recorded or sealed:
        from kvgov.db.engine import make_engine, migrate

        if settings.environment is Environment.DEVELOPMENT:
            migrate(settings)  # a development sidecar keeps its own schema current
        else:  # migrations are a step of their own (kvgov db upgrade, as the owner role)
            from kvgov.db.roles import check_schema

            check_schema(settings)
        engine = make_engine(settings.database_url, pool_size=settings.database.pool_size)
        undo.callback(engine.dispose)
    signs = sink is None and engine is not None and recorded
    if settings.environment is Environment.DEVELOPMENT:
        # a development sidecar makes what it lacks (kvgov demo, a first run); production
        # never does: a pod's own key would record pseudonyms no purge of the fleet can name
        generate_pseudonym_key_file(settings.pseudonym_key_path)
        if signs:
            from kvgov.ledger.chain import generate_signing_key_file

            generate_signing_key_file(settings.signing_key_path)
    else:
        problems = provisioning_problems(settings, signs=signs, own_policy=policy is None)
        if problems:
            raise ConfigError(
                "not provisioned for production: " + "; ".join(problems),
                hint="outside development kvgov never generates these: provision the fleet's "
                "keys and policy data (docs/deploy.md), or set environment=development",
            )
    pseudonymizer = Pseudonymizer.from_file(settings.pseudonym_key_path)
    if engine is not None:
        from kvgov.ledger.keypin import check_pseudonym_key

        # before anything is recorded: a pod with another key than the fleet's pinned one
        # would record users no purge can name (blocking, like the schema check above)
        check_pseudonym_key(engine, pseudonymizer)
    if sink is None and not recorded:
        sink = NullEventSink()
    if sink is None and engine is not None:
        from kvgov.ledger.chain import load_signing_key
        from kvgov.ledger.journal import Journal
        from kvgov.ledger.writer import LedgerWriter

        writer = LedgerWriter(
            engine,
            chain_id=settings.chain_id,
            signing_key=load_signing_key(settings.signing_key_path),
            batch_max_events=settings.ledger.batch_max_events,
            queue_max_events=settings.ledger.queue_max_events,
            lazy_max_delay_ms=settings.ledger.lazy_max_delay_ms,
            journal=(
                Journal(
                    settings.journal_path,
                    segment_bytes=settings.ledger.journal_segment_mib << 20,
                )
                if settings.ledger.journal
                else None
            ),
            journal_lazy_events=settings.ledger.journal_lazy_events,
            journal_sync_interval_ms=settings.ledger.journal_sync_interval_ms,
        )
        await writer.start()
        undo.push_async_callback(writer.close, checkpoint=False)
        sink = writer
    assert sink is not None  # the configured ledger, the given sink or the null one
    if sealed and engine is not None:
        from kvgov.db.keystore import SqlKeyStore
        from kvgov.keys.kek import FileKekProvider, generate_kek_file
        from kvgov.services.keys import KeyEventRecorder

        if settings.environment is Environment.DEVELOPMENT and not settings.kek_path.exists():
            generate_kek_file(settings.kek_path)
        store: WrappedKeyStore = SqlKeyStore(engine)
        key_events = KeyEventRecorder(sink, asyncio.get_running_loop(), principal=settings.chain_id)
        sealer = KeyringSealer(
            Keyring.from_settings(
                settings,
                store,
                FileKekProvider(settings.kek_path, environment=settings.environment),
                on_change=key_events,
            )
        )
    if policy is None and settings.policy.engine == "opa":
        await _refuse_an_open_opa(settings)
    if policy is None:
        from kvgov.policy.factory import build_policy_engine
        from kvgov.policy.recording import EventDecisionRecorder

        # the caching engine records every deny and the first allow of each decision
        policy = build_policy_engine(settings, recorder=EventDecisionRecorder(sink))
    if recorded and engine is not None:
        from kvgov.proxy.dataplane.restore import load_index

        await asyncio.get_running_loop().run_in_executor(
            None, load_index, engine, index, time.time()
        )
    # capacity evictions become kv:evict events (late bound: the pipeline is built below)
    tiers = await build_tiers(settings, on_evict=lambda *ev: pipeline.tier_evicted(*ev))  # noqa: PLW0108
    undo.push_async_callback(tiers.close)
    if recorded and engine is not None:
        # each orphan deleted is recorded (kv:delete, reason orphan), durable before serving
        db = engine
        removed = await reconcile(
            index,
            tiers,
            Recorder(sink),
            lookup=lambda digests: ledger_entries(db, digests),
            principal=f"sidecar:{settings.chain_id}",
        )
        for name, count in removed.items():
            metrics.orphans_removed.labels(name).inc(count)
        if removed:
            log.warning("tiers.reconciled", extra={"removed_not_live": removed})
    cpus = usable_cpus()
    inline = inline_crypto_bytes(dp.inline_crypto_bytes, cpus)
    log.info(
        "dataplane.crypto",
        extra={
            "cpus": cpus,
            "crypto_threads": dp.crypto_threads,
            "inline_crypto_bytes": inline,
            "configured": dp.inline_crypto_bytes is not None,
        },
    )
    pipeline = Pipeline(
        tiers=tiers,
        pseudonymizer=pseudonymizer,
        pool=BufferPool(
            dp.buffer_pool_bytes, int(dp.buffer_pool_bytes * dp.buffer_pool_engine_share)
        ),
        executor=executor,
        sender=sender,
        metrics=metrics,
        index=index,
        policy=policy,
        sealer=sealer,
        sink=sink,
        segment_size=settings.keys.segment_size,
        inline_crypto_bytes=inline,
        default_tenant=dp.lm_default_tenant or None,
        denial_gate=DenialGate(
            per_connection=dp.denials_recorded_per_connection,
            per_second=dp.denials_recorded_per_s,
        ),
    )
    metrics.watch(
        lambda: float(pipeline.pool.in_use_bytes),
        lambda: float(writer.queue_depth if writer is not None else 0),
        lambda: float(writer.stats.foreign_appends if writer is not None else 0),
        (
            lambda: float(writer.stats.seal_keys_taken if writer is not None else 0),
            lambda: float(writer.stats.seal_failures if writer is not None else 0),
        ),
    )
    metrics.watch_tiers(tiers.tiers)
    journal = writer.journal if writer is not None else None
    if writer is not None and journal is not None:
        ledger = writer
        metrics.watch_journal(
            lambda: float(max(0, journal.last_position - ledger.applied_upto)),
            lambda: float(journal.pending_bytes()),
            lambda: float(ledger.stats.journal_failures),
            lambda: float(ledger.stats.journal_syncs),
        )
    sidecar_id = settings.chain_id
    server = WireServer(
        pipeline,
        ServerConfig(
            sidecar_id=sidecar_id,
            version=__version__,
            max_frame_bytes=dp.max_frame_bytes,
            engine_tokens=settings.engine_tokens,
            allow_anonymous=settings.environment is Environment.DEVELOPMENT,
            digester=pseudonymizer.key_digester,
            max_frame_items=dp.max_frame_items,
            hello_timeout_s=dp.hello_timeout_s,
            frame_timeout_s=dp.frame_timeout_s,
        ),
        ConnectionLimits(
            max_total=dp.max_connections,
            per_peer=dp.max_connections_per_peer,
            per_engine=dp.max_connections_per_engine,
            metrics=metrics,
        ),
    )
    return Sidecar(
        settings=settings,
        pipeline=pipeline,
        server=server,
        tiers=tiers,
        metrics=metrics,
        executor=executor,
        sender=sender,
        writer=writer,
        engine=engine,
        sidecar_id=sidecar_id,
        key_events=key_events,
    )


#: what asyncio's loop reports when accept() fails for want of descriptors or memory
ACCEPT_OUT_OF_RESOURCES = "socket.accept() out of system resource"
#: descriptors kept for everything but connections (ledger, tiers, journal, threads)
DESCRIPTOR_RESERVE = 256


def _descriptor_headroom(settings: Settings) -> None:
    """Raise the soft descriptor limit towards what the connection caps need (up to the hard
    limit); warn, saying what to set, when even that is short."""
    import resource

    need = settings.dataplane.max_connections + settings.api.limit_concurrency + DESCRIPTOR_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    if soft != resource.RLIM_INFINITY and soft < need:
        log.warning(
            "sidecar.descriptors.low",
            extra={
                "limit": soft,
                "needed": need,
                "hint": "raise the descriptor limit (ulimit -n) or lower "
                "dataplane.max_connections / api.limit_concurrency",
            },
        )


def _control_server_class() -> type[uvicorn.Server]:
    import uvicorn

    class ControlServer(uvicorn.Server):
        """uvicorn without its own signal handling: the sidecar owns SIGTERM/SIGINT."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    return ControlServer


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def development_exposure(settings: Settings) -> dict[str, str | list[str]] | None:
    """What a development sidecar opens beyond its own process and what development lets
    through there, as the fields of the ``sidecar.development`` warning (None: not development,
    or nothing listens on a network).

    Development is an environment's default (an image run without ``KVGOV_ENVIRONMENT``
    included), so nothing else would say that the TCP wire on a pod's loopback, which every
    container of the pod shares, admits any engine id without a token. Network listeners: the
    TCP wire (any host: loopback is the pod's), ``lm://``, and the control plane beyond loopback
    or without ``api.auth``. The Unix socket alone is not one (its folder is this user's)."""
    from kvgov.policy.bundle import operator_data_file

    if settings.environment is not Environment.DEVELOPMENT:
        return None
    dp, api, policy = settings.dataplane, settings.api, settings.policy
    listeners: list[str] = []
    if dp.host:
        listeners.append(f"kvgov wire tcp://{_address(dp.host, dp.port)}")
    if dp.lm_port >= 0:
        listeners.append(f"lm:// tcp://{_address(dp.lm_host, dp.lm_port)}")
    plain_api = api.host not in LOOPBACK_HOSTS and not api.tls
    if api.host not in LOOPBACK_HOSTS or not api.auth:
        scheme = "https" if api.tls else "http"
        listeners.append(f"control plane {scheme}://{_address(api.host, api.port)}")
    if not listeners:
        return None
    allows: list[str] = []
    if not dp.engine_tokens and dp.engine_tokens_file is None:
        allows.append(
            "engines admitted without a token: whoever reaches the kvgov wire names any engine"
            " id (every container of a pod shares its loopback)"
        )
    if (
        policy.engine == "embedded"
        and operator_data_file(policy.policy_dir, policy.data_file) is None
    ):
        allows.append("the packaged example policy data: its tenant 'demo' admits every engine")
    if plain_api:
        allows.append("the control plane in plain HTTP beyond loopback")
    unsafe = [
        name
        for name, on in (
            ("api.auth=false", not api.auth),
            ("policy.engine=unsafe-allow-all", policy.engine == "unsafe-allow-all"),
            ("dataplane.sealer=unsafe-plaintext", dp.sealer == "unsafe-plaintext"),
            ("dataplane.events=unsafe-null", dp.events == "unsafe-null"),
        )
        if on
    ]
    if unsafe:
        allows.append("settings production refuses: " + ", ".join(unsafe))
    allows.append("keys the sidecar generates itself, and a ledger schema it migrates itself")
    return {
        "listeners": listeners,
        "allows": allows,
        "hint": "set environment=production (KVGOV_ENVIRONMENT=production, or environment ="
        ' "production" in --config) for anything but a workstation (docs/operations.md)',
    }


async def run_sidecar(settings: Settings) -> None:
    """Build, start and serve until SIGTERM/SIGINT; then shut down gracefully."""
    import signal

    from kvgov.proxy.api.app import create_control_app
    from kvgov.proxy.api.server import api_config
    from kvgov.proxy.api.tls import api_tls_context

    exposure = development_exposure(settings)
    if exposure is not None:
        log.warning("sidecar.development", extra=exposure)
    # the API's TLS files first: a missing or mismatched one stops start-up before anything
    # is built or listens
    tls = api_tls_context(settings.api)
    # handlers first: a SIGTERM while the sidecar starts (it serves before the control plane
    # is up) stops it gracefully once started, instead of killing it mid-way
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    sidecar = await build_sidecar(settings)
    await sidecar.start()
    try:  # what follows the start failing stops the sidecar too (a final checkpoint, flushed)
        if sidecar.engine is not None:
            from kvgov.proxy.dataplane.restore import register_sidecar

            endpoint = sidecar.server.addresses[0] if sidecar.server.addresses else None
            await asyncio.get_running_loop().run_in_executor(
                None,
                register_sidecar,
                sidecar.engine,
                sidecar.sidecar_id,
                settings.chain_id,
                endpoint,
            )
        api = settings.api
        config = api_config(create_control_app(sidecar.control_plane()), api, tls)
        web = _control_server_class()(config)
        web_task = asyncio.create_task(web.serve())
    except BaseException:
        await sidecar.stop(grace_s=0)
        raise
    await stop.wait()
    log.info("sidecar.stopping")
    await sidecar.stop()
    web.should_exit = True
    await web_task

"""Prometheus metrics of the data plane, in a registry of their own (no global state).

Labels are bounded: operation names, listener names, outcome and a reason cut to its first
``:`` (policy reasons are a fixed vocabulary). No tenant, user or key labels.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvgov.connectors.tiers.base import Measured, Tier
from kvgov.db.tokens import token_events_forged, tokens_unrecorded
from kvgov.ledger.checkpoint_scan import scans_capped
from kvgov.ledger.seals.scan import scans_capped as seal_scans_capped

_LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
)


class DataPlaneMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.ops = Counter(
            "kvgov_dataplane_ops", "KV operations served", ["op", "listener", "outcome"], registry=r
        )
        self._op_children: dict[tuple[str, str, str], Any] = {}
        self._latency_children: dict[str, Any] = {}
        self.op_bytes = Counter(
            "kvgov_dataplane_bytes",
            "KV payload bytes stored (put) or served (get)",
            ["op"],
            registry=r,
        )
        self.denials = Counter(
            "kvgov_dataplane_denials", "Operations denied, by reason", ["op", "reason"], registry=r
        )
        self.unreadable = Counter(
            "kvgov_dataplane_unreadable",
            "Stored values that failed their checks at GET (answered as a miss, dropped from"
            " every tier and recorded), by error code",
            ["reason"],
            registry=r,
        )
        self.latency = Histogram(
            "kvgov_dataplane_latency_seconds",
            "Time to serve one request frame",
            ["op"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.connections = Gauge(
            "kvgov_dataplane_connections", "Open data-plane connections", ["listener"], registry=r
        )
        self.protocol_errors = Counter(
            "kvgov_dataplane_protocol_errors", "Frames rejected", ["listener", "error"], registry=r
        )
        self.refused = Counter(
            "kvgov_dataplane_connections_refused",
            "Connections closed at once: a connection cap (global, peer, engine) was reached",
            ["listener", "cap"],
            registry=r,
        )
        self.timeouts = Counter(
            "kvgov_dataplane_timeouts",
            "Connections closed because a deadline passed (hello, frame or reply)",
            ["listener", "phase"],
            registry=r,
        )
        self.denials_suppressed = Counter(
            "kvgov_dataplane_denials_suppressed",
            "Denials over the recording caps: summarised in one ledger event, not one each",
            ["op"],
            registry=r,
        )
        self.accept_errors = Counter(
            "kvgov_dataplane_accept_errors",
            "Listener accept() failures (descriptor or memory exhaustion); accepting backs off",
            registry=r,
        )
        self.orphans_removed = Counter(
            "kvgov_tiers_orphans_removed",
            "Values a tier held that no live entry names (erased while this sidecar was down,"
            " or left in a shared Redis), deleted and recorded as kv:delete orphan, by tier",
            ["tier"],
            registry=r,
        )
        self.reconcile_passes = Counter(
            "kvgov_tiers_reconcile_passes",
            "Periodic reconciles of a shared tier with the ledger"
            " (tiers.shared_reconcile_interval_s), by tier and outcome (ok, failed)",
            ["tier", "outcome"],
            registry=r,
        )
        self.engine_tokens_refused = Counter(
            "kvgov_dataplane_engine_tokens_refused",
            "Entries of a reloaded dataplane.engine_tokens_file left out because their engine"
            " id is refused (empty, too long, control characters, or beginning with lm:)",
            registry=r,
        )
        self.late_evict = Counter(
            "kvgov_purge_late_evict_digests",
            "Key digests of EVICTs owed to engines a purge step could not reach, by outcome:"
            " owed, delivered (acknowledged and recorded as purge:evict:late), failed (an"
            " attempt not acknowledged; still owed), dropped_ttl, dropped_max",
            ["outcome"],
            registry=r,
        )
        self.purges_refused = Counter(
            "kvgov_api_purges_refused",
            "POST /v1/purges refused before a job was made, by reason: unknown_subject (an id"
            " the ledger never saw, without force), open_jobs and per_minute (a tenant-scoped"
            " token's bounds)",
            ["reason"],
            registry=r,
        )
        self.task_errors = Counter(
            "kvgov_background_task_errors",
            "Failures of the sidecar's background tasks, by task: a purge executor pass, a job"
            " the late-EVICT restore could not read, a task found dead at stop (each logged by"
            " its error's type; the task goes on, or the stop finishes)",
            ["task"],
            registry=r,
        )
        self.late_evict_pending = Gauge(
            "kvgov_purge_late_evict_pending_digests",
            "Key digests of EVICTs owed to engines now (in memory; lost with a restart)",
            registry=r,
        )
        self.pool_bytes = Gauge(
            "kvgov_dataplane_buffer_pool_in_use_bytes", "Bytes of pooled buffers in use", registry=r
        )
        self.ledger_queue = Gauge(
            "kvgov_ledger_queue_depth", "Events waiting for the ledger writer", registry=r
        )
        self.ledger_foreign = Gauge(
            "kvgov_ledger_foreign_appends",
            "Positions of this sidecar's chain found written by someone else while it held the"
            " chain, since start (each named by a signed foreign seal: audit verify fails them)",
            registry=r,
        )
        self.ledger_seal_keys_taken = Gauge(
            "kvgov_ledger_seal_keys_taken",
            "Keys of this sidecar's own chain seals found taken by a row it did not write, since"
            " start (someone with the runtime database role inserting into chain_seals; each"
            " seal went under a fresh random key)",
            registry=r,
        )
        self.ledger_seal_failures = Gauge(
            "kvgov_ledger_seal_failures",
            "Ledger transactions retried because a seal of this sidecar's own could not be"
            " written, since start (its events wait, never refused)",
            registry=r,
        )
        self.ledger_checkpoint_scans_capped = Gauge(
            "kvgov_ledger_checkpoint_scans_capped",
            "Checkpoint lookups (a receipt's cross-check, a job view, a restore, the receipt's"
            " checkpoint) that stopped at their cap of rows examined, since start: someone with"
            " the runtime database role is inserting junk into checkpoints, and what each"
            " lookup was to prove was not counted as signed (receipts say incomplete)",
            registry=r,
        )
        self.ledger_checkpoint_scans_capped.set_function(lambda: float(scans_capped()))
        self.api_tokens_unrecorded = Gauge(
            "kvgov_api_tokens_unrecorded",
            "API tokens used since start whose row no chained token:created event explains"
            " (inserted into api_tokens outside kvgov token and /v1/tokens, e.g. with the"
            " runtime database role; each logged once as api.token.unrecorded)",
            registry=r,
        )
        self.api_tokens_unrecorded.set_function(lambda: float(tokens_unrecorded()))
        self.api_token_events_forged = Gauge(
            "kvgov_api_token_events_forged",
            "token:created events met since start that the ledger does not vouch for (on no"
            " chain a trusted key signed the genesis of, or under no head its writer signed:"
            " inserted into ledger_events with the runtime database role; they count for"
            " nothing, each logged once as api.token.forged_event)",
            registry=r,
        )
        self.api_token_events_forged.set_function(lambda: float(token_events_forged()))
        self.ledger_seal_scans_capped = Gauge(
            "kvgov_ledger_seal_scans_capped",
            "Reads of a chain's seals (a receipt's cross-check, a job view, a restore, the"
            " writer's start, checkpoints, close and foreign watch) that stopped at their cap of"
            " rows that do not verify, since start: someone with the runtime database role is"
            " inserting junk into chain_seals, and nothing that needed them was judged (receipts"
            " say incomplete, the writer retries; until the rows are removed)",
            registry=r,
        )
        self.ledger_seal_scans_capped.set_function(lambda: float(seal_scans_capped()))
        self.tier_bytes = Gauge(
            "kvgov_tier_bytes",
            "Bytes a tier holds against its own bound, by tier: the memory tier's buffers"
            " (live, pooled, reserved), the filesystem tier's files in whole blocks (with the"
            " puts being written)",
            ["tier"],
            registry=r,
        )
        self.tier_capacity = Gauge(
            "kvgov_tier_capacity_bytes",
            "A tier's bound (tiers.memory_max_bytes, tiers.filesystem_max_bytes), by tier",
            ["tier"],
            registry=r,
        )
        self.journal_unapplied = Gauge(
            "kvgov_ledger_journal_unapplied_events",
            "Events in the local ledger journal that the database does not hold yet",
            registry=r,
        )
        self.journal_bytes = Gauge(
            "kvgov_ledger_journal_bytes", "Bytes of local ledger journal segments", registry=r
        )
        self.journal_syncs = Gauge(
            "kvgov_ledger_journal_syncs",
            "Local ledger journal syncs (fdatasync) since start",
            registry=r,
        )
        self.journal_failures = Gauge(
            "kvgov_ledger_journal_failures",
            "Local ledger journal failures since start (1: set aside, puts wait for commits)",
            registry=r,
        )

    def count_op(self, op: str, listener: str, outcome: str) -> None:
        """``ops{op,listener,outcome} += 1``, with the labelled child looked up once (the
        client library's ``labels()`` costs several microseconds per call on the data path)."""
        self.op_counter(op, listener, outcome).inc()

    def op_counter(self, op: str, listener: str, outcome: str) -> Any:
        """The ``ops{op,listener,outcome}`` child, looked up once (a caller on the data path
        may keep it: :class:`~kvgov.proxy.dataplane.pipeline.Door`)."""
        key = (op, listener, outcome)
        child = self._op_children.get(key)
        if child is None:
            child = self._op_children[key] = self.ops.labels(op, listener, outcome)
        return child

    def latency_of(self, op: str) -> Any:
        """The ``latency{op}`` child, looked up once (``labels()`` costs several Python calls
        and a lock per frame otherwise)."""
        child = self._latency_children.get(op)
        if child is None:
            child = self._latency_children[op] = self.latency.labels(op)
        return child

    def watch(
        self,
        pool_in_use: Callable[[], float],
        ledger_depth: Callable[[], float],
        ledger_foreign: Callable[[], float] | None = None,
        ledger_seals: tuple[Callable[[], float], Callable[[], float]] | None = None,
    ) -> None:
        """Sample gauges at scrape time (``ledger_seals``: the writer's own seal keys found
        taken, and its seal failures)."""
        self.pool_bytes.set_function(pool_in_use)
        self.ledger_queue.set_function(ledger_depth)
        if ledger_foreign is not None:
            self.ledger_foreign.set_function(ledger_foreign)
        if ledger_seals is not None:
            self.ledger_seal_keys_taken.set_function(ledger_seals[0])
            self.ledger_seal_failures.set_function(ledger_seals[1])

    def watch_tiers(self, tiers: Iterable[Tier]) -> None:
        """Sample the bytes of each tier with a bound of its own at scrape time."""
        for tier in tiers:
            if not isinstance(tier, Measured) or tier.capacity_bytes is None:
                continue
            self.tier_bytes.labels(tier.name).set_function(_sampler(tier))
            self.tier_capacity.labels(tier.name).set(tier.capacity_bytes)

    def watch_journal(
        self,
        unapplied: Callable[[], float],
        nbytes: Callable[[], float],
        failures: Callable[[], float],
        syncs: Callable[[], float],
    ) -> None:
        """Sample the ledger journal's gauges at scrape time."""
        self.journal_unapplied.set_function(unapplied)
        self.journal_bytes.set_function(nbytes)
        self.journal_failures.set_function(failures)
        self.journal_syncs.set_function(syncs)


def _sampler(tier: Measured) -> Callable[[], float]:
    """``tier``'s bytes, for a gauge to sample (a closure per tier, not per loop variable)."""
    return lambda: float(tier.used_bytes)

"""Follow the policy's sources while the sidecar runs.

A running sidecar answers from the policies and data it loaded, and from its decision cache.
Without a reload, a change to ``policy.policy_dir`` or ``policy.data_file`` (an engine removed
from a tenant, a class made uncacheable: a Kubernetes ConfigMap updated in place) took effect
only at the next restart, and cached allows kept serving the old answer meanwhile. Every
``policy.reload_interval_s`` :func:`follow_sources` looks at the sources' files (their
identities and times: a few ``stat`` calls); when those changed it reads their revision in a
worker thread (the sidecar's ``load`` does not parse the Rego: that is the reload's work, and
regorus holds the GIL while it parses) and, when it changed, reloads the engine, which loads
and compiles them in a worker thread too, swaps in the new policies and drops every cached decision
(:meth:`~kvgov.policy.cache.CachingPolicyEngine.reload`). Sources that fail to load (invalid
Rego or data) are refused and logged once per distinct error; the policies in force keep
answering. Decisions recorded after a reload name the new revision.

With ``policy.engine = "opa"`` these files are only what kvgov reports as the revision: OPA
answers from its own bundle, which can change without them. There the cache bounds the age of
each decision instead (``policy.opa_decision_ttl_s``, :mod:`kvgov.policy.cache`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvgov.errors import PolicyError
from kvgov.follow import follow
from kvgov.logging import get_logger
from kvgov.policy.bundle import PolicyBundle, off_loop
from kvgov.policy.interfaces import PolicyEngine, PolicyRevision

log = get_logger(__name__)


async def follow_sources(
    engine: PolicyEngine,
    load: Callable[[], PolicyBundle],
    interval_s: float,
    stamp: Callable[[], object] | None = None,
) -> None:
    """Reload ``engine`` whenever the revision of what ``load`` reads changes (runs until
    cancelled); with ``stamp``, ``load`` runs only when what ``stamp`` returns changed
    (:func:`kvgov.follow.follow`)."""
    seen: list[PolicyRevision] = [engine.revision]

    async def apply() -> None:
        revision = (await off_loop(load)).revision
        if revision == seen[0]:
            return
        now = await engine.reload()  # loads again: it may fail where load did not
        log.info(
            "policy.sources_changed",
            extra={
                "policy_revision": now.policy,
                "data_revision": now.data,
                "previous_policy_revision": seen[0].policy,
                "previous_data_revision": seen[0].data,
            },
        )
        seen[0] = revision

    await follow(
        stamp if stamp is not None else object,  # no stamp: a new object, always "changed"
        apply,
        interval_s,
        log=log,
        event="policy.reload_refused",
        refused=PolicyError,
        level=logging.ERROR,
    )

"""``build_policy_engine(settings)``: the configured engine, validated, cached and recorded.

Engines by ``policy.engine``: ``embedded`` (regorus in process, the default), ``opa`` (an OPA
server over REST) and ``unsafe-allow-all`` (development only; Settings refuses it in
production). For the first two the policy directory and data file are loaded and checked here:
invalid Rego or data raises :class:`kvgov.errors.PolicyError` naming the file and line, and
startup stops. Every engine comes wrapped in :class:`CachingPolicyEngine`, which serves
:meth:`decide_cached` and applies the recording rule with the given recorder; for ``opa`` its
cached decisions expire after ``policy.opa_decision_ttl_s``.
"""

from __future__ import annotations

from functools import partial

from kvgov.config import Settings
from kvgov.policy.bundle import PolicyBundle, load_bundle, source_stamp
from kvgov.policy.cache import CachingPolicyEngine
from kvgov.policy.interfaces import DecisionRecorder, PolicyEngine
from kvgov.types import Environment


def load_configured_bundle(settings: Settings, *, check: bool = True) -> PolicyBundle:
    """Policies and data from ``policy.policy_dir`` / ``policy.data_file`` (or the shipped);
    ``check=False``: Rego not parsed (:func:`~kvgov.policy.bundle.load_bundle`)."""
    return load_bundle(
        settings.policy.policy_dir,
        settings.policy.data_file,
        check=check,
        shipped_data=settings.environment is Environment.DEVELOPMENT,
    )


def configured_source_stamp(settings: Settings) -> object:
    """:func:`~kvgov.policy.bundle.source_stamp` of the configured sources."""
    return source_stamp(settings.policy.policy_dir, settings.policy.data_file)


def build_inner_engine(settings: Settings) -> PolicyEngine:
    """The configured engine without cache or recording."""
    policy = settings.policy
    if policy.engine == "unsafe-allow-all":
        from kvgov.policy.allow_all import UnsafeAllowAll

        return UnsafeAllowAll(tuple(settings.tiers.chain))

    def loader() -> PolicyBundle:
        return load_configured_bundle(settings)

    bundle = loader()
    if policy.engine == "opa":
        from kvgov.policy.opa import OpaRestPolicyEngine
        from kvgov.policy.opa_token import OpaTokenFile

        path = policy.opa_token_file
        return OpaRestPolicyEngine(
            bundle,
            url=policy.opa_url,
            timeout_s=policy.opa_timeout_s,
            token=settings.opa_token if path is None else None,  # policy.opa_token
            # the file: read now (a refusal stops start-up), then followed (a rotated Secret)
            token_file=None
            if path is None
            else OpaTokenFile(
                path,
                partial(settings.read_opa_token_file, path),
                interval_s=policy.opa_token_reload_interval_s,
            ),
            loader=loader,
            opa_uids=policy.opa_uids,
        )
    from kvgov.policy.embedded import EmbeddedPolicyEngine

    return EmbeddedPolicyEngine(bundle, loader=loader)


def build_policy_engine(
    settings: Settings, *, recorder: DecisionRecorder | None = None
) -> CachingPolicyEngine:
    """The engine the sidecar uses. Raises PolicyError when the policies or data are invalid."""
    policy = settings.policy
    return CachingPolicyEngine(
        build_inner_engine(settings),
        recorder=recorder,
        max_entries=policy.cache_max_entries,
        vary_on_request_id=policy.cache_vary_on_request_id,
        # OPA answers from its own bundle, which the follower does not see change: bound the
        # age of what is cached. The embedded engine's cache is emptied by each reload.
        decision_ttl_s=policy.opa_decision_ttl_s if policy.engine == "opa" else None,
    )

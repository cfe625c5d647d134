"""``UnsafeAllowAll``: the do-nothing policy, for development and benchmarks only.

Selected with ``policy.engine = "unsafe-allow-all"``; :class:`kvgov.config.Settings` refuses it
in production. It still denies malformed input (that is not a policy question) and still goes
through the caching/recording wrapper, so its allows are on record under the revision
``unsafe-allow-all``.
"""

from __future__ import annotations

from kvgov.logging import get_logger
from kvgov.policy.interfaces import (
    Decision,
    PolicyInput,
    PolicyRevision,
    new_decision_id,
    safe_digest,
    validated_document,
)
from kvgov.types import Operation, Scope

log = get_logger(__name__)

REVISION = PolicyRevision(policy="unsafe-allow-all", data="unsafe-allow-all")


class UnsafeAllowAll:
    """Allows every well-formed operation in every configured tier, with no TTL cap."""

    def __init__(self, tiers: tuple[str, ...]) -> None:
        self.tiers = tiers
        log.warning("policy.unsafe_allow_all", extra={"tiers": list(tiers)})

    @property
    def revision(self) -> PolicyRevision:
        return REVISION

    def decide_cached(self, inp: PolicyInput) -> Decision | None:
        return None

    async def decide(self, inp: PolicyInput) -> Decision:
        operation = inp.operation if isinstance(inp.operation, str) else None
        digest = safe_digest(inp)
        doc, problems = validated_document(inp)
        if doc is None:
            return Decision.deny(
                *problems, revision=REVISION, input_digest=digest, operation=operation
            )
        governs_data = inp.operation != Operation.REMOVE
        return Decision(
            allowed=True,
            reasons=(),
            tiers=self.tiers,
            ttl_s=None,
            scope=(Scope.USER if inp.key_user else Scope.TENANT) if governs_data else None,
            policy_revision=REVISION.policy,
            data_revision=REVISION.data,
            decision_id=new_decision_id(),
            input_digest=digest,
            sensitivity=str(inp.sensitivity) if governs_data and inp.sensitivity else None,
            operation=operation,
        )

    async def reload(self) -> PolicyRevision:
        return REVISION

    async def aclose(self) -> None:
        return None

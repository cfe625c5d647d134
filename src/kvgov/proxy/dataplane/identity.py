"""Who an operation is for: the engine connection, the request context and the key's tags.

The key string carries ``tenant``/``user`` tags (set server-side by the gateway); the request
context may name the tenant and acting user too. They must agree: a context tenant or user that
differs from the key's tag is a denial, as is a key without a tenant (unless a default tenant is
configured for ``lm://``), or a tenant outside the identity's declared list (``lm://``). The
``lm://`` listener has no acting user: the policy then refuses every user-scoped key. User ids
are pseudonymised here, on arrival; nothing downstream sees a raw user id.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgov.db.models import TENANT
from kvgov.ledger.pseudonym import Pseudonymizer
from kvgov.policy.interfaces import Decision, EntryFacts, PolicyInput
from kvgov.proxy.dataplane.index import EntryMeta
from kvgov.types import Operation
from kvgov.wire.codec import WireError
from kvgov.wire.messages import CacheKey, RequestContext, parse_cache_key

#: the widest model name ``cache_entries.model`` holds
MODEL = 256


@dataclass(frozen=True, slots=True)
class Identity:
    """An authenticated engine connection."""

    engine: str
    #: what the ledger records as the principal, e.g. ``engine:vllm-0`` or ``lm:lm-demo``
    principal: str
    #: True for the ``lm://`` listener: no handshake, no request context, no acting user
    unattributed: bool = False
    #: the only tenants this identity may act for, checked before the policy (None: the
    #: policy alone decides; the ``lm://`` listener's declared ``dataplane.lm_tenants``)
    tenants: frozenset[str] | None = None

    @property
    def listener(self) -> str:
        """What the policy input calls the door this identity came through."""
        return "lm" if self.unattributed else "kvgov"


@dataclass(frozen=True, slots=True)
class Who:
    identity: Identity
    ctx: RequestContext
    key: CacheKey
    #: keyed digest of the cache key string: the tier key and the ledger's key digest
    digest: str
    tenant: str
    #: pseudonym of the acting user (the context's user, else the key's user tag)
    actor: str | None
    #: pseudonym of the key's ``user`` tag
    key_user: str | None


@dataclass(frozen=True, slots=True)
class Denied:
    reason: str
    identity: Identity
    ctx: RequestContext
    decision: Decision | None = None

    @property
    def metric_reason(self) -> str:
        """A bounded label for metrics: the reason up to its first ``:``, at most 40 chars."""
        return self.reason.split(":", 1)[0][:40]


def resolve(
    identity: Identity,
    raw_key: str,
    ctx: RequestContext,
    pseudonymizer: Pseudonymizer,
    default_tenant: str | None = None,
) -> tuple[Who | None, Denied | None]:
    try:
        key = parse_cache_key(raw_key)
    except WireError:
        return None, Denied("malformed_key", identity, ctx)
    # the default stands for untagged keys on lm:// alone (LMCache's keys carry no tenant);
    # an engine on the kvgov wire tags its keys, and an untagged one is nobody's
    tenant = key.tenant or (default_tenant if identity.unattributed else None)
    if not tenant:
        return None, Denied("no_tenant", identity, ctx)
    if len(tenant) > TENANT or len(key.model) > MODEL:
        # no tenant is named like that, and the ledger could not record it: a denial that
        # names no tenant is recorded instead of one the database would refuse (and lose)
        return None, Denied("malformed_key", identity, ctx)
    digest = pseudonymizer.key_digest(raw_key)
    raw_user = key.user  # (a property that walks the tags: read once)
    key_user = pseudonymizer.user(tenant, raw_user) if raw_user else None
    if identity.unattributed:  # nobody vouches for a user here: user-scoped data stays shut
        actor = None
    else:
        actor = pseudonymizer.user(tenant, ctx.user) if ctx.user else key_user
    who = Who(identity, ctx, key, digest, tenant, actor, key_user)
    if identity.tenants is not None and tenant not in identity.tenants:
        return who, Denied("tenant_not_served", identity, ctx)
    if ctx.tenant is not None and ctx.tenant != tenant:
        return who, Denied("tenant_mismatch", identity, ctx)
    if raw_user is not None and ctx.user is not None and ctx.user != raw_user:
        return who, Denied("user_mismatch", identity, ctx)
    return who, None


def build_input(who: Who, op: Operation, entry: EntryMeta | None) -> PolicyInput:
    return PolicyInput(
        operation=op,
        tenant=who.ctx.tenant or who.tenant,
        engine=who.identity.engine,
        listener=who.identity.listener,
        # the key's tag, or on lm:// the tenant the operator declared for untagged keys
        # (dataplane.lm_default_tenant): the tenant the key is stored and read under
        key_tenant=who.tenant,
        key_user=who.key_user,
        model=who.key.model,
        actor_user=who.actor,
        request_id=who.ctx.request_id,
        sensitivity=who.ctx.sensitivity,
        entry=None
        if entry is None
        else EntryFacts(
            owner=entry.owner, scope_user=entry.scope_user, sensitivity=entry.sensitivity
        ),
    )

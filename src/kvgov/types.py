"""kvgov's vocabulary, as ``StrEnum``s.

The same strings appear in policy input, ledger rows, API filters and CLI output, so a value
written in one place can be searched for in every other.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum


class Environment(StrEnum):
    DEVELOPMENT = "development"
    PRODUCTION = "production"


class Operation(StrEnum):
    """A KV operation an engine asks for."""

    EXISTS = "exists"
    GET = "get"
    PUT = "put"
    REMOVE = "remove"


class Sensitivity(StrEnum):
    """Sensitivity classes and labels a request can carry."""

    PUBLIC = "public"
    INTERNAL = "internal"
    CONFIDENTIAL = "confidential"
    RESTRICTED = "restricted"
    PHI = "phi"
    PCI = "pci"


class EventKind(StrEnum):
    """Every kind of event the ledger records."""

    # data plane
    KV_PUT = "kv:put"
    #: a put of a key that is live (or being stored): acknowledged, nothing rewritten
    KV_PUT_KEPT = "kv:put:kept"
    KV_GET = "kv:get"  # a hit that served bytes: the provenance edge
    KV_MISS = "kv:miss"
    KV_EXISTS = "kv:exists"
    KV_DENIED = "kv:entry:denied"
    KV_EVICT = "kv:evict"
    KV_DELETE = "kv:delete"
    KV_EXPIRED = "kv:expired"
    # policy
    POLICY_DECISION = "policy:decision"
    # keys
    KEY_CREATED = "key:created"
    KEY_ROTATED = "key:rotated"
    #: ``kvgov keys shred`` chains this per live version *before* it destroys anything; only
    #: a ``key:shredded`` with outcome ``ok`` says a version is gone (``error``: it may not be)
    KEY_SHRED_REQUESTED = "key:shred:requested"
    KEY_SHREDDED = "key:shredded"
    # right to be forgotten
    PURGE_REQUESTED = "purge:requested"
    PURGE_STEP = "purge:step"
    #: an engine a purge's ``engines@S`` step could not reach acknowledged its EVICT later
    PURGE_EVICT_LATE = "purge:evict:late"
    USER_DATA_PURGED = "user:data:purged"
    TENANT_DATA_PURGED = "tenant:data:purged"
    LEDGER_PAYLOAD_ERASED = "ledger:payload:erased"
    # control plane
    API_ACCESS = "api:access"
    TOKEN_CREATED = "token:created"  # noqa: S105 - an event name, not a secret
    TOKEN_REVOKED = "token:revoked"  # noqa: S105 - an event name, not a secret
    TENANT_RETENTION_SET = "tenant:retention:set"
    ENGINE_CONNECTED = "engine:connected"
    ENGINE_REJECTED = "engine:rejected"
    SIDECAR_STARTED = "sidecar:started"
    SIDECAR_STOPPED = "sidecar:stopped"


class Outcome(StrEnum):
    ALLOW = "allow"
    DENY = "deny"
    HIT = "hit"
    MISS = "miss"
    OK = "ok"
    ERROR = "error"


class EntryState(StrEnum):
    LIVE = "live"
    EXPIRED = "expired"
    DELETED = "deleted"
    PURGED = "purged"


class Scope(StrEnum):
    """Who may read an entry: every user of the tenant, or only the user it is scoped to."""

    TENANT = "tenant"
    USER = "user"


class Role(StrEnum):
    AUDITOR = "auditor"
    ADMIN = "admin"
    ENGINE = "engine"


class PurgeState(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    COMPLETED = "completed"
    INCOMPLETE = "incomplete"
    FAILED = "failed"


class PurgeKind(StrEnum):
    """What a purge job erases: one user's data in a tenant, or a whole tenant."""

    USER = "user"
    TENANT = "tenant"


class TenantState(StrEnum):
    ENABLED = "enabled"
    DISABLED = "disabled"


class KeyState(StrEnum):
    """Life of a data key version."""

    ACTIVE = "active"  # newest version of its key: new writes use it
    RETIRED = "retired"  # still opens old data, never seals new data
    DESTROYED = "destroyed"  # crypto-shredded: the wrapped key bytes are gone


@dataclass(frozen=True, slots=True)
class WrappedKey:
    """One version of a data key (DEK) as stored: wrapped by the KEK, never in plaintext.

    Shared by ``kvgov.keys`` (which wraps and unwraps) and ``kvgov.ledger`` (which stores the
    rows), so neither has to import the other.
    """

    key_id: str  # stable per (tenant, user scope): e.g. "t:<tenant>" or "u:<tenant>:<pseudonym>"
    version: int
    tenant: str
    #: pseudonym of the user for user-scoped keys; None for the tenant key
    user: str | None
    state: KeyState
    #: the DEK wrapped by the KEK (None once destroyed)
    wrapped: bytes | None
    kek_id: str
    created_at: datetime
    usage_count: int = 0
    destroyed_at: datetime | None = None

"""Response bodies of the ``/v1`` compliance API, each with an OpenAPI example.

Users appear only as pseudonyms (keyed HMAC, the ledger's own); cache keys only as digests.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from kvgov.db.models import TENANT
from kvgov.db.tenants import TENANT_ID
from kvgov.types import EntryState, Role, Scope, Sensitivity

_PSEUDO = "3f9c2a51b0d84e6f9a7c11d2e8b45a90"
_DIGEST = "9b74c9897bac770ffc029102a200c5de3f1a8c1e0e0a7a3f0f3e6a1c8d2b4e55"
_T0 = "2026-11-21T10:15:02.113000Z"


def _example(example: dict[str, Any]) -> ConfigDict:
    return ConfigDict(json_schema_extra={"examples": [example]})


class Entry(BaseModel):
    """One cached chunk as the ledger indexes it."""

    model_config = _example(
        {
            "key_digest": _DIGEST,
            "tenant": "acme",
            "owner": _PSEUDO,
            "scope": "user",
            "scope_user": _PSEUDO,
            "sensitivity": "confidential",
            "model": "meta-llama/Llama-3.1-8B-Instruct",
            "size": 4194304,
            "tiers": ["memory", "filesystem"],
            "key_id": "u:acme:" + _PSEUDO,
            "key_version": 1,
            "state": "live",
            "created_at": _T0,
            "updated_at": _T0,
            "expires_at": "2026-11-21T11:15:02.113000Z",
            "created_request_id": "req-7f3a",
            "decision_id": "d-1c9e",
            "policy_revision": "bundle-2026.11.20",
        }
    )

    key_digest: str = Field(description="keyed digest of the cache key (never the key itself)")
    tenant: str | None
    owner: str | None = Field(description="pseudonym of the user whose request created it")
    scope: Scope | None
    scope_user: str | None = Field(description="pseudonym of the user it is scoped to")
    sensitivity: Sensitivity | None
    model: str | None
    size: int | None = Field(description="plaintext bytes")
    tiers: list[str]
    key_id: str | None
    key_version: int | None
    state: EntryState
    created_at: datetime
    updated_at: datetime
    expires_at: datetime | None
    created_request_id: str | None
    decision_id: str | None
    policy_revision: str | None


class FootprintEntry(Entry):
    reused_by: list[str] = Field(description="request ids this chunk was served to")


class Footprint(BaseModel):
    """What is cached for one user, where, until when, and which requests reused it."""

    model_config = _example(
        {
            "tenant": "acme",
            "user": _PSEUDO,
            "entries_by_state": {"live": 3, "purged": 1},
            "live_bytes_by_tier": {"memory": 12582912, "filesystem": 12582912},
            "live_until": "2026-11-21T11:15:02.113000Z",
            "requests_served": 5,
            "items": [],
            "limit": 50,
            "next": None,
        }
    )

    tenant: str
    user: str = Field(description="the user's pseudonym (the raw id is never returned)")
    entries_by_state: dict[str, int]
    live_bytes_by_tier: dict[str, int]
    live_until: datetime | None = Field(description="latest expiry among live entries")
    requests_served: int = Field(description="distinct requests the user's chunks fed")
    items: list[FootprintEntry]
    limit: int
    next: str | None


class Decision(BaseModel):
    """A recorded policy decision."""

    model_config = _example(
        {
            "decision_id": "d-77aa",
            "tenant": "acme",
            "operation": "put",
            "outcome": "deny",
            "reasons": ["sensitivity_not_cacheable"],
            "tiers": [],
            "ttl_s": None,
            "scope": None,
            "policy_revision": "bundle-2026.11.20",
            "data_revision": "data-17",
            "input_digest": _DIGEST,
            "first_seen_at": _T0,
            "chain_id": "node-a",
            "seq": 1001,
        }
    )

    decision_id: str
    tenant: str | None
    operation: str | None
    outcome: str = Field(description="allow or deny")
    reasons: list[str]
    tiers: list[str]
    ttl_s: int | None
    scope: str | None
    policy_revision: str | None
    data_revision: str | None
    input_digest: str | None
    first_seen_at: datetime
    chain_id: str | None
    seq: int | None


class CheckpointOut(BaseModel):
    """A signed chain head."""

    model_config = _example(
        {
            "chain_id": "node-a",
            "seq": 20000,
            "head_hash": _DIGEST,
            "signed_at": _T0,
            "signature": "k3Jx...base64...",
            "public_key": "MCowBQYDK2VwAyEA...base64...",
        }
    )

    chain_id: str
    seq: int
    head_hash: str
    signed_at: datetime
    signature: str = Field(description="Ed25519 signature, base64")
    public_key: str = Field(description="raw Ed25519 public key, base64")


_STATS_EXAMPLE: dict[str, Any] = {
    "tenant": "acme",
    "entries": 120,
    "entries_by_state": {"live": 120, "expired": 8},
    "live_bytes_by_tier": {"memory": 503316480, "filesystem": 503316480},
    "puts": 128,
    "hits": 300,
    "misses": 100,
    "hit_rate": 0.75,
    "denials": 4,
}


class TenantStatsOut(BaseModel):
    """Per-tenant numbers: entries now, bytes per tier now, and event counts."""

    model_config = _example(_STATS_EXAMPLE)

    tenant: str
    entries: int = Field(description="live entries")
    entries_by_state: dict[str, int]
    live_bytes_by_tier: dict[str, int]
    puts: int
    hits: int
    misses: int
    hit_rate: float | None = Field(description="hits / (hits + misses); null with no lookups")
    denials: int


class StatsOut(BaseModel):
    model_config = _example({"tenants": [_STATS_EXAMPLE]})

    tenants: list[TenantStatsOut]


class ChainReport(BaseModel):
    chain_id: str
    ok: bool
    events: int
    head_seq: int
    head_hash: str
    checkpoints: int
    last_checkpoint_seq: int | None
    problem: str | None = Field(
        description="what the first bad position shows: modified, deleted, inserted, "
        "reordered, broken_link, bad_signature, checkpoint_mismatch... (null when ok)"
    )
    position: int | None = Field(description="first bad sequence number (null when ok)")
    detail: str | None
    findings: int = Field(description="number of problems found in this chain")
    unsigned_events: int = Field(
        default=0, description="events after the last verified checkpoint (not yet signed)"
    )


class VerifyOut(BaseModel):
    """The ledger's hash chains and checkpoint signatures, recomputed now."""

    model_config = _example(
        {
            "ok": True,
            "verified_at": _T0,
            "chains": [
                {
                    "chain_id": "node-a",
                    "ok": True,
                    "events": 20000,
                    "head_seq": 20000,
                    "head_hash": _DIGEST,
                    "checkpoints": 3,
                    "last_checkpoint_seq": 20000,
                    "problem": None,
                    "position": None,
                    "detail": None,
                    "findings": 0,
                    "unsigned_events": 0,
                }
            ],
            "problems": [],
            "trusted_keys": ["3f2a9c41d0e7b815"],
        }
    )

    ok: bool
    verified_at: datetime
    chains: list[ChainReport]
    problems: list[str] = Field(
        default_factory=list,
        description="problems of the ledger as a whole (it holds no chain but was used)",
    )
    trusted_keys: list[str] = Field(
        default_factory=list, description="fingerprints of the keys chains were checked against"
    )


class TokenOut(BaseModel):
    model_config = _example(
        {
            "id": "5b0c8a8e-1f0e-4f55-9d73-2d7f9a3b8c11",
            "name": "compliance-dashboard",
            "role": "auditor",
            "tenant": "acme",
            "created_at": _T0,
            "revoked_at": None,
            "last_used_at": None,
        }
    )

    id: str
    name: str
    role: Role
    tenant: str | None
    created_at: datetime
    revoked_at: datetime | None
    last_used_at: datetime | None


class TokenCreated(TokenOut):
    token: str = Field(description="the bearer token: shown once, never stored")


class TokenCreate(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{"role": "auditor", "tenant": "acme", "name": "dash"}]},
    )

    role: Role
    #: a tenant id, as every other tenant input (null: every tenant; never "" for that)
    tenant: str | None = Field(
        default=None, min_length=1, max_length=TENANT, pattern=TENANT_ID.pattern
    )
    name: str = Field(default="", max_length=128)

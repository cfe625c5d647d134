"""The ledger's tables as SQLAlchemy 2 typed models.

Two kinds of table live here:

* the **append-only** ones, guarded by database triggers (migrations 0002 and 0006):
  ``ledger_events`` (the hash-chained log, one chain per writer), ``checkpoints`` (signed chain
  heads), ``chains`` (each chain's public key), ``chain_seals`` (each chain's signed genesis
  and its writer sessions' opens and closes) and ``key_pins`` (the fleet's pseudonym key id);
* **mutable indexes and state** that the chained log explains: tenants, user references,
  requests, the cache-entry index, policy decisions, data keys, purge jobs and their steps and
  receipts, sidecars and API tokens.

Nothing personal is chained: user columns hold keyed-HMAC pseudonyms, cache keys are keyed
digests, and erasable details live in ``event_payloads`` whose salted digest alone is chained.
Every timestamp is a timezone-aware UTC :class:`~kvgov.db.engine.UTCDateTime`.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, cast

from sqlalchemy import (
    BigInteger,
    Boolean,
    ForeignKey,
    ForeignKeyConstraint,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    SmallInteger,
    String,
    Table,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from kvgov.db.engine import ExactJSON, JSONType, StrEnumType, UTCDateTime
from kvgov.db.purge_index import PURGE_ID_INDEX, is_purge_step, purge_id_of
from kvgov.db.token_index import TOKEN_ID_INDEX, is_token_event, token_id_of
from kvgov.types import (
    EntryState,
    KeyState,
    PurgeKind,
    PurgeState,
    Role,
    Scope,
    Sensitivity,
    TenantState,
)

#: constraint names are stable, so migrations can refer to them on every backend
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# column widths shared by several tables
TENANT = 128
PSEUDONYM = 64  # hex HMAC-SHA256 truncated (see kvgov.ledger.pseudonym)
DIGEST = 64  # hex SHA-256
CHAIN_ID = 255
REQUEST_ID = 128
DECISION_ID = 128
REVISION = 128


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {datetime: UTCDateTime(), dict[str, Any]: JSONType}


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(TENANT), primary_key=True)
    display_name: Mapped[str | None] = mapped_column(String(256))
    state: Mapped[TenantState] = mapped_column(
        StrEnumType(TenantState, 16), default=TenantState.ENABLED
    )
    #: default retention of this tenant's entries in seconds (None: policy decides)
    retention_s: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime]


class UserRef(Base):
    """A user seen by kvgov, by pseudonym only (keyed HMAC of tenant + user id)."""

    __tablename__ = "user_refs"

    pseudonym: Mapped[str] = mapped_column(String(PSEUDONYM), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(TENANT), index=True)
    created_at: Mapped[datetime]
    erased_at: Mapped[datetime | None]


class Request(Base):
    """An inference request seen on the data plane (the provenance join key). Request ids come
    from the engines and two tenants may use the same one: a request is an id *in a tenant*
    (``''`` when the request carried no tenant; migration 0004)."""

    __tablename__ = "requests"

    request_id: Mapped[str] = mapped_column(String(REQUEST_ID), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(TENANT), primary_key=True, index=True, default="")
    actor: Mapped[str | None] = mapped_column(String(PSEUDONYM), index=True)
    principal: Mapped[str | None] = mapped_column(String(256))
    first_seen_at: Mapped[datetime]
    last_seen_at: Mapped[datetime]


class CacheEntry(Base):
    """The mutable index of cached chunks: where each one lives and in what state."""

    __tablename__ = "cache_entries"
    __table_args__ = (
        Index("ix_cache_entries_tenant_state", "tenant", "state"),
        Index("ix_cache_entries_state_expires_at", "state", "expires_at"),
    )

    key_digest: Mapped[str] = mapped_column(String(DIGEST), primary_key=True)
    tenant: Mapped[str | None] = mapped_column(String(TENANT))
    owner: Mapped[str | None] = mapped_column(String(PSEUDONYM), index=True)
    scope_user: Mapped[str | None] = mapped_column(String(PSEUDONYM), index=True)
    scope: Mapped[Scope | None] = mapped_column(StrEnumType(Scope, 16))
    sensitivity: Mapped[Sensitivity | None] = mapped_column(StrEnumType(Sensitivity, 32))
    model: Mapped[str | None] = mapped_column(String(256))
    size: Mapped[int | None] = mapped_column(BigInteger)
    tiers: Mapped[list[str]] = mapped_column(JSONType, default=list)
    key_id: Mapped[str | None] = mapped_column(String(256))
    key_version: Mapped[int | None] = mapped_column(Integer)
    expires_at: Mapped[datetime | None]
    state: Mapped[EntryState] = mapped_column(StrEnumType(EntryState, 16))
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]
    created_request_id: Mapped[str | None] = mapped_column(String(REQUEST_ID))
    decision_id: Mapped[str | None] = mapped_column(String(DECISION_ID))
    policy_revision: Mapped[str | None] = mapped_column(String(REVISION))
    chain_id: Mapped[str | None] = mapped_column(String(CHAIN_ID))


class Chain(Base):
    """One hash chain, written by one writer instance; its Ed25519 key signs its checkpoints."""

    __tablename__ = "chains"

    chain_id: Mapped[str] = mapped_column(String(CHAIN_ID), primary_key=True)
    #: raw 32-byte Ed25519 public key
    public_key: Mapped[bytes] = mapped_column(LargeBinary)
    created_at: Mapped[datetime]
    description: Mapped[str | None] = mapped_column(Text)


class JournalMark(Base):
    """How far a sidecar's local ledger journal (:mod:`kvgov.ledger.journal`) has reached its
    chain: every journal record up to ``applied_upto`` is in ``ledger_events``. Moved by the
    batch that commits those records, in the same transaction (migration 0003)."""

    __tablename__ = "ledger_journal_marks"

    chain_id: Mapped[str] = mapped_column(
        String(CHAIN_ID), ForeignKey("chains.chain_id"), primary_key=True
    )
    applied_upto: Mapped[int] = mapped_column(BigInteger)


class LedgerEvent(Base):
    """The chained, append-only log. Every column but ``hash`` is covered by ``hash``.

    ``hash`` and ``prev_hash`` (like ``checkpoints.head_hash`` and ``chain_seals.head_hash``)
    hold 64 lowercase hex characters: migration 0014's triggers refuse anything else (like the
    triggers of 0002 and 0011, they live in the migration only)."""

    __tablename__ = "ledger_events"
    __table_args__ = (
        Index("ix_ledger_events_tenant_kind", "tenant", "kind"),
        Index("ix_ledger_events_request_id", "request_id"),
        Index("ix_ledger_events_key_digest", "key_digest"),
        Index("ix_ledger_events_actor", "actor"),
    )

    chain_id: Mapped[str] = mapped_column(
        String(CHAIN_ID), ForeignKey("chains.chain_id"), primary_key=True
    )
    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    prev_hash: Mapped[str] = mapped_column(String(DIGEST))
    hash: Mapped[str] = mapped_column(String(DIGEST))
    encoding_version: Mapped[int] = mapped_column(SmallInteger)
    occurred_at: Mapped[datetime]
    kind: Mapped[str] = mapped_column(String(64))
    tenant: Mapped[str | None] = mapped_column(String(TENANT))
    actor: Mapped[str | None] = mapped_column(String(PSEUDONYM))
    request_id: Mapped[str | None] = mapped_column(String(REQUEST_ID))
    key_digest: Mapped[str | None] = mapped_column(String(DIGEST))
    tier: Mapped[str | None] = mapped_column(String(64))
    nbytes: Mapped[int | None] = mapped_column(BigInteger)
    outcome: Mapped[str | None] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(Text)
    decision_id: Mapped[str | None] = mapped_column(String(DECISION_ID))
    policy_revision: Mapped[str | None] = mapped_column(String(REVISION))
    principal: Mapped[str | None] = mapped_column(String(256))
    #: plain JSON (not JSONB) so the stored text round-trips to the exact values that were hashed
    attrs: Mapped[dict[str, Any]] = mapped_column(ExactJSON)
    #: hex SHA-256(salt || canonical(payload)) of the erasable payload, if any
    payload_digest: Mapped[str | None] = mapped_column(String(DIGEST))


# one purge's step events, for its receipt's cross-check (kvgov.db.purge_index, migration 0009)
Index(
    PURGE_ID_INDEX,
    purge_id_of(LedgerEvent.__table__.c.attrs),
    postgresql_where=is_purge_step(LedgerEvent.__table__.c.kind),
    sqlite_where=is_purge_step(LedgerEvent.__table__.c.kind),
)
# one API token's creation and revocation events, for the API's check of its row
# (kvgov.db.token_index, migration 0015)
Index(
    TOKEN_ID_INDEX,
    token_id_of(LedgerEvent.__table__.c.attrs),
    postgresql_where=is_token_event(LedgerEvent.__table__.c.kind),
    sqlite_where=is_token_event(LedgerEvent.__table__.c.kind),
)


class EventPayload(Base):
    """Erasable details of an event, outside the chain. Erasure nulls ``payload`` and ``salt``."""

    __tablename__ = "event_payloads"
    __table_args__ = (
        ForeignKeyConstraint(
            ["chain_id", "seq"],
            ["ledger_events.chain_id", "ledger_events.seq"],
            name="fk_event_payloads_event",
        ),
    )

    chain_id: Mapped[str] = mapped_column(String(CHAIN_ID), primary_key=True)
    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    #: random salt of ``payload_digest``; dropped with the payload on erasure, so a guess at the
    #: erased payload can no longer be confirmed against the chained digest
    salt: Mapped[bytes | None] = mapped_column(LargeBinary)
    #: plain JSON, like ``ledger_events.attrs``, so ``audit verify`` can re-check the digest
    payload: Mapped[dict[str, Any] | None] = mapped_column(ExactJSON)
    erased_at: Mapped[datetime | None]


class Checkpoint(Base):
    """A signed chain head (append-only). Keyed ``(chain_id, seq, nonce)`` (migration 0013): the
    runtime role may INSERT here, and a key computable from the head it reads was taken first
    by a junk row, which then stood in for the honest checkpoint (:mod:`kvgov.ledger.checkpoint`).
    """

    __tablename__ = "checkpoints"

    chain_id: Mapped[str] = mapped_column(
        String(CHAIN_ID), ForeignKey("chains.chain_id"), primary_key=True
    )
    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    #: the key's random part: ``''`` (the plain key; every row written before 0013, and by a
    #: build without it) unless that key was taken, then 8 random hex characters. Not signed: a
    #: checkpoint's note says all it means, so a copy under another nonce says the same
    #: (the default as SQL text: SQLite reflects an empty string so, and `alembic check` compares)
    nonce: Mapped[str] = mapped_column(String(16), primary_key=True, server_default=text("''"))
    head_hash: Mapped[str] = mapped_column(String(DIGEST))
    signed_at: Mapped[datetime]
    #: raw 64-byte Ed25519 signature over the checkpoint note (see kvgov.ledger.chain)
    signature: Mapped[bytes] = mapped_column(LargeBinary)
    #: raw 32-byte Ed25519 public key that made the signature
    public_key: Mapped[bytes] = mapped_column(LargeBinary)


class ChainSeal(Base):
    """A signed statement of a chain's life (append-only, migration 0006): its genesis (the
    writer vouches for the ``chains`` row) and each writer session's open and close (see
    :mod:`kvgov.ledger.seals`)."""

    __tablename__ = "chain_seals"

    chain_id: Mapped[str] = mapped_column(
        String(CHAIN_ID), ForeignKey("chains.chain_id"), primary_key=True
    )
    #: ``genesis``, ``open`` or ``close``
    kind: Mapped[str] = mapped_column(String(16), primary_key=True)
    #: the writer session's random id (``''`` for the genesis)
    session: Mapped[str] = mapped_column(String(64), primary_key=True)
    #: the head the statement is about (0 for the genesis)
    seq: Mapped[int] = mapped_column(BigInteger)
    head_hash: Mapped[str] = mapped_column(String(DIGEST))
    #: an open by a writer holding the chain alone: every earlier session is over
    exclusive: Mapped[bool] = mapped_column(Boolean)
    signed_at: Mapped[datetime]
    #: raw 64-byte Ed25519 signature over the seal's note (see kvgov.ledger.seals)
    signature: Mapped[bytes] = mapped_column(LargeBinary)
    #: raw 32-byte Ed25519 public key that made the signature
    public_key: Mapped[bytes] = mapped_column(LargeBinary)


class KeyPin(Base):
    """The id of a key the whole fleet must share, recorded once (append-only, migration 0008):
    ``name`` ``pseudonym`` holds :attr:`kvgov.ledger.pseudonym.Pseudonymizer.key_id`
    (:mod:`kvgov.ledger.keypin`)."""

    __tablename__ = "key_pins"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    fingerprint: Mapped[str] = mapped_column(String(DIGEST))
    pinned_at: Mapped[datetime]


class PolicyDecision(Base):
    __tablename__ = "policy_decisions"
    __table_args__ = (Index("ix_policy_decisions_tenant_first_seen_at", "tenant", "first_seen_at"),)

    decision_id: Mapped[str] = mapped_column(String(DECISION_ID), primary_key=True)
    policy_revision: Mapped[str | None] = mapped_column(String(REVISION))
    data_revision: Mapped[str | None] = mapped_column(String(REVISION))
    input_digest: Mapped[str | None] = mapped_column(String(DIGEST), index=True)
    allowed: Mapped[bool] = mapped_column(Boolean)
    reasons: Mapped[list[str]] = mapped_column(JSONType, default=list)
    tiers: Mapped[list[str]] = mapped_column(JSONType, default=list)
    ttl_s: Mapped[int | None] = mapped_column(Integer)
    scope: Mapped[str | None] = mapped_column(String(16))
    tenant: Mapped[str | None] = mapped_column(String(TENANT))
    operation: Mapped[str | None] = mapped_column(String(16))
    first_seen_at: Mapped[datetime]
    chain_id: Mapped[str | None] = mapped_column(String(CHAIN_ID))
    seq: Mapped[int | None] = mapped_column(BigInteger)


class DataKey(Base):
    """One version of a data key, wrapped by the KEK (``wrapped`` is None once destroyed)."""

    __tablename__ = "data_keys"
    __table_args__ = (Index("ix_data_keys_tenant_user", "tenant", "user"),)

    key_id: Mapped[str] = mapped_column(String(256), primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    tenant: Mapped[str] = mapped_column(String(TENANT))
    user: Mapped[str | None] = mapped_column(String(PSEUDONYM))
    state: Mapped[KeyState] = mapped_column(StrEnumType(KeyState, 16))
    wrapped: Mapped[bytes | None] = mapped_column(LargeBinary)
    kek_id: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[datetime]
    usage_count: Mapped[int] = mapped_column(BigInteger, default=0)
    destroyed_at: Mapped[datetime | None]


class PurgeJob(Base):
    __tablename__ = "purge_jobs"
    __table_args__ = (Index("ix_purge_jobs_tenant_subject", "tenant", "subject"),)

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    kind: Mapped[PurgeKind] = mapped_column(StrEnumType(PurgeKind, 16))
    tenant: Mapped[str] = mapped_column(String(TENANT))
    #: pseudonym of the user being erased (None for a tenant purge)
    subject: Mapped[str | None] = mapped_column(String(PSEUDONYM))
    state: Mapped[PurgeState] = mapped_column(StrEnumType(PurgeState, 16), index=True)
    dry_run: Mapped[bool] = mapped_column(Boolean, default=False)
    requested_by: Mapped[str | None] = mapped_column(String(256))
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]
    finished_at: Mapped[datetime | None]
    result: Mapped[dict[str, Any] | None] = mapped_column(JSONType)


class PurgeStep(Base):
    __tablename__ = "purge_steps"
    __table_args__ = (
        UniqueConstraint("job_id", "name", "sidecar_id", postgresql_nulls_not_distinct=True),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(String(36), ForeignKey("purge_jobs.id"), index=True)
    name: Mapped[str] = mapped_column(String(128))
    sidecar_id: Mapped[str | None] = mapped_column(String(CHAIN_ID))
    state: Mapped[PurgeState] = mapped_column(StrEnumType(PurgeState, 16))
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    detail: Mapped[dict[str, Any] | None] = mapped_column(JSONType)
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]


class PurgeReceipt(Base):
    __tablename__ = "purge_receipts"

    job_id: Mapped[str] = mapped_column(String(36), ForeignKey("purge_jobs.id"), primary_key=True)
    receipt: Mapped[dict[str, Any]] = mapped_column(JSONType)
    #: raw Ed25519 signature over the canonical receipt
    signature: Mapped[bytes] = mapped_column(LargeBinary)
    created_at: Mapped[datetime]


class Sidecar(Base):
    """A running sidecar, registered so purges can fan out to it."""

    __tablename__ = "sidecars"

    id: Mapped[str] = mapped_column(String(CHAIN_ID), primary_key=True)
    chain_id: Mapped[str | None] = mapped_column(String(CHAIN_ID))
    data_endpoint: Mapped[str | None] = mapped_column(String(512))
    started_at: Mapped[datetime]
    last_seen_at: Mapped[datetime]


class ApiToken(Base):
    """A control-plane bearer token; only a hash of the token is stored.

    Once written, a row changes only by being revoked (``revoked_at``, once) and by its last
    use being stamped: migration 0015's trigger refuses the rest (it lives in the migration
    only). The API also checks the row against its chained token events (:mod:`kvgov.db.
    tokens`)."""

    __tablename__ = "api_tokens"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    name: Mapped[str] = mapped_column(String(128))
    token_hash: Mapped[str] = mapped_column(String(128), unique=True)
    role: Mapped[Role] = mapped_column(StrEnumType(Role, 16))
    #: tenant the token is limited to (None: every tenant)
    tenant: Mapped[str | None] = mapped_column(String(TENANT))
    created_at: Mapped[datetime]
    revoked_at: Mapped[datetime | None]
    last_used_at: Mapped[datetime | None]


class DashboardSession(Base):
    """A signed-in ``/dashboard`` session (migration 0005). Only the SHA-256 of its random id is
    stored; sign-out deletes the row, so the cookie of a signed-out session opens nothing."""

    __tablename__ = "dashboard_sessions"

    id_hash: Mapped[str] = mapped_column(String(DIGEST), primary_key=True)
    token_id: Mapped[str] = mapped_column(String(36), index=True)
    created_at: Mapped[datetime]
    expires_at: Mapped[datetime] = mapped_column(index=True)


def table(model: type[Base]) -> Table:
    """The Core ``Table`` of a model (typed, for bulk statements)."""
    return cast("Table", model.__table__)


#: the tables whose rows may never change once written (guarded by triggers, migration 0002)
APPEND_ONLY_TABLES = ("ledger_events", "checkpoints", "chains", "chain_seals")

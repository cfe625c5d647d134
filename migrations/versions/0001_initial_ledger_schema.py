"""Initial ledger schema: every table the ledger, policy, keys, data plane, purge and API use.

Written once, reviewed, never edited after release; later changes are new revisions.

Revision ID: 0001
Revises:
Create Date: 2026-11-21 10:02:50.009386
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

#: JSONB on Postgres, JSON text elsewhere (kvgov.ledger.db.JSONType)
JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "api_tokens",
        sa.Column("id", sa.String(length=36), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("token_hash", sa.String(length=128), nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("tenant", sa.String(length=128), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_tokens")),
        sa.UniqueConstraint("token_hash", name=op.f("uq_api_tokens_token_hash")),
    )
    op.create_table(
        "cache_entries",
        sa.Column("key_digest", sa.String(length=64), nullable=False),
        sa.Column("tenant", sa.String(length=128), nullable=True),
        sa.Column("owner", sa.String(length=64), nullable=True),
        sa.Column("scope_user", sa.String(length=64), nullable=True),
        sa.Column("scope", sa.String(length=16), nullable=True),
        sa.Column("sensitivity", sa.String(length=32), nullable=True),
        sa.Column("model", sa.String(length=256), nullable=True),
        sa.Column("size", sa.BigInteger(), nullable=True),
        sa.Column("tiers", JSON, nullable=False),
        sa.Column("key_id", sa.String(length=256), nullable=True),
        sa.Column("key_version", sa.Integer(), nullable=True),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_request_id", sa.String(length=128), nullable=True),
        sa.Column("decision_id", sa.String(length=128), nullable=True),
        sa.Column("policy_revision", sa.String(length=128), nullable=True),
        sa.Column("chain_id", sa.String(length=255), nullable=True),
        sa.PrimaryKeyConstraint("key_digest", name=op.f("pk_cache_entries")),
    )
    with op.batch_alter_table("cache_entries", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_cache_entries_owner"), ["owner"], unique=False)
        batch_op.create_index(
            batch_op.f("ix_cache_entries_scope_user"), ["scope_user"], unique=False
        )
        batch_op.create_index(
            "ix_cache_entries_state_expires_at", ["state", "expires_at"], unique=False
        )
        batch_op.create_index("ix_cache_entries_tenant_state", ["tenant", "state"], unique=False)

    op.create_table(
        "chains",
        sa.Column("chain_id", sa.String(length=255), nullable=False),
        sa.Column("public_key", sa.LargeBinary(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("description", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("chain_id", name=op.f("pk_chains")),
    )
    op.create_table(
        "data_keys",
        sa.Column("key_id", sa.String(length=256), nullable=False),
        sa.Column("version", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("tenant", sa.String(length=128), nullable=False),
        sa.Column("user", sa.String(length=64), nullable=True),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("wrapped", sa.LargeBinary(), nullable=True),
        sa.Column("kek_id", sa.String(length=128), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("usage_count", sa.BigInteger(), nullable=False),
        sa.Column("destroyed_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("key_id", "version", name=op.f("pk_data_keys")),
    )
    with op.batch_alter_table("data_keys", schema=None) as batch_op:
        batch_op.create_index("ix_data_keys_tenant_user", ["tenant", "user"], unique=False)

    op.create_table(
        "policy_decisions",
        sa.Column("decision_id", sa.String(length=128), nullable=False),
        sa.Column("policy_revision", sa.String(length=128), nullable=True),
        sa.Column("data_revision", sa.String(length=128), nullable=True),
        sa.Column("input_digest", sa.String(length=64), nullable=True),
        sa.Column("allowed", sa.Boolean(), nullable=False),
        sa.Column("reasons", JSON, nullable=False),
        sa.Column("tiers", JSON, nullable=False),
        sa.Column("ttl_s", sa.Integer(), nullable=True),
        sa.Column("scope", sa.String(length=16), nullable=True),
        sa.Column("tenant", sa.String(length=128), nullable=True),
        sa.Column("operation", sa.String(length=16), nullable=True),
        sa.Column("first_seen_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("chain_id", sa.String(length=255), nullable=True),
        sa.Column("seq", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("decision_id", name=op.f("pk_policy_decisions")),
    )
    with op.batch_alter_table("policy_decisions", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_policy_decisions_input_digest"), ["input_digest"], unique=False
        )
        batch_op.create_index(
            "ix_policy_decisions_tenant_first_seen_at", ["tenant", "first_seen_at"], unique=False
        )

    op.create_table(
        "purge_jobs",
        sa.Column("id", sa.String(length=36), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("tenant", sa.String(length=128), nullable=False),
        sa.Column("subject", sa.String(length=64), nullable=True),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("dry_run", sa.Boolean(), nullable=False),
        sa.Column("requested_by", sa.String(length=256), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("result", JSON, nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_purge_jobs")),
    )
    with op.batch_alter_table("purge_jobs", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_purge_jobs_state"), ["state"], unique=False)
        batch_op.create_index("ix_purge_jobs_tenant_subject", ["tenant", "subject"], unique=False)

    op.create_table(
        "requests",
        sa.Column("request_id", sa.String(length=128), nullable=False),
        sa.Column("tenant", sa.String(length=128), nullable=True),
        sa.Column("actor", sa.String(length=64), nullable=True),
        sa.Column("principal", sa.String(length=256), nullable=True),
        sa.Column("first_seen_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_seen_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("request_id", name=op.f("pk_requests")),
    )
    with op.batch_alter_table("requests", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_requests_actor"), ["actor"], unique=False)
        batch_op.create_index(batch_op.f("ix_requests_tenant"), ["tenant"], unique=False)

    op.create_table(
        "sidecars",
        sa.Column("id", sa.String(length=255), nullable=False),
        sa.Column("chain_id", sa.String(length=255), nullable=True),
        sa.Column("data_endpoint", sa.String(length=512), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_seen_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sidecars")),
    )
    op.create_table(
        "tenants",
        sa.Column("id", sa.String(length=128), nullable=False),
        sa.Column("display_name", sa.String(length=256), nullable=True),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("retention_s", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tenants")),
    )
    op.create_table(
        "user_refs",
        sa.Column("pseudonym", sa.String(length=64), nullable=False),
        sa.Column("tenant", sa.String(length=128), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("erased_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("pseudonym", name=op.f("pk_user_refs")),
    )
    with op.batch_alter_table("user_refs", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_user_refs_tenant"), ["tenant"], unique=False)

    op.create_table(
        "checkpoints",
        sa.Column("chain_id", sa.String(length=255), nullable=False),
        sa.Column("seq", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("head_hash", sa.String(length=64), nullable=False),
        sa.Column("signed_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("signature", sa.LargeBinary(), nullable=False),
        sa.Column("public_key", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(
            ["chain_id"], ["chains.chain_id"], name=op.f("fk_checkpoints_chain_id_chains")
        ),
        sa.PrimaryKeyConstraint("chain_id", "seq", name=op.f("pk_checkpoints")),
    )
    op.create_table(
        "ledger_events",
        sa.Column("chain_id", sa.String(length=255), nullable=False),
        sa.Column("seq", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("prev_hash", sa.String(length=64), nullable=False),
        sa.Column("hash", sa.String(length=64), nullable=False),
        sa.Column("encoding_version", sa.SmallInteger(), nullable=False),
        sa.Column("occurred_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("kind", sa.String(length=64), nullable=False),
        sa.Column("tenant", sa.String(length=128), nullable=True),
        sa.Column("actor", sa.String(length=64), nullable=True),
        sa.Column("request_id", sa.String(length=128), nullable=True),
        sa.Column("key_digest", sa.String(length=64), nullable=True),
        sa.Column("tier", sa.String(length=64), nullable=True),
        sa.Column("nbytes", sa.BigInteger(), nullable=True),
        sa.Column("outcome", sa.String(length=16), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("decision_id", sa.String(length=128), nullable=True),
        sa.Column("policy_revision", sa.String(length=128), nullable=True),
        sa.Column("principal", sa.String(length=256), nullable=True),
        sa.Column("attrs", sa.JSON(), nullable=False),
        sa.Column("payload_digest", sa.String(length=64), nullable=True),
        sa.ForeignKeyConstraint(
            ["chain_id"], ["chains.chain_id"], name=op.f("fk_ledger_events_chain_id_chains")
        ),
        sa.PrimaryKeyConstraint("chain_id", "seq", name=op.f("pk_ledger_events")),
    )
    with op.batch_alter_table("ledger_events", schema=None) as batch_op:
        batch_op.create_index("ix_ledger_events_actor", ["actor"], unique=False)
        batch_op.create_index("ix_ledger_events_key_digest", ["key_digest"], unique=False)
        batch_op.create_index("ix_ledger_events_request_id", ["request_id"], unique=False)
        batch_op.create_index("ix_ledger_events_tenant_kind", ["tenant", "kind"], unique=False)

    op.create_table(
        "purge_receipts",
        sa.Column("job_id", sa.String(length=36), nullable=False),
        sa.Column("receipt", JSON, nullable=False),
        sa.Column("signature", sa.LargeBinary(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"], ["purge_jobs.id"], name=op.f("fk_purge_receipts_job_id_purge_jobs")
        ),
        sa.PrimaryKeyConstraint("job_id", name=op.f("pk_purge_receipts")),
    )
    op.create_table(
        "purge_steps",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(length=36), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("sidecar_id", sa.String(length=255), nullable=True),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("detail", JSON, nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["job_id"], ["purge_jobs.id"], name=op.f("fk_purge_steps_job_id_purge_jobs")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_purge_steps")),
        sa.UniqueConstraint(
            "job_id",
            "name",
            "sidecar_id",
            name=op.f("uq_purge_steps_job_id_name_sidecar_id"),
            postgresql_nulls_not_distinct=True,
        ),
    )
    with op.batch_alter_table("purge_steps", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_purge_steps_job_id"), ["job_id"], unique=False)

    op.create_table(
        "event_payloads",
        sa.Column("chain_id", sa.String(length=255), nullable=False),
        sa.Column("seq", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("salt", sa.LargeBinary(), nullable=True),
        sa.Column("payload", sa.JSON(), nullable=True),
        sa.Column("erased_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["chain_id", "seq"],
            ["ledger_events.chain_id", "ledger_events.seq"],
            name="fk_event_payloads_event",
        ),
        sa.PrimaryKeyConstraint("chain_id", "seq", name=op.f("pk_event_payloads")),
    )


def downgrade() -> None:
    op.drop_table("event_payloads")
    with op.batch_alter_table("purge_steps", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_purge_steps_job_id"))

    op.drop_table("purge_steps")
    op.drop_table("purge_receipts")
    with op.batch_alter_table("ledger_events", schema=None) as batch_op:
        batch_op.drop_index("ix_ledger_events_tenant_kind")
        batch_op.drop_index("ix_ledger_events_request_id")
        batch_op.drop_index("ix_ledger_events_key_digest")
        batch_op.drop_index("ix_ledger_events_actor")

    op.drop_table("ledger_events")
    op.drop_table("checkpoints")
    with op.batch_alter_table("user_refs", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_user_refs_tenant"))

    op.drop_table("user_refs")
    op.drop_table("tenants")
    op.drop_table("sidecars")
    with op.batch_alter_table("requests", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_requests_tenant"))
        batch_op.drop_index(batch_op.f("ix_requests_actor"))

    op.drop_table("requests")
    with op.batch_alter_table("purge_jobs", schema=None) as batch_op:
        batch_op.drop_index("ix_purge_jobs_tenant_subject")
        batch_op.drop_index(batch_op.f("ix_purge_jobs_state"))

    op.drop_table("purge_jobs")
    with op.batch_alter_table("policy_decisions", schema=None) as batch_op:
        batch_op.drop_index("ix_policy_decisions_tenant_first_seen_at")
        batch_op.drop_index(batch_op.f("ix_policy_decisions_input_digest"))

    op.drop_table("policy_decisions")
    with op.batch_alter_table("data_keys", schema=None) as batch_op:
        batch_op.drop_index("ix_data_keys_tenant_user")

    op.drop_table("data_keys")
    op.drop_table("chains")
    with op.batch_alter_table("cache_entries", schema=None) as batch_op:
        batch_op.drop_index("ix_cache_entries_tenant_state")
        batch_op.drop_index("ix_cache_entries_state_expires_at")
        batch_op.drop_index(batch_op.f("ix_cache_entries_scope_user"))
        batch_op.drop_index(batch_op.f("ix_cache_entries_owner"))

    op.drop_table("cache_entries")
    op.drop_table("api_tokens")

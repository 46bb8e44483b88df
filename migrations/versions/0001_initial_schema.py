"""Initial schema: specs, blobs, plans, misses, jobs, api_tokens.

Revision ID: 0001
Revises: (none)
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0001'
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None
#: docs/DEPLOYMENT.md "Rolling back": the first schema: nothing runs before it.
expand_only = False


def upgrade() -> None:
    op.create_table('api_tokens',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('role', sa.String(length=16), nullable=False),
    sa.Column('token_hash', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('revoked_at', sa.DateTime(timezone=True), nullable=True),
    sa.CheckConstraint("role IN ('reader', 'worker', 'admin')", name=op.f('ck_api_tokens_role')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_api_tokens')),
    sa.UniqueConstraint('token_hash', name=op.f('uq_api_tokens_token_hash'))
    )
    op.create_index('uq_api_tokens_active_name', 'api_tokens', ['name'], unique=True, sqlite_where=sa.text('revoked_at IS NULL'), postgresql_where=sa.text('revoked_at IS NULL'))

    op.create_table('blobs',
    sa.Column('sha256', sa.String(length=64), nullable=False),
    sa.Column('size', sa.BigInteger(), nullable=False),
    sa.Column('data', sa.LargeBinary(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('sha256', name=op.f('pk_blobs'))
    )
    op.create_table('misses',
    sa.Column('graph_key', sa.String(length=64), nullable=False),
    sa.Column('env_id', sa.String(length=32), nullable=False),
    sa.Column('sm', sa.Integer(), nullable=False),
    sa.Column('sm_count', sa.Integer(), nullable=False),
    sa.Column('cudnn_version', sa.Integer(), nullable=False),
    sa.Column('driver_version', sa.Integer(), nullable=False),
    sa.Column('frontend_version', sa.String(length=64), nullable=False),
    sa.Column('device_name', sa.String(length=256), nullable=False),
    sa.Column('cuda_runtime', sa.String(length=64), nullable=False),
    sa.Column('torch_version', sa.String(length=64), nullable=False),
    sa.Column('count', sa.BigInteger(), nullable=False),
    sa.Column('first_seen', sa.DateTime(timezone=True), nullable=False),
    sa.Column('last_seen', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('graph_key', 'env_id', name=op.f('pk_misses'))
    )
    op.create_index('ix_misses_env_count', 'misses', ['env_id', 'count'], unique=False)

    op.create_table('specs',
    sa.Column('graph_key', sa.String(length=64), nullable=False),
    sa.Column('canonical_json', sa.Text(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('graph_key', name=op.f('pk_specs'))
    )
    op.create_table('jobs',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('graph_key', sa.String(length=64), nullable=False),
    sa.Column('sm', sa.Integer(), nullable=True),
    sa.Column('sm_count', sa.Integer(), nullable=True),
    sa.Column('cudnn_version', sa.Integer(), nullable=True),
    sa.Column('driver_version', sa.Integer(), nullable=True),
    sa.Column('frontend_version', sa.String(length=64), nullable=True),
    sa.Column('target_key', sa.String(length=256), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('priority', sa.Integer(), nullable=False),
    sa.Column('attempts', sa.Integer(), nullable=False),
    sa.Column('max_attempts', sa.Integer(), nullable=False),
    sa.Column('lease_owner', sa.String(length=256), nullable=True),
    sa.Column('lease_expires_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('fencing_token', sa.BigInteger(), nullable=False),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.CheckConstraint("status IN ('queued', 'running', 'succeeded', 'failed')", name=op.f('ck_jobs_status')),
    sa.CheckConstraint('max_attempts >= 1', name=op.f('ck_jobs_max_attempts')),
    sa.ForeignKeyConstraint(['graph_key'], ['specs.graph_key'], name=op.f('fk_jobs_graph_key_specs')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_jobs'))
    )
    op.create_index('ix_jobs_claim_order', 'jobs', ['status', 'priority', 'id'], unique=False)
    op.create_index(op.f('ix_jobs_graph_key'), 'jobs', ['graph_key'], unique=False)
    op.create_index('uq_jobs_active_target', 'jobs', ['graph_key', 'target_key'], unique=True, sqlite_where=sa.text("status IN ('queued', 'running')"), postgresql_where=sa.text("status IN ('queued', 'running')"))

    op.create_table('plans',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('graph_key', sa.String(length=64), nullable=False),
    sa.Column('env_id', sa.String(length=32), nullable=False),
    sa.Column('sm', sa.Integer(), nullable=False),
    sa.Column('sm_count', sa.Integer(), nullable=False),
    sa.Column('cudnn_version', sa.Integer(), nullable=False),
    sa.Column('driver_version', sa.Integer(), nullable=False),
    sa.Column('frontend_version', sa.String(length=64), nullable=False),
    sa.Column('device_name', sa.String(length=256), nullable=False),
    sa.Column('cuda_runtime', sa.String(length=64), nullable=False),
    sa.Column('torch_version', sa.String(length=64), nullable=False),
    sa.Column('blob_sha256', sa.String(length=64), nullable=False),
    sa.Column('blob_size', sa.BigInteger(), nullable=False),
    sa.Column('signature', sa.String(length=512), nullable=True),
    sa.Column('signer_key_id', sa.String(length=128), nullable=True),
    sa.Column('engine_id', sa.BigInteger(), nullable=False),
    sa.Column('knobs', sa.JSON(), nullable=False),
    sa.Column('plan_name', sa.String(length=512), nullable=False),
    sa.Column('workspace_bytes', sa.BigInteger(), nullable=False),
    sa.Column('winner_median_ms', sa.Float(), nullable=False),
    sa.Column('heuristic_median_ms', sa.Float(), nullable=True),
    sa.Column('worst_median_ms', sa.Float(), nullable=True),
    sa.Column('candidates', sa.JSON(), nullable=False),
    sa.Column('tuning_seconds', sa.Float(), nullable=False),
    sa.Column('worker_id', sa.String(length=256), nullable=False),
    sa.Column('job_id', sa.Integer(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['blob_sha256'], ['blobs.sha256'], name=op.f('fk_plans_blob_sha256_blobs')),
    sa.ForeignKeyConstraint(['graph_key'], ['specs.graph_key'], name=op.f('fk_plans_graph_key_specs')),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_plans_job_id_jobs')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_plans')),
    sa.UniqueConstraint('graph_key', 'env_id', name=op.f('uq_plans_graph_key_env_id'))
    )
    op.create_index(op.f('ix_plans_blob_sha256'), 'plans', ['blob_sha256'], unique=False)
    op.create_index(op.f('ix_plans_cudnn_version'), 'plans', ['cudnn_version'], unique=False)
    op.create_index(op.f('ix_plans_driver_version'), 'plans', ['driver_version'], unique=False)
    op.create_index(op.f('ix_plans_env_id'), 'plans', ['env_id'], unique=False)
    op.create_index(op.f('ix_plans_frontend_version'), 'plans', ['frontend_version'], unique=False)
    op.create_index(op.f('ix_plans_graph_key'), 'plans', ['graph_key'], unique=False)
    op.create_index(op.f('ix_plans_job_id'), 'plans', ['job_id'], unique=False)
    op.create_index(op.f('ix_plans_sm'), 'plans', ['sm'], unique=False)
    op.create_index(op.f('ix_plans_sm_count'), 'plans', ['sm_count'], unique=False)


def downgrade() -> None:
    # Dropping a table drops its indexes.
    for table in ("plans", "jobs", "specs", "misses", "blobs", "api_tokens"):
        op.drop_table(table)

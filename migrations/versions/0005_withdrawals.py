"""Withdrawn plans: a signed withdrawal per graph key and environment (``plancache plans withdraw``).

Downgrading drops the table: withdrawn plans stay withdrawn (their records are gone), but clients can no longer
learn why from the server.

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0005'
down_revision: str | None = '0004'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None
#: docs/DEPLOYMENT.md "Rolling back": a new table.
expand_only = True


def upgrade() -> None:
    op.create_table(
        'withdrawals',
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
        sa.Column('withdrawn_revision', sa.BigInteger(), nullable=False),
        sa.Column('revision', sa.BigInteger(), nullable=False),
        sa.Column('reason', sa.Text(), nullable=False),
        sa.Column('envelope', sa.JSON(), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(['graph_key'], ['specs.graph_key'], name=op.f('fk_withdrawals_graph_key_specs')),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_withdrawals')),
        sa.UniqueConstraint('graph_key', 'env_id', name=op.f('uq_withdrawals_graph_key_env_id')),
    )
    with op.batch_alter_table('withdrawals') as batch:
        batch.create_index(batch.f('ix_withdrawals_env_id'), ['env_id'], unique=False)
        batch.create_index(batch.f('ix_withdrawals_graph_key'), ['graph_key'], unique=False)


def downgrade() -> None:
    op.drop_table('withdrawals')

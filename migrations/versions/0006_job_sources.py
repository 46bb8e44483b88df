"""Jobs carry their source (``auto``, ``admin``, ``campaign``, ``capture``), and the store remembers which
environments workers claim for (the autotune policy's "served" environments).

Jobs that exist at upgrade time were all enqueued by an admin or a campaign; they read ``admin``.

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0006'
down_revision: str | None = '0005'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None
#: docs/DEPLOYMENT.md "Rolling back": a column with a server default and a new table.
expand_only = True


def upgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.add_column(sa.Column('source', sa.String(length=16), server_default='admin', nullable=False))
        batch.create_check_constraint('source', "source IN ('auto', 'admin', 'campaign', 'capture')")
        batch.create_index('ix_jobs_source_target', ['source', 'target_key', 'created_at'], unique=False)
    op.create_table(
        'worker_environments',
        sa.Column('env_id', sa.String(length=32), nullable=False),
        sa.Column('sm', sa.Integer(), nullable=False),
        sa.Column('sm_count', sa.Integer(), nullable=False),
        sa.Column('cudnn_version', sa.Integer(), nullable=False),
        sa.Column('driver_version', sa.Integer(), nullable=False),
        sa.Column('frontend_version', sa.String(length=64), nullable=False),
        sa.Column('last_claim_at', sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint('env_id', name=op.f('pk_worker_environments')),
    )


def downgrade() -> None:
    op.drop_table('worker_environments')
    with op.batch_alter_table('jobs') as batch:
        batch.drop_index('ix_jobs_source_target')
        batch.drop_constraint('source', type_='check')
        batch.drop_column('source')

"""Who counted a miss (``miss_callers``): a key's miss counts once per caller and client process, and a caller's
share of keys it raises again is kept in the database, so they hold across replicas and restarts.

Expand only: a new table, which code of 0009 ignores.

Revision ID: 0010
Revises: 0009
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0010'
down_revision: str | None = '0009'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None
#: docs/DEPLOYMENT.md "Rolling back": a new table.
expand_only = True


def upgrade() -> None:
    op.create_table(
        'miss_callers',
        sa.Column('env_id', sa.String(length=32), nullable=False),
        sa.Column('caller', sa.String(length=32), nullable=False),
        sa.Column('graph_key', sa.String(length=64), nullable=False),
        sa.Column('process', sa.String(length=32), nullable=False),
        sa.Column('counted_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('shared', sa.Boolean(), nullable=False),
        sa.PrimaryKeyConstraint('env_id', 'caller', 'graph_key', 'process'),
    )
    op.create_index('ix_miss_callers_share', 'miss_callers', ['caller', 'shared', 'counted_at'])
    op.create_index('ix_miss_callers_counted_at', 'miss_callers', ['counted_at'])


def downgrade() -> None:
    op.drop_table('miss_callers')

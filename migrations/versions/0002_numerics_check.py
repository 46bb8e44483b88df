"""Plans record which numerics check their winner passed.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0002'
down_revision: str | None = '0001'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None
#: docs/DEPLOYMENT.md "Rolling back": a column with a server default: code of 0001 inserts without it.
expand_only = True


def upgrade() -> None:
    with op.batch_alter_table('plans') as batch:
        batch.add_column(sa.Column('numerics_check', sa.String(length=32), server_default='reference', nullable=False))


def downgrade() -> None:
    with op.batch_alter_table('plans') as batch:
        batch.drop_column('numerics_check')

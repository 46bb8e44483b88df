"""The medians of torch's native attention kernels a worker timed beside a plan (``plans.native_median_ms``).

Expand only: a nullable column, which code of 0010 ignores; a record it writes has none (null: none timed).
Downgrading drops the column and the timings in it.

Revision ID: 0011
Revises: 0010
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0011'
down_revision: str | None = '0010'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None
#: docs/DEPLOYMENT.md "Rolling back": a nullable column.
expand_only = True


def upgrade() -> None:
    with op.batch_alter_table('plans') as batch:
        batch.add_column(sa.Column('native_median_ms', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('plans') as batch:
        batch.drop_column('native_median_ms')

"""Tokens may expire (``api_tokens.expires_at``, null: never), and the database says which older schemas' code may
run on it (``schema_compatibility``), so that a release rolled back over additive migrations starts.

Expand only: both are additions that code of 0007 ignores.

Revision ID: 0009
Revises: 0008
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0009'
down_revision: str | None = '0008'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None
#: docs/DEPLOYMENT.md "Rolling back": a nullable column and a new table.
expand_only = True


def upgrade() -> None:
    with op.batch_alter_table('api_tokens') as batch:
        batch.add_column(sa.Column('expires_at', sa.DateTime(timezone=True), nullable=True))
    op.create_table(
        'schema_compatibility',
        sa.Column('revision', sa.String(length=32), nullable=False),
        sa.Column('compatible_from', sa.String(length=32), nullable=False),
        sa.PrimaryKeyConstraint('revision'),
    )


def downgrade() -> None:
    op.drop_table('schema_compatibility')
    with op.batch_alter_table('api_tokens') as batch:
        batch.drop_column('expires_at')

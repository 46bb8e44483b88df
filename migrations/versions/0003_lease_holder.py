"""Leases are bound to their holder: the lease's secret token (hashed) and the API token that claimed it.

Jobs running at upgrade time have neither, so no one can act on their lease: they are claimed again
once it expires.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0003'
down_revision: str | None = '0002'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None
#: docs/DEPLOYMENT.md "Rolling back": nullable columns: code of 0002 ignores them (its leases carry no holder).
expand_only = True


def upgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.add_column(sa.Column('lease_token_hash', sa.String(length=64), nullable=True))
        batch.add_column(sa.Column('lease_holder', sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.drop_column('lease_holder')
        batch.drop_column('lease_token_hash')

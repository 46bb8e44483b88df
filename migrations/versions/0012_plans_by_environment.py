"""An environment's plans listed newest first through one index (``plans list --environment``, ``plans resign``).

``ix_plans_env_id`` (one column) gives way to ``ix_plans_env_id_created_at`` (``env_id``, ``created_at``, ``id``):
the same lookups by environment, and its records in the listing's order, so that a page reads its own rows rather
than every record of the environment, sorted (or every record of the store newest first, passing the other
environments'). Expand only: code of 0011 names no index.

Revision ID: 0012
Revises: 0011
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = '0012'
down_revision: str | None = '0011'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None
#: docs/DEPLOYMENT.md "Rolling back": an index in place of another that its columns lead.
expand_only = True


def upgrade() -> None:
    op.create_index('ix_plans_env_id_created_at', 'plans', ['env_id', 'created_at', 'id'], unique=False)
    op.drop_index('ix_plans_env_id', table_name='plans')


def downgrade() -> None:
    op.create_index('ix_plans_env_id', 'plans', ['env_id'], unique=False)
    op.drop_index('ix_plans_env_id_created_at', table_name='plans')

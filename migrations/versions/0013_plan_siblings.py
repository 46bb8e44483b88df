"""Each plan's sibling key (``plans.sibling_key``): the tuned plans of a graph's other shapes, listed by environment.

A nullable column and the index ``ix_plans_env_id_sibling_key`` (``env_id``, ``sibling_key``, ``created_at``, ``id``),
which ``POST /v1/plans/siblings`` reads; the records stored before are given theirs from their specs
(:func:`plancache.spec.axes.sibling_key`), a batch of graph keys at a time. Expand only: code of 0012 ignores the
column, and a record it writes during a rollback has none, so that its siblings are not listed (it is served as
before). Downgrading drops the index and the column.

Revision ID: 0013
Revises: 0012
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0013'
down_revision: str | None = '0012'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None
#: docs/DEPLOYMENT.md "Rolling back": a nullable column and an index.
expand_only = True
#: Graph keys given their sibling key per statement.
BATCH = 500


def upgrade() -> None:
    with op.batch_alter_table('plans') as batch:
        batch.add_column(sa.Column('sibling_key', sa.String(64), nullable=True))
    op.create_index('ix_plans_env_id_sibling_key', 'plans', ['env_id', 'sibling_key', 'created_at', 'id'], unique=False)
    _backfill(op.get_bind())


def downgrade() -> None:
    op.drop_index('ix_plans_env_id_sibling_key', table_name='plans')
    with op.batch_alter_table('plans') as batch:
        batch.drop_column('sibling_key')


def _backfill(conn: sa.Connection) -> None:
    """Every stored record's sibling key, from its spec: the graph keys of the records in key order, a batch at a time."""
    from plancache.spec.axes import stored_sibling_key

    plans = sa.table('plans', sa.column('graph_key', sa.String), sa.column('sibling_key', sa.String))
    specs = sa.table('specs', sa.column('graph_key', sa.String), sa.column('canonical_json', sa.Text))
    after = ""
    while True:
        rows = conn.execute(sa.select(specs.c.graph_key, specs.c.canonical_json)
                            .where(specs.c.graph_key > after, sa.exists().where(plans.c.graph_key == specs.c.graph_key))
                            .order_by(specs.c.graph_key).limit(BATCH)).all()
        if not rows:
            return
        given = [{"key": key, "shared": shared} for key, text in rows
                 if (shared := stored_sibling_key(text)) is not None]
        if given:  # one executemany a batch (pipelined on Postgres)
            conn.execute(sa.update(plans).where(plans.c.graph_key == sa.bindparam("key"))
                         .values(sibling_key=sa.bindparam("shared")), given)
        after = rows[-1][0]

"""Indexes and a tally whose cost does not grow with the plans and jobs a store keeps.

The one-column indexes on the plans' validity fields go (``env_id`` is their digest): a planner without table
statistics chose them over the ``(graph_key, env_id)`` index that resolve needs, and read every plan of the SM.
A claim seeks the active jobs of the target keys its environment matches (``uq_jobs_active_target``, led by the
target key) and the running jobs (``ix_jobs_running``, in place of ``ix_jobs_claim_order``, which led planners to
every queue; ``ix_jobs_finished`` lists the ended jobs of a status). Explain reads the newest job of a key for the targets an environment matches
(``ix_jobs_graph_key_target_key_id``, in place of ``ix_jobs_graph_key``). The newest plans and the most missed
graphs are read in index order (``ix_plans_created_at``, ``ix_misses_count``). How many jobs ended in each final
status is kept in ``job_tallies``, counted here once.

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0008'
down_revision: str | None = '0007'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None
#: docs/DEPLOYMENT.md "Rolling back": contract: code of 0007 ends jobs without counting them in job_tallies, so the
#: counts would drift under it.
expand_only = False

_VALIDITY = ('sm', 'sm_count', 'cudnn_version', 'driver_version', 'frontend_version')
_ACTIVE = sa.text("status IN ('queued', 'running')")
_RUNNING = sa.text("status = 'running'")
_FINISHED = ('failed', 'succeeded')
_FINISHED_WHERE = sa.text("status IN ('failed', 'succeeded')")


def upgrade() -> None:
    for field in _VALIDITY:
        op.drop_index(f'ix_plans_{field}', table_name='plans')
    op.create_index('ix_plans_created_at', 'plans', ['created_at', 'id'], unique=False)
    op.drop_index('ix_jobs_claim_order', table_name='jobs')
    op.drop_index('uq_jobs_active_target', table_name='jobs')
    op.create_index('uq_jobs_active_target', 'jobs', ['target_key', 'graph_key'], unique=True,
                    sqlite_where=_ACTIVE, postgresql_where=_ACTIVE)
    op.drop_index('ix_jobs_graph_key', table_name='jobs')
    op.create_index('ix_jobs_graph_key_target_key_id', 'jobs', ['graph_key', 'target_key', 'id'], unique=False)
    op.create_index('ix_jobs_running', 'jobs', ['lease_token_hash'], unique=False,
                    sqlite_where=_RUNNING, postgresql_where=_RUNNING)
    op.create_index('ix_jobs_finished', 'jobs', ['status', 'id'], unique=False, sqlite_where=_FINISHED_WHERE,
                    postgresql_where=_FINISHED_WHERE)
    op.create_index('ix_misses_count', 'misses', ['count', 'last_seen'], unique=False)
    tallies = op.create_table('job_tallies', sa.Column('status', sa.String(length=16), nullable=False),
                              sa.Column('count', sa.BigInteger(), nullable=False),
                              sa.PrimaryKeyConstraint('status', name=op.f('pk_job_tallies')))
    jobs = sa.table('jobs', sa.column('status', sa.String()))
    counts = dict(op.get_bind().execute(sa.select(jobs.c.status, sa.func.count()).group_by(jobs.c.status)).all())
    op.bulk_insert(tallies, [{'status': s, 'count': int(counts.get(s, 0))} for s in _FINISHED])


def downgrade() -> None:
    op.drop_table('job_tallies')
    op.drop_index('ix_misses_count', table_name='misses')
    op.drop_index('ix_jobs_finished', table_name='jobs')
    op.drop_index('ix_jobs_running', table_name='jobs')
    op.drop_index('ix_jobs_graph_key_target_key_id', table_name='jobs')
    op.create_index('ix_jobs_graph_key', 'jobs', ['graph_key'], unique=False)
    op.drop_index('uq_jobs_active_target', table_name='jobs')
    op.create_index('uq_jobs_active_target', 'jobs', ['graph_key', 'target_key'], unique=True,
                    sqlite_where=_ACTIVE, postgresql_where=_ACTIVE)
    op.create_index('ix_jobs_claim_order', 'jobs', ['status', 'priority', 'id'], unique=False)
    op.drop_index('ix_plans_created_at', table_name='plans')
    for field in _VALIDITY:
        op.create_index(f'ix_plans_{field}', 'plans', [field], unique=False)

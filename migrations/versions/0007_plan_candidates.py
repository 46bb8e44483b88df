"""The candidates table of a tuning run moves out of its plan record, into ``plan_candidates``, bounded.

Each record's ``candidates`` become a row of ``plan_candidates``, cut as the worker cuts them
(:meth:`plancache.protocol.CandidateTable.best_of`: the best 512 within 1 MiB of JSON, the rest counted by status);
a row that is no longer a valid candidate is counted, not kept. Downgrading puts the kept rows back into the
records (the counts are lost).

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op
from pydantic import ValidationError

from plancache.protocol import Candidate, CandidateTable

revision: str = '0007'
down_revision: str | None = '0006'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None
#: docs/DEPLOYMENT.md "Rolling back": contract: drops plans.candidates, which code of 0006 reads and writes.
expand_only = False

_plans = sa.table('plans', sa.column('id', sa.Integer()), sa.column('candidates', sa.JSON()))
_table = sa.table('plan_candidates', sa.column('plan_id', sa.Integer()), sa.column('candidates', sa.JSON()),
                  sa.column('omitted', sa.JSON()))


def _cut(rows: list[Any]) -> dict[str, Any]:
    """The bounded table of a record's stored candidates (invalid rows counted under their status, if any)."""
    valid, invalid = [], dict[str, int]()
    for row in rows:
        try:
            valid.append(Candidate.model_validate(row))
        except ValidationError:
            status = row.get('status') if isinstance(row, dict) else None
            key = status if status in ('ok', 'build_failed', 'run_failed', 'mismatch') else 'build_failed'
            invalid[key] = invalid.get(key, 0) + 1
    table = CandidateTable.best_of(valid)
    omitted: dict[str, int] = dict(table.candidates_omitted)
    for status, n in invalid.items():
        omitted[status] = omitted.get(status, 0) + n
    return {'candidates': [c.model_dump(mode='json') for c in table.candidates], 'omitted': omitted}


def upgrade() -> None:
    op.create_table(
        'plan_candidates',
        sa.Column('plan_id', sa.Integer(), nullable=False),
        sa.Column('candidates', sa.JSON(), nullable=False),
        sa.Column('omitted', sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(['plan_id'], ['plans.id'], name=op.f('fk_plan_candidates_plan_id_plans'),
                                ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('plan_id', name=op.f('pk_plan_candidates')),
    )
    conn = op.get_bind()
    for plan_id in conn.execute(sa.select(_plans.c.id)).scalars().all():  # one record's candidates in memory at a time
        rows = conn.execute(sa.select(_plans.c.candidates).where(_plans.c.id == plan_id)).scalar_one()
        conn.execute(sa.insert(_table).values(plan_id=plan_id, **_cut(rows or [])))
    # Natively, not in batch mode: recreating ``plans`` on SQLite would cascade into the rows just written.
    op.drop_column('plans', 'candidates')


def downgrade() -> None:
    op.add_column('plans', sa.Column('candidates', sa.JSON(), server_default='[]', nullable=False))
    conn = op.get_bind()
    for plan_id in conn.execute(sa.select(_table.c.plan_id)).scalars().all():
        rows = conn.execute(sa.select(_table.c.candidates).where(_table.c.plan_id == plan_id)).scalar_one()
        conn.execute(sa.update(_plans).where(_plans.c.id == plan_id).values(candidates=rows))
    op.drop_table('plan_candidates')

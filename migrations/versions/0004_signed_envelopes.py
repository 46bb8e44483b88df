"""Plan records are signed as DSSE envelopes carrying in-toto statements, and ordered by a revision.

The statement-v1 signatures (``signature``, ``signer_key_id``) are dropped: they cannot be turned into
envelopes without the signing key, and clients no longer accept them. Records stored before the upgrade
are unsigned, with revision 0, until they are signed again (``plancache plans resign``) or re-tuned.
Downgrading drops the envelopes and revisions the same way (the records become unsigned).

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0004'
down_revision: str | None = '0003'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None
#: docs/DEPLOYMENT.md "Rolling back": contract: drops the columns code of 0003 writes (signature, signer_key_id).
expand_only = False


def upgrade() -> None:
    with op.batch_alter_table('plans') as batch:
        batch.drop_column('signer_key_id')
        batch.drop_column('signature')
        batch.add_column(sa.Column('envelope', sa.JSON(), nullable=True))
        batch.add_column(sa.Column('revision', sa.BigInteger(), server_default='0', nullable=False))


def downgrade() -> None:
    with op.batch_alter_table('plans') as batch:
        batch.drop_column('revision')
        batch.drop_column('envelope')
        batch.add_column(sa.Column('signature', sa.String(length=512), nullable=True))
        batch.add_column(sa.Column('signer_key_id', sa.String(length=128), nullable=True))

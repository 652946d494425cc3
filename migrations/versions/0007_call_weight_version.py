"""calls.weight_version and calls.constraint_kind: the policy version that served a call, and the
grammar that constrained its decoding

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01 12:30:00.000000

Both null for calls recorded before versions were kept (their bundles carry no version). The
version is the proxy's record of the engine's weights at admission (capture_proxy/weights.py);
``constraint_kind`` is a ``capture_contracts.vocabulary.Constraint`` (every completion token of
such a call was decoded under the grammar's mask).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("calls", schema=None) as batch_op:
        batch_op.add_column(sa.Column("weight_version", sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column("constraint_kind", sa.String(32), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("calls", schema=None) as batch_op:
        batch_op.drop_column("constraint_kind")
        batch_op.drop_column("weight_version")

"""call continuation: what exact-token stitching needs per call

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29 09:40:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("calls", schema=None) as batch_op:
        batch_op.add_column(sa.Column("continuation", sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column("reply_hash", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("calls", schema=None) as batch_op:
        batch_op.drop_column("reply_hash")
        batch_op.drop_column("continuation")

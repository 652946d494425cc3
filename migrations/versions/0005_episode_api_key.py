"""episode api_key_hash: the SHA-256 of the episode's own API key (access control)

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 09:30:00.000000

Null for episodes created without an admin key (open, loopback dev mode); such an episode is
reached only with the admin key once the proxy runs with one. The key itself is never stored.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("episodes", schema=None) as batch_op:
        batch_op.add_column(sa.Column("api_key_hash", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("episodes", schema=None) as batch_op:
        batch_op.drop_column("api_key_hash")

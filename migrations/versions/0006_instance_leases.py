"""instance leases: each proxy process owns the calls it admits (crash safety)

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01 12:00:00.000000

``instances`` holds one row per proxy process run: a unique ``instance_id``, a ``name`` stable
across restarts (host and port), its ``state`` (live, expired, replaced, stopped) and the lease's
``expires_at`` (seconds since the epoch by the store's clock), renewed by heartbeats.
``calls.instance_id`` names the instance that admitted the call: when that instance's lease runs
out (or a new run of the same name starts), its unresolved calls become ``failed`` with the reason
``proxy_restart`` (capture_proxy/store/leases.py). Calls admitted before this revision have no
instance and are left as they are.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "instances",
        sa.Column("instance_id", sa.String(80), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("host", sa.String(200), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.Float(), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("resolved_calls", sa.Integer(), nullable=False, server_default="0"),
        sa.PrimaryKeyConstraint("instance_id", name=op.f("pk_instances")),
    )
    op.create_index("ix_instances_state_expires", "instances", ["state", "expires_at"])
    op.create_index("ix_instances_name", "instances", ["name"])
    with op.batch_alter_table("calls", schema=None) as batch_op:
        batch_op.add_column(sa.Column("instance_id", sa.String(80), nullable=True))
        batch_op.create_index("ix_calls_instance_status", ["instance_id", "status"])


def downgrade() -> None:
    with op.batch_alter_table("calls", schema=None) as batch_op:
        batch_op.drop_index("ix_calls_instance_status")
        batch_op.drop_column("instance_id")
    op.drop_index("ix_instances_name", table_name="instances")
    op.drop_index("ix_instances_state_expires", table_name="instances")
    op.drop_table("instances")

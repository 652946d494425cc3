"""drop calls index (episode_id): two composite indexes begin with the same column

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03 12:40:00.000000

``ix_calls_episode_status`` (episode_id, status) and ``ix_calls_episode_agent_completed``
(episode_id, agent_id, completed_seq) both serve a lookup by episode alone, so the single-column
index only cost a B-tree insert at every admission: one page more written per admission (a WAL
frame on SQLite), for no query.
"""

from __future__ import annotations

from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.drop_index("ix_calls_episode_id", table_name="calls")


def downgrade() -> None:
    op.create_index("ix_calls_episode_id", "calls", ["episode_id"])

"""calls index (episode_id, agent_id, completed_seq): the agent's calls since a point, no scan

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 09:30:00.000000

Exact-token continuation reads an agent's calls completed since the last ones it indexed
(``completed_seq > since``); without this index that read walks every call of the episode.
"""

from __future__ import annotations

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(
        "ix_calls_episode_agent_completed",
        "calls",
        ["episode_id", "agent_id", "completed_seq"],
    )


def downgrade() -> None:
    op.drop_index("ix_calls_episode_agent_completed", table_name="calls")

"""call token_prefix: the per-call drift summary, kept when a continuation completes

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 09:00:00.000000

``calls.token_prefix`` is true when the call extends a recorded call (``continuation.base_call_id``)
whose exact prompt + completion is a token prefix of its prompt. Existing rows are filled in from
their packed token arrays: little-endian int32 ids, so a token prefix is a byte prefix.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("calls", schema=None) as batch_op:
        batch_op.add_column(sa.Column("token_prefix", sa.Boolean(), nullable=True))
    calls = sa.table(
        "calls",
        sa.column("call_id", sa.String),
        sa.column("status", sa.String),
        sa.column("continuation", sa.JSON),
        sa.column("prompt_token_ids", sa.LargeBinary),
        sa.column("completion_token_ids", sa.LargeBinary),
        sa.column("token_prefix", sa.Boolean),
    )
    connection = op.get_bind()
    rows = connection.execute(
        sa.select(calls.c.call_id, calls.c.continuation, calls.c.prompt_token_ids).where(
            calls.c.status == "completed", calls.c.continuation.is_not(None)
        )
    ).all()
    for call_id, continuation, prompt in rows:
        base_id = (continuation or {}).get("base_call_id")
        if not base_id:
            continue
        base = connection.execute(
            sa.select(calls.c.prompt_token_ids, calls.c.completion_token_ids).where(
                calls.c.call_id == base_id
            )
        ).first()
        if base is None:
            continue
        prefix = bytes(prompt or b"").startswith(bytes(base[0] or b"") + bytes(base[1] or b""))
        connection.execute(
            sa.update(calls).where(calls.c.call_id == call_id).values(token_prefix=prefix)
        )


def downgrade() -> None:
    with op.batch_alter_table("calls", schema=None) as batch_op:
        batch_op.drop_column("token_prefix")

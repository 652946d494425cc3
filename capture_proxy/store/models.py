"""Table models: episodes, calls, exports, instances. Token arrays are packed (packing.py)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Episode(Base):
    __tablename__ = "episodes"

    episode_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    group_id: Mapped[str] = mapped_column(String(200), index=True)
    status: Mapped[str] = mapped_column(String(16), index=True)  # open | closing | closed
    reward: Mapped[float | None] = mapped_column(Float, nullable=True)
    metadata_: Mapped[dict[str, Any]] = mapped_column("metadata", JSON, default=dict)
    seq: Mapped[int] = mapped_column(
        BigInteger, default=0
    )  # episode-wide admission/completion counter
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    closed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    export_id: Mapped[int | None] = mapped_column(
        ForeignKey("exports.export_id"), nullable=True, index=True
    )
    # SHA-256 (hex) of the episode's API key (capture_proxy/api/auth.py); null when created open.
    api_key_hash: Mapped[str | None] = mapped_column(String(64), nullable=True)


class Call(Base):
    __tablename__ = "calls"
    __table_args__ = (
        Index("ix_calls_episode_status", "episode_id", "status"),
        Index("ix_calls_episode_agent_completed", "episode_id", "agent_id", "completed_seq"),
        Index("ix_calls_instance_status", "instance_id", "status"),
    )

    call_id: Mapped[str] = mapped_column(String(80), primary_key=True)
    episode_id: Mapped[str] = mapped_column(ForeignKey("episodes.episode_id"))  # (indexes above)
    request_id: Mapped[str] = mapped_column(String(80))  # shared by the choices of one request
    choice_index: Mapped[int] = mapped_column(Integer, default=0)
    endpoint: Mapped[str] = mapped_column(String(16))  # chat | completions
    stream: Mapped[bool] = mapped_column(Boolean, default=False)
    agent_id: Mapped[str | None] = mapped_column(String(200), nullable=True)
    parent_agent_id: Mapped[str | None] = mapped_column(String(200), nullable=True)
    role: Mapped[str] = mapped_column(String(16))  # policy | compaction | auxiliary
    status: Mapped[str] = mapped_column(String(16))  # admitted | completed | failed | cancelled
    mark: Mapped[str | None] = mapped_column(String(16), nullable=True)  # discarded | accepted
    admitted_seq: Mapped[int] = mapped_column(BigInteger)
    completed_seq: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    finish_reason: Mapped[str | None] = mapped_column(String(32), nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    model: Mapped[str | None] = mapped_column(String(200), nullable=True)
    prompt_token_ids: Mapped[bytes] = mapped_column(LargeBinary, default=b"")
    completion_token_ids: Mapped[bytes] = mapped_column(LargeBinary, default=b"")
    completion_logprobs: Mapped[bytes] = mapped_column(LargeBinary, default=b"")
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    usage: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    # Exact-token continuation (capture_contracts.bundle.ContinuationRecord): mode, hashes, why not.
    continuation: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    reply_hash: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # The drift summary, set at completion: the base call's exact tokens are a prefix of the prompt.
    token_prefix: Mapped[bool | None] = mapped_column(Boolean, nullable=True)
    # The proxy instance that admitted the call (instances.instance_id; null before revision 0006).
    instance_id: Mapped[str | None] = mapped_column(String(80), nullable=True)
    # The policy version that served the call, and the grammar that constrained it (migration 0007).
    weight_version: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    constraint_kind: Mapped[str | None] = mapped_column(String(32), nullable=True)
    admitted_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    completed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class Export(Base):
    """One file written by the reconstruction job; its episodes point here once exported."""

    __tablename__ = "exports"

    export_id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    path: Mapped[str] = mapped_column(Text)
    rows: Mapped[int] = mapped_column(Integer)
    episodes: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Instance(Base):
    """One run of a proxy process and its lease on the calls it admits (store/leases.py)."""

    __tablename__ = "instances"
    __table_args__ = (
        Index("ix_instances_state_expires", "state", "expires_at"),
        Index("ix_instances_name", "name"),
    )

    instance_id: Mapped[str] = mapped_column(String(80), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))  # stable across restarts: host:port
    state: Mapped[str] = mapped_column(String(16))  # live | expired | replaced | stopped
    host: Mapped[str] = mapped_column(String(200))
    pid: Mapped[int] = mapped_column(Integer)
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    expires_at: Mapped[float] = mapped_column(Float)  # epoch seconds by the store's clock
    ended_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    resolved_calls: Mapped[int] = mapped_column(Integer, default=0, server_default="0")

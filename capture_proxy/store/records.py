"""Frozen records the store hands out (never ORM objects across the boundary)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from capture_contracts.bundle import ContinuationRecord
from capture_contracts.vocabulary import (
    CallStatus,
    Constraint,
    Endpoint,
    EpisodeStatus,
    Mark,
    Role,
)


@dataclass(frozen=True, slots=True)
class CallAccounting:
    admitted: int = 0
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    in_flight: int = 0


@dataclass(frozen=True, slots=True)
class EpisodeInfo:
    episode_id: str
    group_id: str
    status: EpisodeStatus
    reward: float | None
    metadata: dict[str, Any]
    calls: CallAccounting
    exported: bool = False


@dataclass(frozen=True, slots=True)
class CallInfo:
    call_id: str
    request_id: str
    choice_index: int
    endpoint: str
    stream: bool
    agent_id: str | None
    parent_agent_id: str | None
    role: str
    status: CallStatus
    mark: Mark | None
    admitted_seq: int
    completed_seq: int | None
    finish_reason: str | None
    error: str | None
    model: str | None
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class Admission:
    """What the harness told us about a call before it runs."""

    endpoint: Endpoint
    stream: bool
    n: int
    role: Role
    agent_id: str | None = None
    parent_agent_id: str | None = None
    model: str | None = None
    continuation: ContinuationRecord | None = None  # see capture_proxy/continuation.py
    weight_version: int | None = None  # the policy version serving it (capture_proxy/weights.py)
    constraint: Constraint | None = None  # the grammar decoding it (capture.request_constraint)


@dataclass(frozen=True, slots=True)
class Generation:
    """One captured choice: exact prompt ids, sampled ids and their behaviour logprobs."""

    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    completion_logprobs: list[float]
    finish_reason: str | None
    usage: dict[str, Any] | None = field(default=None)
    reply_hash: str | None = None  # hash chain of the request messages + the returned reply


@dataclass(frozen=True, slots=True)
class CompletedChatCall:
    """A completed chat call of an agent, as exact-token continuation looks for its base."""

    call_id: str
    completed_seq: int
    role: str
    continuation: ContinuationRecord
    reply_hash: str | None

"""Wire schemas of the episode REST API (separate from the table models)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from capture_contracts.vocabulary import EpisodeStatus, Mark, Role
from capture_proxy.store.records import CallAccounting, CallInfo, EpisodeInfo


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CreateEpisode(_Strict):
    group_id: str = Field(min_length=1, max_length=200)
    episode_id: str | None = Field(
        None, min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:\-]+$"
    )
    metadata: dict[str, Any] = Field(default_factory=dict)


class MarkCall(_Strict):
    mark: Mark | None = Field(
        description="The harness's acknowledgement of the call (DESIGN §5 rule 3)."
    )
    role: Role | None = None


class CloseEpisode(_Strict):
    reward: float = Field(allow_inf_nan=False)
    wait_s: float = Field(
        0.0, ge=0.0, le=3600.0, description="How long to wait for in-flight calls."
    )
    cancel_outstanding: bool = Field(
        False, description="Cancel calls still in flight after wait_s instead of answering 409."
    )
    discarded_calls: list[str] = Field(default_factory=list)
    accepted_calls: list[str] = Field(default_factory=list)


class EpisodeOut(BaseModel):
    episode_id: str
    group_id: str
    status: EpisodeStatus
    reward: float | None
    metadata: dict[str, Any]
    exported: bool
    base_url: str
    calls: CallAccounting
    continuation: dict[str, Any] | None = Field(
        None,
        description="Drift report (GET /episodes/{id} only): stitched calls, fresh renders by "
        "reason, continuations and how many stayed token prefixes.",
    )

    @classmethod
    def of(cls, info: EpisodeInfo, base_url: str) -> EpisodeOut:
        return cls(
            episode_id=info.episode_id,
            group_id=info.group_id,
            status=info.status,
            reward=info.reward,
            metadata=info.metadata,
            exported=info.exported,
            base_url=base_url,
            calls=info.calls,
        )


class CallOut(BaseModel):
    call_id: str
    request_id: str
    choice_index: int
    endpoint: str
    stream: bool
    agent_id: str | None
    parent_agent_id: str | None
    role: str
    status: str
    mark: str | None
    admitted_seq: int
    completed_seq: int | None
    finish_reason: str | None
    error: str | None
    model: str | None
    prompt_tokens: int
    completion_tokens: int

    @classmethod
    def of(cls, info: CallInfo) -> CallOut:
        return cls(**{name: getattr(info, name) for name in cls.model_fields})


class ErrorDetail(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error, not_found_error, upstream_error, …")
    param: str | None = Field(None, description="The field or header at fault, if one is.")
    code: str | int | None = None


class ErrorBody(BaseModel):
    """Every error, on every route: OpenAI's shape (``capture_contracts.errors``)."""

    error: ErrorDetail


def _error(description: str) -> dict[str, Any]:
    return {"model": ErrorBody, "description": description}


#: The error answers documented on the episode and OpenAI routes (the app answers 400, not 422).
EPISODE_ERRORS: dict[int | str, dict[str, Any]] = {
    400: _error("Malformed request (the error body names the field in `param`)."),
    404: _error("Unknown episode or call."),
    409: _error("The episode is not open, the id exists, or calls are still in flight."),
}
OPENAI_ERRORS: dict[int | str, dict[str, Any]] = {
    **EPISODE_ERRORS,
    502: _error("The engine failed or is unreachable (its own status when it answered one)."),
    504: _error("The engine timed out."),
}

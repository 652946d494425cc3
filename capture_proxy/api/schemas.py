"""Wire schemas of the episode REST API (separate from the table models)."""

from __future__ import annotations

import re
from typing import Annotated, Any

from fastapi import Path
from pydantic import BaseModel, ConfigDict, Field, model_validator

from capture_contracts.vocabulary import EpisodeStatus, Mark, Role
from capture_proxy.api.json_body import check_json_value
from capture_proxy.store.records import CallAccounting, CallInfo, EpisodeInfo
from capture_proxy.weights import WeightState

#: Episode and call ids: what ``POST /episodes`` accepts and the store generates.
ID_PATTERN = re.compile(r"[A-Za-z0-9._:\-]+")
#: A label stored as a string column: PostgreSQL refuses NUL in text.
NO_NUL = r"^[^\x00]*$"

EpisodeIdPath = Annotated[
    str, Path(min_length=1, max_length=200, pattern=f"^{ID_PATTERN.pattern}$")
]
CallIdPath = Annotated[str, Path(min_length=1, max_length=200, pattern=f"^{ID_PATTERN.pattern}$")]


class _Strict(BaseModel):
    """REST bodies: unknown fields refused, JSON's types (``0`` is no boolean), strings
    UTF-8-encodable, numbers finite."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _json_safe(cls, data: Any) -> Any:
        check_json_value(data)
        return data


class CreateEpisode(_Strict):
    group_id: str = Field(min_length=1, max_length=200, pattern=NO_NUL)
    episode_id: str | None = Field(
        None, min_length=1, max_length=200, pattern=f"^{ID_PATTERN.pattern}$"
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
    discarded_calls: list[Annotated[str, Field(max_length=200, pattern=NO_NUL)]] = Field(
        default_factory=list
    )
    accepted_calls: list[Annotated[str, Field(max_length=200, pattern=NO_NUL)]] = Field(
        default_factory=list
    )


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


class CreatedEpisode(EpisodeOut):
    api_key: str | None = Field(
        None,
        description="The episode's own key for its OpenAI endpoints, answered only here, once "
        "(the store keeps its digest). Null when the proxy runs without an admin key.",
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


# -- the served policy version (api/weights.py) -----------------------------------------------


class WeightsOut(BaseModel):
    weight_version: int = Field(description="The version recorded on calls admitted now.")
    paused: bool = Field(description="The gate is closed: new calls are held, not failed.")
    in_flight: int = Field(description="Calls past the gate and not finished.")
    held: int = Field(description="Calls waiting at the gate.")

    @classmethod
    def of(cls, state: WeightState) -> WeightsOut:
        return cls(
            weight_version=state.weight_version,
            paused=state.paused,
            in_flight=state.in_flight,
            held=state.held,
        )


class PauseWeights(_Strict):
    timeout_s: float = Field(
        600.0, ge=0.0, le=3600.0, description="How long to wait for in-flight calls to finish."
    )


class ResumeWeights(_Strict):
    weight_version: int | None = Field(
        None,
        ge=0,
        le=2**62,
        description="The new version. Null: the engine's integer /weight_info version if it "
        "has one, else the proxy's counter + 1.",
    )

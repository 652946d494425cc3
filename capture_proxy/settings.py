"""The one settings object. Environment variables ``CAPTURE_PROXY_*`` (nested with ``__``).

Examples: ``CAPTURE_PROXY_STORE__URL=postgresql+asyncpg://127.0.0.1/test``,
``CAPTURE_PROXY_UPSTREAM__URL=http://127.0.0.1:8000``,
``CAPTURE_PROXY_UPSTREAM__OVERRIDES='{"temperature": 1.0}'``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import Any

from pydantic import BaseModel, Field, ImportString, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from capture_contracts.vocabulary import ContinuationMode, Role


class UpstreamSettings(BaseModel):
    url: str = Field("http://127.0.0.1:8000", description="Base URL of the vLLM server (no /v1).")
    timeout_s: float = Field(600.0, description="Read timeout for one upstream request.")
    connect_timeout_s: float = 10.0
    served_model: str | None = Field(
        None, description="If set, every request's `model` is replaced by this served name."
    )
    overrides: dict[str, Any] = Field(
        default_factory=dict,
        description="Body fields forced on every upstream request (e.g. temperature 1.0).",
    )
    api_key: SecretStr | None = None
    transform: ImportString[Callable[..., Any]] | None = Field(
        None,
        description=(
            "Request-transform hook: a callable `(body, attribution) -> body` (or its dotted "
            "path, `package.module.name`) applied to every request before `overrides`, "
            "`served_model` and the capture fields. Harness-only fields are already stripped."
        ),
    )


class StoreSettings(BaseModel):
    url: str = Field("sqlite+aiosqlite:///./capture.db", description="SQLAlchemy async URL.")
    echo: bool = False


class RoleRule(BaseModel):
    """Assigns ``role`` to a call when every matcher that is set matches (at least one must be).

    Matchers: a request header (present, or equal to ``header_value``; with ``header_field``,
    that field of the header's JSON object, as in Codex's ``x-codex-turn-metadata``); a
    top-level body field (present, or equal to ``body_value``); the first system message's
    prefix; a text part of the last user message's prefix (an instruction appended to the
    agent's own context); the requested model name (an alias a harness uses for, e.g., its
    small model); ``no_tools``. With ``agent_suffix``, a matching call is labelled as agent
    ``<agent><suffix>`` with the agent as its parent: a side context forked off the agent's
    tokens (Claude Code's compaction), not the agent itself going back.
    """

    role: Role
    system_prefix: str | None = None
    header: str | None = None
    header_value: str | None = None
    header_field: str | None = None
    last_user_prefix: str | None = None
    agent_suffix: str | None = None
    body_field: str | None = None
    body_value: Any = None
    model: str | None = None
    no_tools: bool = False

    @model_validator(mode="after")
    def _has_a_matcher(self) -> RoleRule:
        matchers = (
            self.system_prefix,
            self.header,
            self.body_field,
            self.model,
            self.last_user_prefix,
        )
        if all(m is None for m in matchers):
            raise ValueError(
                "a role rule needs system_prefix, header, body_field, model or last_user_prefix"
            )
        return self


def _default_role_rules() -> list[RoleRule]:
    return [
        RoleRule(role="auxiliary", system_prefix="You are a title generator", no_tools=True),
        RoleRule(role="compaction", system_prefix="You are a context summarization agent"),
        # Claude Code 2.1: its request class (main, subagent, compaction, auxiliary, …) and its
        # auxiliary calls' type; its compaction call's system prompt.
        RoleRule(
            role="compaction", header="x-claude-code-request-class", header_value="compaction"
        ),
        RoleRule(role="auxiliary", header="x-claude-code-request-class", header_value="auxiliary"),
        RoleRule(role="auxiliary", header="x-claude-code-auxiliary-type"),
        RoleRule(
            role="compaction",
            system_prefix="You are a helpful AI assistant tasked with summarizing conversations",
        ),
        # Claude Code 2.1.3xx compacts in the agent's own context (same system prompt and
        # tools, a summary instruction as the last user turn): a side context of the agent.
        RoleRule(
            role="compaction",
            last_user_prefix="CRITICAL: Respond with TEXT ONLY. Do NOT call any tools.",
            agent_suffix="/compaction",
        ),
        # Codex 0.169: `request_kind` of its turn metadata; its compaction sub-agent header.
        RoleRule(
            role="compaction",
            header="x-codex-turn-metadata",
            header_field="request_kind",
            header_value="compaction",
        ),
        RoleRule(role="compaction", header="x-openai-subagent", header_value="compact"),
    ]


class AttributionSettings(BaseModel):
    role_rules: list[RoleRule] = Field(default_factory=_default_role_rules)
    agent_body_field: str | None = Field(
        None, description="Body field holding the agent id (read and stripped before forwarding)."
    )
    parent_agent_body_field: str | None = Field(
        None, description="Body field holding the parent agent id (read and stripped)."
    )
    role_body_field: str | None = Field(
        None, description="Body field holding the call role (read and stripped)."
    )
    remember_parents: bool = Field(
        True,
        description=(
            "Remember agent → parent links per episode (OpenCode's session → parent session) "
            "and fill in the parent of a later call of that agent that does not repeat it."
        ),
    )
    remembered_episodes: int = Field(
        4096, ge=1, description="How many episodes' links this process keeps (least recent out)."
    )
    strip_body_fields: list[str] = Field(
        default_factory=list, description="Harness-only body fields removed before forwarding."
    )


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="CAPTURE_PROXY_", env_nested_delimiter="__", extra="ignore"
    )

    host: str = "127.0.0.1"
    port: int = 8100
    public_url: str | None = Field(
        None, description="Base URL clients use to reach the proxy (for `base_url` answers)."
    )
    close_poll_interval_s: float = 0.05
    upstream: UpstreamSettings = Field(default_factory=UpstreamSettings)
    store: StoreSettings = Field(default_factory=StoreSettings)
    attribution: AttributionSettings = Field(default_factory=AttributionSettings)
    continuation: ContinuationMode = Field(
        "stitch",
        description="`stitch` (default): continue an agent on its own sampled tokens (token-in"
        " generation, needs vLLM --enable-scale-out; without it each call falls back to a fresh"
        " render, reason `token_path_unavailable`); `passthrough`: forward chat requests as sent"
        " (engines without token-in generation).",
    )
    end_of_turn_token: str = Field(
        "<|im_end|>", description="The chat template's end-of-turn token (stitching)."
    )


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()

"""The one settings object. Environment variables ``CAPTURE_PROXY_*`` (nested with ``__``).

Examples: ``CAPTURE_PROXY_STORE__URL=postgresql+asyncpg://127.0.0.1/test``,
``CAPTURE_PROXY_UPSTREAM__URL=http://127.0.0.1:8000``,
``CAPTURE_PROXY_UPSTREAM__OVERRIDES='{"temperature": 1.0}'``,
``CAPTURE_PROXY_LIMITS__MAX_BODY_BYTES=8388608``, ``CAPTURE_PROXY_AUTH__ADMIN_KEY=…``.

:func:`load_settings` (behind :func:`get_settings`) turns every way of getting a variable wrong
into one :class:`~capture_proxy.errors.InvalidSettings` line naming the variable and what it
expects (a nested group set as a plain value, a value of the wrong type); :func:`env_warnings`
names ``CAPTURE_PROXY_*`` variables that set nothing (a typo is otherwise silently ignored).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    Field,
    ImportString,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict
from pydantic_settings import SettingsError as PydanticSettingsError

from capture_contracts.vocabulary import ContinuationMode, Role
from capture_proxy.errors import InvalidSettings
from capture_proxy.store.urls import store_url

ENV_PREFIX = "CAPTURE_PROXY_"
NESTED = "__"


class UpstreamSettings(BaseModel):
    url: str = Field("http://127.0.0.1:8000", description="Base URL of the vLLM server (no /v1).")
    timeout_s: float = Field(600.0, description="Read timeout for one upstream request.")
    connect_timeout_s: float = 10.0
    health_path: str = Field(
        "/health", description="Engine route `/readyz` checks (vLLM answers 200 when serving)."
    )
    ready_timeout_s: float = Field(2.0, gt=0, description="Timeout of one readiness check.")
    served_model: str | None = Field(
        None, description="If set, every request's `model` is replaced by this served name."
    )
    overrides: dict[str, Any] = Field(
        default_factory=dict,
        description="Body fields forced on every upstream request (e.g. temperature 1.0).",
    )
    stream_interval: int | None = Field(
        None,
        ge=1,
        description=(
            "Tokens per streamed chunk the engine is asked for (vLLM's `stream_interval`; the "
            "first and last chunks go at once), on streamed requests that name none. Fewer, "
            "larger chunks cost the engine and the proxy less per token; the harness gets its "
            "text in bursts. None: the engine's own setting (one token per chunk by default). "
            "Check the engine's tool-call parser with it first (docs/deploy.md)."
        ),
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
    url: str = Field(
        "sqlite+aiosqlite:///./capture.db",
        description="The store's database: `sqlite:///path` or `postgresql://user@host/db` "
        "(the async driver, aiosqlite or asyncpg, is added when not named).",
    )
    echo: bool = False
    sqlite_synchronous: Literal["FULL", "NORMAL"] = Field(
        "FULL",
        description="What a completed call survives on SQLite (WAL): FULL (default) fsyncs "
        "every commit holding a completion or a failure — a process crash and a power loss "
        "(admissions alone are synced by the next such commit); NORMAL syncs at checkpoints only "
        "— a process crash, not a power loss. Responses are released after the commit either way.",
    )
    max_batch: int = Field(
        256, ge=1, description="Most operations the store writer commits in one transaction."
    )
    lease_s: float = Field(
        15.0,
        gt=0,
        description="Lease of a proxy instance on the calls it admits, renewed every third of it."
        " A killed instance's unresolved calls become failed (proxy_restart) within 4/3 of this,"
        " as long as another instance runs; at once when a run of the same name starts.",
    )
    instance_name: str | None = Field(
        None,
        description="This process's name in the store, kept across restarts; a new run of the "
        "same name resolves the earlier run's unresolved calls at start. `serve` uses host:port; "
        "none (the default elsewhere) gives every run its own name.",
    )

    @field_validator("url")
    @classmethod
    def _async_driver(cls, value: str) -> str:
        try:
            return store_url(value)
        except InvalidSettings as exc:  # (pydantic reports ValueError as the field's error)
            raise ValueError(exc.message) from None


#: The hard ceiling of ``limits.max_n`` (each choice is its own recorded call).
MAX_N_CEILING = 128
#: Shortest admin key accepted: a guessable key is no access control.
MIN_ADMIN_KEY_CHARS = 16


class LimitsSettings(BaseModel):
    """What one request may ask for; a request over a limit is answered 4xx before admission."""

    max_body_bytes: int = Field(
        32 * 1024 * 1024,
        ge=1024,
        description="Largest request body (bytes): larger ones are answered 413 without reading"
        " the rest (checked on Content-Length up front and while the body streams in).",
    )
    max_n: int = Field(
        16, ge=1, le=MAX_N_CEILING, description="Largest `n` (choices per request) admitted."
    )
    vocab_size: int | None = Field(
        None,
        ge=1,
        description="Token ids a completions prompt may hold are 0 … vocab_size-1. Unset: asked"
        " of the engine once per process (capture_proxy/vocabulary.py).",
    )


class AuthSettings(BaseModel):
    """Access control (capture_proxy/api/auth.py). Without an admin key everything is open,
    which ``capture-proxy serve`` allows on a loopback address only."""

    admin_key: SecretStr | None = Field(
        None,
        description="Bearer key for episode management; with it each episode gets its own"
        " API key for its OpenAI endpoints (answered once by POST /episodes).",
    )

    @model_validator(mode="after")
    def _long_enough(self) -> AuthSettings:
        key = self.admin_key
        if key is not None and len(key.get_secret_value()) < MIN_ADMIN_KEY_CHARS:
            raise ValueError(f"auth.admin_key needs at least {MIN_ADMIN_KEY_CHARS} characters")
        return self


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


class WeightSettings(BaseModel):
    """The served policy version (capture_proxy/weights.py, the ``/weights`` routes)."""

    initial_version: int = Field(
        0, ge=0, description="Version recorded on calls until the first POST /weights/resume."
    )
    hold_limit_s: float = Field(
        600.0,
        gt=0,
        description="A pause not resumed within this time expires (the gate reopens on the old"
        " version), so a trainer that died cannot hold calls forever.",
    )
    engine_version_path: str | None = Field(
        "/weight_info",
        description='Engine route answering `{"weight_version": …}` (vLLM\'s, in its dev mode);'
        " a resume without a version takes the engine's when it is an integer. None: never ask.",
    )


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter=NESTED, extra="ignore"
    )

    host: str = "127.0.0.1"
    port: int = 8100
    public_url: str | None = Field(
        None, description="Base URL clients use to reach the proxy (for `base_url` answers)."
    )
    close_poll_interval_s: float = 0.05
    keep_alive_s: int = Field(
        75,
        ge=1,
        description="How long `serve` keeps an idle client connection open (uvicorn's keep-alive)."
        " Longer than the clients' own idle expiry (httpx and the OpenAI SDKs: 5 s), so a harness"
        " never sends a call on a connection the proxy is closing at that moment (the client would"
        " see the connection drop; uvicorn's default is those same 5 s).",
    )
    upstream: UpstreamSettings = Field(default_factory=UpstreamSettings)
    store: StoreSettings = Field(default_factory=StoreSettings)
    attribution: AttributionSettings = Field(default_factory=AttributionSettings)
    limits: LimitsSettings = Field(default_factory=LimitsSettings)
    auth: AuthSettings = Field(default_factory=AuthSettings)
    weights: WeightSettings = Field(default_factory=WeightSettings)
    continuation: ContinuationMode = Field(
        "stitch",
        description="`stitch` (default): continue an agent on its own sampled tokens (the"
        " stitched prompt from vLLM's render route, which needs --enable-scale-out; without it"
        " each call falls back to a fresh render, reason `token_path_unavailable`; the stitched"
        " ids go to the chat route in `kv_transfer_params.prompt_token_ids`); `passthrough`:"
        " forward chat requests as sent (engines without a render route).",
    )
    continuation_cache_agents: int = Field(
        4096,
        ge=1,
        description="How many (episode, agent) call indexes stitching keeps in memory (least "
        "recently used out; an evicted one is read back from the store when needed).",
    )
    end_of_turn_token: str = Field(
        "<|im_end|>", description="The chat template's end-of-turn token (stitching)."
    )
    continuation_template_dir: Path | None = Field(
        None,
        description="The served model's directory (`tokenizer.json`, and the chat template in"
        " `chat_template.jinja` or `tokenizer_config.json`): stitched calls are then rendered in"
        " the proxy instead of by the engine's render route, once a stitch of the same head"
        " shape has shown both renders give the same ids (rechecked every 32nd; needs the"
        " `render` extra: jinja2, tokenizers). Unset: the engine renders every stitched call.",
    )

    @property
    def local_url(self) -> str:
        """This process's own address (``host``/``port``; a wildcard bind means loopback)."""
        host = "127.0.0.1" if self.host in {"0.0.0.0", "::", ""} else self.host
        return f"http://{host}:{self.port}"


def _groups() -> dict[str, type[BaseModel]]:
    """Top-level fields that are nested groups (set as ``CAPTURE_PROXY_<GROUP>__<FIELD>``)."""
    out: dict[str, type[BaseModel]] = {}
    for name, info in Settings.model_fields.items():
        kind = info.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            out[name] = kind
    return out


def env_name(loc: tuple[str | int, ...]) -> str:
    """The variable that sets the field at ``loc``: ``("upstream", "url")`` → ``…UPSTREAM__URL``."""
    return ENV_PREFIX + NESTED.join(str(part).upper() for part in loc)


def setting_variables() -> Iterator[str]:
    """Every variable name that sets a field: top-level fields, and each field of each group."""
    groups = _groups()
    for name in Settings.model_fields:
        yield env_name((name,))
        for sub in groups[name].model_fields if name in groups else ():
            yield env_name((name, sub))


def _check_groups(environ: Mapping[str, str]) -> None:
    """A group set as a plain value (``CAPTURE_PROXY_UPSTREAM=http://…``): say what it wants."""
    for name, group in _groups().items():
        value = environ.get(env_name((name,)))
        if value is None:
            continue
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            fields = ", ".join(env_name((name, sub)) for sub in group.model_fields)
            raise InvalidSettings(
                f"{env_name((name,))}={value!r}: this is a group of settings; set its fields "
                f"({fields}) or a JSON object",
                param=env_name((name,)),
            )


#: Settings whose value is never echoed in an error: a database URL may hold a password.
_UNSHOWN = {("store", "url")}


def _one_line(exc: ValidationError) -> InvalidSettings:
    first = exc.errors()[0]
    loc = tuple(first.get("loc", ()))
    variable = env_name(loc) if loc else ENV_PREFIX + "*"
    shown = "" if loc in _UNSHOWN else f"={first.get('input')!r}"
    expects = str(first.get("msg", "an invalid value")).replace("Input should be", "expects")
    expects = expects.removeprefix("Value error, ")
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return InvalidSettings(f"{variable}{shown}: {expects}{more}", param=variable)


def load_settings(environ: Mapping[str, str] | None = None) -> Settings:
    """``Settings()`` from the environment, or one :class:`InvalidSettings` line."""
    environ = os.environ if environ is None else environ
    _check_groups(environ)
    try:
        return Settings()
    except ValidationError as exc:
        raise _one_line(exc) from None
    except PydanticSettingsError as exc:  # a value that is not even parseable (JSON groups)
        raise InvalidSettings(f"{ENV_PREFIX}*: {exc}") from None


def env_warnings(environ: Mapping[str, str] | None = None) -> list[str]:
    """``CAPTURE_PROXY_*`` variables that name no setting (and are therefore ignored)."""
    environ = os.environ if environ is None else environ
    known = set(setting_variables())
    groups = {env_name((g,)) for g in _groups()}
    dicts = known - groups  # a key under one of these is a key inside a dict setting
    out = []
    for name in sorted(environ):
        upper = name.upper()
        if not upper.startswith(ENV_PREFIX) or upper in known:
            continue
        field = next((k for k in dicts if upper.startswith(k + NESTED)), None)
        if field is None:
            out.append(
                f"{name} names no setting and is ignored (settings: capture_proxy/settings.py; "
                f"nested groups use {NESTED!r}, e.g. {ENV_PREFIX}UPSTREAM{NESTED}URL)"
            )
        else:  # a key inside a dict setting: its value stays a string
            key = upper[len(field) + len(NESTED) :].lower()
            out.append(
                f"{name} sets {key!r} to the string {environ[name]!r}; for a number or a "
                f"boolean set {field} to a JSON object instead"
            )
    return out


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return load_settings()

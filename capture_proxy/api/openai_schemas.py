"""Wire schemas of the OpenAI-compatible routes: permissive request bodies, the error body.

These models describe the routes in the OpenAPI document and type-check the fields the proxy and
every OpenAI server agree on, before a call is admitted. They tolerate unknown fields (clients
send vLLM's extras, which are forwarded as sent); the proxy forwards the client's own dict, never a
re-serialised model. The rest of a body is the engine's to judge (its 4xx then fails the call).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, NotRequired

from pydantic import BaseModel, ConfigDict, Field
from typing_extensions import TypedDict  # pydantic needs this one before Python 3.12

#: Longest ``model`` name: it is recorded with every call (a 200-character column).
MAX_MODEL_CHARS = 200


class _Permissive(BaseModel):
    """Unknown fields allowed; known ones strictly typed (JSON's types: ``"5"`` is no integer)."""

    model_config = ConfigDict(extra="allow", strict=True)


class ChatMessage(TypedDict):
    """One message (a TypedDict: validated without building a model per message, ~4× faster
    on long conversations; benchmarks/bench_input_checks.py)."""

    __pydantic_config__ = ConfigDict(extra="allow", strict=True)  # type: ignore[misc]

    role: Annotated[str, Field(description="system, developer, user, assistant or tool.")]
    content: NotRequired[str | list[dict[str, Any]] | None]


class _Sampling(_Permissive):
    model: str | None = Field(None, max_length=MAX_MODEL_CHARS)
    stream: bool | None = None
    n: int | None = Field(None, description="Choices; each is recorded as its own call.")
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream_options: dict[str, Any] | None = None


class ChatCompletionBody(_Sampling):
    """``POST …/v1/chat/completions``: the OpenAI chat request (unknown fields forwarded)."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    tools: list[dict[str, Any]] | None = None


class CompletionBody(_Sampling):
    """``POST …/v1/completions``: one prompt, as text or as token ids (ids below the engine's
    vocabulary size). A batch of several prompts is refused: each call records one prompt."""

    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="Text, token ids, or a one-element list of either."
    )
    logprobs: int | None = Field(None, ge=0)
    echo: bool | None = None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorBody(BaseModel):
    """OpenAI's error shape, on every 4xx and 5xx this service answers."""

    error: ErrorDetail


def _error(description: str) -> dict[str, Any]:
    return {"model": ErrorBody, "description": description}


#: Error answers declared on every route (FastAPI's own 422 is answered 400 here).
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: _error("Malformed body, wrong types, a value over a limit."),
    401: _error("Missing or wrong key (when the proxy runs with an admin key)."),
    404: _error("Unknown episode or call."),
    409: _error("The episode is not open, or the request conflicts with its state."),
    413: _error("The body is over limits.max_body_bytes (answered without reading it)."),
}

#: Further answers of the routes that reach the engine.
UPSTREAM_RESPONSES: dict[int | str, dict[str, Any]] = {
    **ERROR_RESPONSES,
    429: _error("The engine is overloaded (its own answer, passed through)."),
    500: _error("The engine failed (its own answer, passed through)."),
    502: _error("The engine is unreachable or answered nonsense."),
    504: _error("The engine timed out."),
}


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorBody(BaseModel):
    """Anthropic's error shape, on every error of the Messages routes."""

    type: Literal["error"]
    error: AnthropicErrorDetail


def _anthropic_error(description: str) -> dict[str, Any]:
    return {"model": AnthropicErrorBody, "description": description}


#: The Messages routes' error answers (Anthropic's shape).
MESSAGES_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: _anthropic_error(str(answer["description"]))
    for status, answer in UPSTREAM_RESPONSES.items()
}
#: A translated route's answer: JSON, or its SSE stream when ``stream`` is true.
TRANSLATED_ANSWER: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The API's answer (JSON), or its SSE stream when `stream` is true.",
        "content": {
            "application/json": {"schema": {"type": "object"}},
            "text/event-stream": {"schema": {"type": "string"}},
        },
    }
}

"""The checks an OpenAI request passes before it is admitted (each failure a 400, nothing recorded).

Types of the common fields (:mod:`capture_proxy.api.openai_schemas`), ``n`` up to
``limits.max_n``, a completions prompt that is one prompt, and token ids in
``0 … vocab_size - 1`` (the engine's, :mod:`capture_proxy.engine_vocab`).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from capture_contracts.vocabulary import Endpoint
from capture_proxy.api.json_body import check_label
from capture_proxy.api.openai_schemas import ChatCompletionBody, CompletionBody
from capture_proxy.errors import BadRequest
from capture_proxy.settings import LimitsSettings

_BODIES: dict[Endpoint, type[BaseModel]] = {
    "chat": ChatCompletionBody,
    "completions": CompletionBody,
}


def _bad_types(exc: ValidationError) -> BadRequest:
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first["loc"])
    return BadRequest(f"{where}: {first['msg']}", param=str(first["loc"][0]))


def check_types(endpoint: Endpoint, body: Any) -> BaseModel:
    """The body as its permissive model (coerced values, for the checks only; never forwarded)."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    try:
        checked = _BODIES[endpoint].model_validate(body)
    except ValidationError as exc:
        raise _bad_types(exc) from None
    if isinstance(body.get("model"), str):
        check_label(body["model"], "model")
    return checked


def check_n(body: dict[str, Any], limits: LimitsSettings) -> None:
    n = body.get("n")
    if n is not None and not (isinstance(n, int) and 1 <= n <= limits.max_n):
        raise BadRequest(f"`n` must be between 1 and {limits.max_n} (limits.max_n)", param="n")


def prompt_token_ids(prompt: Any) -> list[int] | None:
    """The token ids of a completions prompt, None for a text prompt; BadRequest for a batch
    or an empty prompt (a call is recorded with its prompt's tokens: there would be none)."""
    if prompt == "":
        raise BadRequest("`prompt` is empty", param="prompt")
    if isinstance(prompt, list):
        if not prompt:
            raise BadRequest("`prompt` is an empty list", param="prompt")
        if isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise BadRequest(
                    f"`prompt` holds {len(prompt)} prompts; send one per request "
                    "(each request is recorded as one prompt)",
                    param="prompt",
                )
            return prompt_token_ids(prompt[0])
        return [int(token) for token in prompt]
    return None


def check_token_ids(ids: list[int], vocab_size: int | None) -> None:
    low, high = min(ids), max(ids)
    if low < 0:
        raise BadRequest(f"`prompt` holds token id {low}; ids are never negative", param="prompt")
    if vocab_size is not None and high >= vocab_size:
        raise BadRequest(
            f"`prompt` holds token id {high}, out of the engine's vocabulary "
            f"(ids 0 to {vocab_size - 1})",
            param="prompt",
            code="token_id_out_of_vocabulary",
        )

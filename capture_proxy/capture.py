"""What the proxy asks the engine for, what it keeps, and what the harness gets back.

Pure functions over JSON dicts (no I/O): upstream body preparation (DESIGN §3), extraction of
exact prompt ids / sampled ids / logprobs from vLLM answers (whole or streamed), and removal of
the fields the harness did not ask for.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from capture_contracts.vocabulary import Constraint, Endpoint
from capture_proxy.errors import BadRequest, UpstreamError
from capture_proxy.settings import MAX_N_CEILING, UpstreamSettings
from capture_proxy.store.records import Generation

#: The service's backstop; the API layer refuses `n` above the configured limits.max_n first.
MAX_N = MAX_N_CEILING


@dataclass(frozen=True, slots=True)
class ClientWants:
    """Which capture fields the harness itself asked for (those are left in its answer)."""

    logprobs: bool
    token_ids: bool


def request_n(body: dict[str, Any]) -> int:
    n = body.get("n", 1)
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise BadRequest(f"`n` must be an integer between 1 and {MAX_N}", param="n")
    return n


def validate_body(endpoint: Endpoint, body: dict[str, Any]) -> None:
    if endpoint == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("`messages` must be a non-empty list", param="messages")
        if not all(isinstance(m, dict) for m in messages):
            raise BadRequest("every message must be an object", param="messages")
    elif "prompt" not in body:
        raise BadRequest("`prompt` is required", param="prompt")
    if "stream" in body and not isinstance(body["stream"], bool | None):
        raise BadRequest("`stream` must be a boolean", param="stream")
    request_n(body)


def prepare_upstream_body(
    endpoint: Endpoint, body: dict[str, Any], settings: UpstreamSettings
) -> tuple[dict[str, Any], ClientWants]:
    """The body sent to the engine: token ids and logprobs requested, a streamed request's
    ``stream_interval`` and the overrides applied.

    Only top-level keys are set, so a shallow copy keeps ``body`` as it came (a deep copy of
    a harness's 50 kB request cost ~0.19 ms per call; nothing downstream mutates its parts).
    """
    upstream = dict(body)
    wants = ClientWants(
        logprobs=bool(body.get("logprobs")),
        token_ids=bool(body.get("return_token_ids")),
    )
    upstream["return_token_ids"] = True
    if endpoint == "chat":
        upstream["logprobs"] = True
    else:
        current = body.get("logprobs")
        upstream["logprobs"] = max(int(current), 1) if isinstance(current, int) else 1
    if settings.stream_interval is not None and body.get("stream") is True:
        upstream.setdefault("stream_interval", settings.stream_interval)  # (the harness's wins)
    if settings.overrides:
        upstream.update(copy.deepcopy(settings.overrides))
    if settings.served_model is not None:
        upstream["model"] = settings.served_model
    return upstream, wants


#: ``structured_outputs`` keys (and vLLM's older ``guided_*`` fields) → the constraint they impose.
_STRUCTURED: dict[str, Constraint] = {
    "regex": "regex",
    "json": "json",
    "choice": "choice",
    "grammar": "grammar",
    "structural_tag": "structural_tag",
    "json_object": "json_object",
}
_GUIDED: dict[str, Constraint] = {
    "guided_regex": "regex",
    "guided_json": "json",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def request_constraint(body: dict[str, Any]) -> Constraint | None:
    """The grammar the engine will decode this request under, if any.

    vLLM applies a grammar's token bitmask to the logits at every decoding step of such a
    request and reports the logprobs of the masked distribution, so all of its completion tokens
    are constrained: structured outputs (``structured_outputs``, ``guided_*``), a JSON
    ``response_format``, or a ``tool_choice`` that forces a tool call (``"required"`` or a named
    function; vLLM enforces it with a JSON-schema grammar).
    """
    structured = body.get("structured_outputs")
    if isinstance(structured, dict):
        for key, kind in _STRUCTURED.items():
            if structured.get(key) not in (None, False):
                return kind
    for key, kind in _GUIDED.items():
        if body.get(key) is not None:
            return kind
    response_format = body.get("response_format")
    if isinstance(response_format, dict):
        kind_name = response_format.get("type")
        if kind_name == "json_schema":
            return "json"
        if kind_name == "json_object":
            return "json_object"
        if kind_name == "structural_tag":
            return "structural_tag"
    tool_choice = body.get("tool_choice")
    if body.get("tools") and (tool_choice == "required" or isinstance(tool_choice, dict)):
        return "tool_choice"
    return None


# -- extraction -----------------------------------------------------------------------------


_FLOAT = frozenset({float})
_NUMBERS = frozenset({float, int})  # (not bool: ``true`` is no log-probability)


def _choice_logprobs(endpoint: Endpoint, choice: dict[str, Any]) -> list[float]:
    """The sampled tokens' log-probabilities (numbers, never converted from text). The types
    are checked all at once (``map(type, …)``): a call per token would cost 5× the reading."""
    logprobs = choice.get("logprobs")
    if not isinstance(logprobs, dict):
        return []
    try:
        if endpoint == "chat":
            values = [item["logprob"] for item in logprobs.get("content") or []]
        else:
            values = [0.0 if v is None else v for v in logprobs.get("token_logprobs") or []]
    except (KeyError, TypeError) as exc:
        raise UpstreamError(f"the engine's log-probabilities are not numbers: {exc!r}") from None
    kinds = set(map(type, values))
    if kinds <= _FLOAT:  # (as vLLM sends them)
        return values
    if not kinds <= _NUMBERS:
        wrong = next(v for v in values if type(v) not in _NUMBERS)
        raise UpstreamError(f"the engine's log-probabilities are not numbers: {wrong!r}")
    return list(map(float, values))


def _ids(value: Any, what: str) -> list[Any]:
    """A list of token ids as the engine sent it (its items are checked when packed)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise UpstreamError(f"the engine's {what} is not a list of token ids")
    return value


def _check(call: str, gen: Generation) -> Generation:
    if not gen.prompt_token_ids:
        raise UpstreamError(f"{call}: the engine returned no prompt_token_ids")
    if gen.finish_reason is not None and not isinstance(gen.finish_reason, str):
        raise UpstreamError(f"{call}: the engine's finish_reason is not a string")
    if gen.usage is not None and not isinstance(gen.usage, dict):
        raise UpstreamError(f"{call}: the engine's usage is not a JSON object")
    if len(gen.completion_token_ids) != len(gen.completion_logprobs):
        raise UpstreamError(
            f"{call}: {len(gen.completion_token_ids)} token ids but "
            f"{len(gen.completion_logprobs)} logprobs from the engine"
        )
    return gen


def _objects(payload: Any, what: str) -> list[dict[str, Any]]:
    """The choices of an answer or chunk that is a JSON object, each one an object (else an
    UpstreamError: the engine's answer is not what the capture can read)."""
    if not isinstance(payload, dict):
        raise UpstreamError(f"the engine's {what} is not a JSON object")
    choices = payload.get("choices") or []
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
        raise UpstreamError(f"the choices of the engine's {what} are not a list of JSON objects")
    for choice in choices:
        index = choice.get("index", 0)
        if isinstance(index, bool) or not isinstance(index, int):
            raise UpstreamError(f"a choice index of the engine's {what} is not an integer")
    return choices


def generations_from_response(
    endpoint: Endpoint, payload: dict[str, Any], n: int
) -> list[Generation]:
    """One Generation per choice of a whole (non-streamed) answer, ordered by choice index."""
    choices = sorted(_objects(payload, "answer"), key=lambda c: c.get("index", 0))
    if len(choices) != n:
        raise UpstreamError(f"expected {n} choices from the engine, got {len(choices)}")
    top_prompt = payload.get("prompt_token_ids")
    usage = payload.get("usage")
    generations = []
    for choice in choices:
        prompt = choice.get("prompt_token_ids") or top_prompt or []
        gen = Generation(
            prompt_token_ids=list(_ids(prompt, "prompt_token_ids")),
            completion_token_ids=list(_ids(choice.get("token_ids"), "token_ids")),
            completion_logprobs=_choice_logprobs(endpoint, choice),
            finish_reason=choice.get("finish_reason"),
            usage=usage,
        )
        generations.append(_check(f"choice {choice.get('index', 0)}", gen))
    return generations


@dataclass(slots=True)
class _ChoiceState:
    prompt: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass(slots=True)
class StreamCapture:
    """Accumulates the tokens of a streamed answer chunk by chunk."""

    endpoint: Endpoint
    n: int
    prompt: list[int] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    choices: dict[int, _ChoiceState] = field(default_factory=dict)

    def feed(self, chunk: dict[str, Any]) -> None:
        choices = _objects(chunk, "stream chunk")
        if chunk.get("prompt_token_ids"):
            self.prompt = list(_ids(chunk["prompt_token_ids"], "prompt_token_ids"))
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in choices:
            state = self.choices.setdefault(int(choice.get("index", 0)), _ChoiceState())
            if choice.get("prompt_token_ids"):
                state.prompt = list(_ids(choice["prompt_token_ids"], "prompt_token_ids"))
            state.ids.extend(_ids(choice.get("token_ids"), "token_ids"))
            state.logprobs.extend(_choice_logprobs(self.endpoint, choice))
            if choice.get("finish_reason") is not None:
                state.finish_reason = choice["finish_reason"]

    def generations(self) -> list[Generation]:
        if sorted(self.choices) != list(range(self.n)):
            raise UpstreamError(
                f"expected {self.n} choices in the stream, got indices {sorted(self.choices)}"
            )
        return [
            _check(
                f"choice {i}",
                Generation(
                    prompt_token_ids=state.prompt or self.prompt,
                    completion_token_ids=state.ids,
                    completion_logprobs=state.logprobs,
                    finish_reason=state.finish_reason,
                    usage=self.usage,
                ),
            )
            for i, state in sorted(self.choices.items())
        ]


# -- what the harness receives --------------------------------------------------------------


def scrub(payload: dict[str, Any], wants: ClientWants) -> dict[str, Any]:
    """Remove the capture fields the harness did not ask for (in place; returns payload)."""
    if not wants.token_ids:
        payload.pop("prompt_token_ids", None)
        payload.pop("prompt_logprobs", None)
    for choice in payload.get("choices") or []:
        if not wants.token_ids:
            choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)
            choice.pop("prompt_logprobs", None)
        if not wants.logprobs and "logprobs" in choice:
            choice["logprobs"] = None
    return payload

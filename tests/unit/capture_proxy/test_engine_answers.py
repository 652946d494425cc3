"""What the capture reads from the engine's answers: token ids and log-probabilities as the engine
sent them, and an UpstreamError (the engine's fault, 502) for what is not — never a conversion."""

from __future__ import annotations

from typing import Any

import pytest

from capture_proxy.capture import StreamCapture, generations_from_response
from capture_proxy.errors import UpstreamError


def _chat(token_ids: Any = None, logprobs: Any = None, prompt: Any = None) -> dict[str, Any]:
    content = logprobs if logprobs is not None else [{"logprob": -0.5}, {"logprob": -1}]
    return {
        "prompt_token_ids": [1, 2, 3] if prompt is None else prompt,
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "token_ids": [4, 5] if token_ids is None else token_ids,
                "logprobs": {"content": content},
            }
        ],
    }


def test_an_answer_as_the_engine_sends_it_is_captured() -> None:
    [gen] = generations_from_response("chat", _chat(), 1)
    assert (gen.prompt_token_ids, gen.completion_token_ids) == ([1, 2, 3], [4, 5])
    assert gen.completion_logprobs == [-0.5, -1.0]
    completion = {
        "choices": [
            {
                "index": 0,
                "prompt_token_ids": [1],
                "token_ids": [4, 5],
                "logprobs": {"token_logprobs": [None, -0.25]},  # (vLLM: None for no logprob)
            }
        ]
    }
    [gen] = generations_from_response("completions", completion, 1)
    assert gen.completion_logprobs == [0.0, -0.25]


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (_chat(token_ids=5), "token_ids is not a list of token ids"),
        (_chat(prompt="1 2 3"), "prompt_token_ids is not a list of token ids"),
        (_chat(logprobs=[{"logprob": "-0.5"}, {"logprob": -1}]), "log-probabilities are not"),
        (_chat(logprobs=[{"logprob": True}, {"logprob": -1}]), "log-probabilities are not"),
        (_chat(logprobs=[{"token": "a"}, {"logprob": -1}]), "log-probabilities are not"),
        (_chat(logprobs=[-0.5, -1]), "log-probabilities are not"),
        (_chat() | {"usage": [1]}, "usage is not a JSON object"),
        ({"prompt_token_ids": [1], "choices": [{"index": "0"}]}, "choice index .* not an integer"),
        (
            {"prompt_token_ids": [1], "choices": [{"index": 0, "finish_reason": 1}]},
            "finish_reason is not a string",
        ),
    ],
    ids=[
        "ids not a list",
        "prompt a string",
        "logprob text",
        "logprob bool",
        "no logprob",
        "bare",
        "usage a list",
        "index a string",
        "finish_reason a number",
    ],
)
def test_what_is_not_ids_or_numbers_is_the_engines_fault(answer: Any, message: str) -> None:
    with pytest.raises(UpstreamError, match=message):
        generations_from_response("chat", answer, 1)


def test_a_streamed_chunk_with_ids_that_are_not_a_list_is_the_engines_fault() -> None:
    capture = StreamCapture("chat", 1)
    capture.feed({"prompt_token_ids": [1, 2], "choices": []})
    capture.feed({"choices": [{"index": 0, "token_ids": [4], "logprobs": {"content": []}}]})
    with pytest.raises(UpstreamError, match="token_ids is not a list"):
        capture.feed({"choices": [{"index": 0, "token_ids": 4}]})
    with pytest.raises(UpstreamError, match="prompt_token_ids is not a list"):
        capture.feed({"prompt_token_ids": 7, "choices": []})
    with pytest.raises(UpstreamError, match="log-probabilities are not numbers"):
        capture.feed({"choices": [{"index": 0, "logprobs": {"content": [{"logprob": "x"}]}}]})
    with pytest.raises(UpstreamError, match="choice index of the engine's stream chunk"):
        capture.feed({"choices": [{"index": None, "token_ids": [4]}]})
    capture.feed({"choices": [{"index": 0, "finish_reason": ["stop"]}]})
    with pytest.raises(UpstreamError, match="finish_reason is not a string"):
        capture.generations()

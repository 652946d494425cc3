"""What a harness receives from the token-in path has the chat shape of the pass-through path."""

from __future__ import annotations

from capture_proxy.capture import StreamCapture
from capture_proxy.derender import (
    TokenRequest,
    chat_answer,
    chat_logprobs,
    for_derender,
    with_end_of_turn_logprob,
)

EOT = 2


def _token(*, spelled_logprobs: bool) -> TokenRequest:
    return TokenRequest(
        [1, 2],
        {},
        {},
        end_of_turn_id=EOT,
        end_of_turn="<|im_end|>",
        spelled_logprobs=spelled_logprobs,
    )


def test_generate_logprobs_become_chat_logprobs() -> None:
    generated = {
        "content": [
            {"token_id": 17, "logprob": -0.25, "rank": 1, "top_logprobs": []},
            {
                "token_id": 4,
                "logprob": -1.5,
                "rank": 2,
                "top_logprobs": [{"token_id": 9, "logprob": -0.5}],
            },
        ]
    }
    chat = chat_logprobs(generated)
    assert chat == {
        "content": [
            {"token": "token_id:17", "logprob": -0.25, "bytes": None, "top_logprobs": []},
            {
                "token": "token_id:4",
                "logprob": -1.5,
                "bytes": None,
                "top_logprobs": [{"token": "token_id:9", "logprob": -0.5, "bytes": None}],
            },
        ]
    }
    assert chat_logprobs(None) is None and chat_logprobs({"content": None}) is None
    # the capture reads the same numbers from the chat shape
    capture = StreamCapture("chat", 1)
    capture.feed({"prompt_token_ids": [1, 2]})
    capture.feed({"choices": [{"index": 0, "token_ids": [17, 4], "logprobs": chat}]})
    [gen] = capture.generations()
    assert gen.completion_token_ids == [17, 4] and gen.completion_logprobs == [-0.25, -1.5]


def test_chat_answer_carries_capture_fields_and_tool_finish_reason() -> None:
    derendered = {
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"tool_calls": [{"id": "t"}]}}]
    }
    generated = {"choices": [{"index": 0, "token_ids": [5, 6]}], "usage": {"total_tokens": 4}}
    answer = chat_answer(derendered, generated, _token(spelled_logprobs=True))
    assert answer["prompt_token_ids"] == [1, 2]
    assert answer["choices"][0]["token_ids"] == [5, 6]
    assert answer["choices"][0]["finish_reason"] == "tool_calls"
    assert answer["usage"] == {"total_tokens": 4}


def test_derender_is_sent_no_logprobs_unless_the_harness_reads_their_tokens() -> None:
    entries = [{"token_id": t, "logprob": -0.1 * t} for t in (7, 8, EOT)]
    generated = {
        "choices": [{"index": 0, "token_ids": [7, 8, EOT], "logprobs": {"content": entries}}]
    }
    bare = for_derender(generated, EOT, logprobs=False)
    assert bare["choices"] == [{"index": 0, "token_ids": [7, 8]}]
    derendered = {"choices": [{"index": 0, "message": {"content": "hi"}, "logprobs": None}]}
    answer = chat_answer(derendered, generated, _token(spelled_logprobs=False))
    # the capture's numbers come from the engine's answer, the end-of-turn's included
    content = answer["choices"][0]["logprobs"]["content"]
    assert [c["logprob"] for c in content] == [e["logprob"] for e in entries]
    assert content[0]["token"] == "token_id:7"
    # where the harness reads the tokens, derender's spelling is kept
    spelled = {"choices": [{"index": 0, "logprobs": {"content": [{"token": "a"}]}}]}
    kept = chat_answer(spelled, generated, _token(spelled_logprobs=True))
    assert kept["choices"][0]["logprobs"] == {"content": [{"token": "a"}]}


def test_end_of_turn_is_hidden_from_derender_and_given_back_to_capture() -> None:
    eot = EOT
    generated = {
        "choices": [
            {
                "index": 0,
                "token_ids": [7, 8, eot],
                "logprobs": {
                    "content": [{"token_id": t, "logprob": -0.1 * t} for t in (7, 8, eot)]
                },
            },
            {"index": 1, "token_ids": [7, 9], "logprobs": {"content": []}},  # stopped on length
        ]
    }
    trimmed = for_derender(generated, eot, logprobs=True)
    assert [c["token_ids"] for c in trimmed["choices"]] == [[7, 8], [7, 9]]
    assert len(trimmed["choices"][0]["logprobs"]["content"]) == 2
    assert generated["choices"][0]["token_ids"] == [7, 8, eot]  # the capture keeps what was sampled

    token = _token(spelled_logprobs=True)
    answer = {
        "choices": [
            {"index": 0, "logprobs": {"content": [{"token": "a"}, {"token": "b"}]}},
            {"index": 1, "logprobs": None},
        ]
    }
    content = with_end_of_turn_logprob(answer, generated, token)["choices"][0]["logprobs"][
        "content"
    ]
    assert len(content) == 3
    assert content[-1]["token"] == "<|im_end|>"
    assert content[-1]["logprob"] == -0.1 * eot

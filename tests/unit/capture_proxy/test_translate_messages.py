"""Anthropic Messages ⇄ chat (pure translators): requests, whole answers, stream events."""

from __future__ import annotations

import json
from typing import Any

import pytest

from capture_proxy.errors import BadRequest
from capture_proxy.translate import messages as tm
from capture_proxy.translate.messages_stream import MessageStream

TOOLS = [
    {
        "name": "Bash",
        "description": "Run a command",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}},
    },
    {"type": "web_search_20250305", "name": "web_search"},  # a server tool: not forwarded
]


def claude_request(**extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "max_tokens": 32000,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.328.593;"},
            {"type": "text", "text": "You are a Claude agent.", "cache_control": {"type": "x"}},
            {"type": "text", "text": "\nBe brief."},
        ],
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "<r>"}, {"type": "text", "text": "Count."}],
            },
            {"role": "system", "content": [{"type": "text", "text": "# Environment"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "s"},
                    {"type": "text", "text": "Counting."},
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "Bash",
                        "input": {"command": "ls"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [{"type": "text", "text": "3 apples"}],
                    },
                    {"type": "text", "text": "go on"},
                ],
            },
        ],
        "tools": TOOLS,
        "metadata": {"user_id": "{}"},
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": []},
        "output_config": {"effort": "high"},
        **extra,
    }


def test_request_maps_system_blocks_turns_tools_and_drops_harness_only_fields() -> None:
    chat = tm.to_chat_request(claude_request(stream=True, stop_sequences=["END"], temperature=1))
    assert chat["messages"] == [
        {"role": "system", "content": "You are a Claude agent.\nBe brief."},  # no billing header
        {
            "role": "user",
            "content": [{"type": "text", "text": "<r>"}, {"type": "text", "text": "Count."}],
        },
        {"role": "system", "content": "# Environment"},  # inline system turns stay in place
        {
            "role": "assistant",
            "content": "Counting.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "Bash", "arguments": '{"command": "ls"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "3 apples"},
        {"role": "user", "content": "go on"},
    ]
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "Bash",
                "parameters": TOOLS[0]["input_schema"],
                "description": "Run a command",
            },
        }
    ]
    assert chat["max_tokens"] == 32000 and chat["stop"] == ["END"] and chat["temperature"] == 1
    assert chat["stream"] is True and chat["stream_options"]["include_usage"] is True
    for dropped in ("metadata", "thinking", "context_management", "output_config", "system"):
        assert dropped not in chat


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"type": "auto"}, "auto"),
        ({"type": "any"}, "required"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "Bash"}, {"type": "function", "function": {"name": "Bash"}}),
    ],
)
def test_tool_choice(choice: dict[str, Any], expected: Any) -> None:
    assert tm.to_chat_request(claude_request(tool_choice=choice))["tool_choice"] == expected


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"messages": []}, "messages"),
        ({"model": 3}, "model"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0"),
        ({"messages": [{"role": "user", "content": [{"text": "no type"}]}]}, "messages.0"),
        ({"stream": "yes"}, "stream"),
    ],
)
def test_bad_requests_are_client_errors_naming_the_field(
    change: dict[str, Any], param: str
) -> None:
    with pytest.raises(BadRequest) as raised:
        tm.to_chat_request(claude_request(**change))
    assert raised.value.param == param


def test_count_tokens_request_needs_no_max_tokens() -> None:
    body = claude_request()
    del body["max_tokens"]
    chat = tm.to_chat_request(body, count_only=True)
    assert "max_tokens" not in chat and chat["tools"] and chat["messages"]


def test_error_shape() -> None:
    assert tm.error_body(404, "no episode") == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "no episode"},
    }
    engine = {"error": {"message": "boom", "type": "BadRequestError"}}
    assert tm.error_from_openai(500, engine)["error"] == {"type": "api_error", "message": "boom"}


def chat_answer(content: str | None, calls: list[dict[str, Any]], finish: str) -> dict[str, Any]:
    return {
        "id": "chatcmpl-abc",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content, "tool_calls": calls},
                "finish_reason": finish,
            }
        ],
        "usage": {"prompt_tokens": 20000, "completion_tokens": 12},
    }


def test_whole_answer_has_text_then_tool_use_blocks_and_the_engine_counts() -> None:
    call = {"id": "chatcmpl-tool-1", "function": {"name": "Bash", "arguments": '{"command": "ls"}'}}
    message = tm.from_chat_answer(chat_answer("Sure.", [call], "tool_calls"), "tiny")
    assert message["id"] == "msg_abc" and message["type"] == "message"
    assert message["content"] == [
        {"type": "text", "text": "Sure."},
        {"type": "tool_use", "id": "chatcmpl-tool-1", "name": "Bash", "input": {"command": "ls"}},
    ]
    assert message["stop_reason"] == "tool_use" and message["stop_sequence"] is None
    assert message["usage"]["input_tokens"] == 20000 and message["usage"]["output_tokens"] == 12


@pytest.mark.parametrize(
    ("finish", "stop", "reason"),
    [("stop", None, "end_turn"), ("length", None, "max_tokens"), ("stop", "END", "stop_sequence")],
)
def test_stop_reasons(finish: str, stop: str | None, reason: str) -> None:
    answer = chat_answer("x", [], finish)
    answer["choices"][0]["stop_reason"] = stop
    message = tm.from_chat_answer(answer, "tiny")
    assert message["stop_reason"] == reason
    assert message["stop_sequence"] == (stop if reason == "stop_sequence" else None)


def stream_chunks() -> list[dict[str, Any]]:
    """What the proxy relays for a text answer then two tool calls (vLLM's hermes parser)."""
    usage = {"prompt_tokens": 100, "completion_tokens": 0}
    return [
        {
            "id": "chatcmpl-s",
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
            "usage": usage,
        },
        {"id": "chatcmpl-s", "choices": [{"index": 0, "delta": {"content": "On "}}]},
        {"id": "chatcmpl-s", "choices": [{"index": 0, "delta": {"content": "it."}}]},
        {
            "id": "chatcmpl-s",
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "t0",
                                "type": "function",
                                "function": {"name": "Bash", "arguments": ""},
                            }
                        ]
                    },
                }
            ],
        },
        {
            "id": "chatcmpl-s",
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "tool_calls": [{"index": 0, "function": {"arguments": '{"command": "ls"}'}}]
                    },
                }
            ],
        },
        {
            "id": "chatcmpl-s",
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "tool_calls": [
                            {
                                "index": 1,
                                "id": "t1",
                                "type": "function",
                                "function": {"name": "Bash", "arguments": '{"command": "pwd"}'},
                            }
                        ]
                    },
                }
            ],
        },
        {"id": "chatcmpl-s", "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
        {
            "id": "chatcmpl-s",
            "choices": [],
            "usage": {"prompt_tokens": 100, "completion_tokens": 30},
        },
    ]


def test_stream_events_follow_the_messages_protocol() -> None:
    stream = MessageStream("tiny")
    events = [e for chunk in stream_chunks() for e in stream.feed(chunk)]
    assert "message_stop" not in [name for name, _ in events]  # only after [DONE]
    events += stream.finish()
    names = [name for name, _ in events]
    assert names == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert all(data["type"] == name for name, data in events)
    start = events[0][1]["message"]
    assert start["id"] == "msg_s" and start["usage"]["input_tokens"] == 100
    blocks = [d["content_block"] for n, d in events if n == "content_block_start"]
    assert [b["type"] for b in blocks] == ["text", "tool_use", "tool_use"]
    assert [b.get("id") for b in blocks[1:]] == ["t0", "t1"]
    indices = [d["index"] for n, d in events if n.startswith("content_block")]
    assert indices == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]
    deltas = [d["delta"] for n, d in events if n == "content_block_delta"]
    assert [d["text"] for d in deltas if d["type"] == "text_delta"] == ["On ", "it."]
    arguments = [d["partial_json"] for d in deltas if d["type"] == "input_json_delta"]
    assert [json.loads(a) for a in arguments] == [{"command": "ls"}, {"command": "pwd"}]
    final = events[-2][1]
    assert final["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert final["usage"]["output_tokens"] == 30 and final["usage"]["input_tokens"] == 100


def test_stream_error_event_has_the_anthropic_shape() -> None:
    stream = MessageStream("tiny")
    [(name, data)] = stream.error({"error": {"message": "closed", "type": "conflict_error"}})
    assert name == "error"
    assert data == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "closed"},
    }

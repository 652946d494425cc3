"""OpenAI Responses ⇄ chat (pure translators): requests, whole answers, stream events."""

from __future__ import annotations

import json
from typing import Any

import pytest

from capture_proxy.errors import BadRequest
from capture_proxy.translate import responses as tr
from capture_proxy.translate.responses_stream import ResponseStream

EXEC = {
    "type": "function",
    "name": "exec_command",
    "description": "Runs a command",
    "strict": False,
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
}
SPAWN = {"type": "function", "name": "spawn_agent", "parameters": {"type": "object"}}
TOOLS = [
    EXEC,
    {"type": "namespace", "name": "multi_agent_v1", "tools": [SPAWN]},
    {"type": "web_search", "external_web_access": False},  # hosted: not forwarded
]


def codex_request(**extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "instructions": "You are Codex.",
        "input": [
            {
                "type": "message",
                "role": "developer",
                "content": [{"type": "input_text", "text": "Rules."}],
            },
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Count."}],
            },
            {"type": "reasoning", "summary": [], "encrypted_content": "x"},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "On it."}],
            },
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "exec_command",
                "arguments": '{"cmd":"ls"}',
            },
            {
                "type": "function_call",
                "call_id": "c2",
                "name": "exec_command",
                "arguments": '{"cmd":"pwd"}',
            },
            {"type": "function_call_output", "call_id": "c1", "output": "3 apples"},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "/w"}],
            },
        ],
        "tools": TOOLS,
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "store": False,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "k",
        "reasoning": {"summary": "auto"},
        **extra,
    }


def test_request_maps_items_to_messages_and_flattens_namespace_tools() -> None:
    chat = tr.to_chat_request(codex_request(stream=True, max_output_tokens=64))
    assert chat["messages"] == [
        {"role": "system", "content": "You are Codex."},
        {"role": "system", "content": "Rules."},  # developer → system
        {"role": "user", "content": "Count."},
        {
            "role": "assistant",
            "content": "On it.",  # the function calls join the assistant message before them
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "exec_command", "arguments": '{"cmd":"ls"}'},
                },
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "exec_command", "arguments": '{"cmd":"pwd"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "3 apples"},
        {"role": "tool", "tool_call_id": "c2", "content": "/w"},
    ]
    assert [t["function"]["name"] for t in chat["tools"]] == ["exec_command", "spawn_agent"]
    assert chat["tool_choice"] == "auto" and chat["parallel_tool_calls"] is True
    assert chat["max_tokens"] == 64 and chat["stream"] is True
    for dropped in ("store", "include", "prompt_cache_key", "reasoning", "input"):
        assert dropped not in chat


def test_string_input_is_one_user_message() -> None:
    chat = tr.to_chat_request({"model": "tiny", "input": "hi"})
    assert chat["messages"] == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": []}, "input"),
        ({"input": [{"type": "message", "role": "robot", "content": "x"}]}, "input.0"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"model": None}, "model"),
    ],
)
def test_bad_requests_are_client_errors_naming_the_field(
    change: dict[str, Any], param: str
) -> None:
    with pytest.raises(BadRequest) as raised:
        tr.to_chat_request(codex_request(**change))
    assert raised.value.param == param


def test_whole_answer_items_namespace_and_usage() -> None:
    request = tr.Request.of(codex_request())
    answer = {
        "id": "chatcmpl-abc",
        "created": 5,
        "choices": [
            {
                "index": 0,
                "finish_reason": "tool_calls",
                "message": {
                    "content": "Spawning.",
                    "tool_calls": [
                        {"id": "t0", "function": {"name": "spawn_agent", "arguments": "{}"}},
                        {"id": "t1", "function": {"name": "exec_command", "arguments": "{}"}},
                    ],
                },
            }
        ],
        "usage": {"prompt_tokens": 9000, "completion_tokens": 7},
    }
    response = tr.from_chat_answer(answer, request)
    assert response["id"] == "resp_abc" and response["object"] == "response"
    assert response["status"] == "completed" and response["created_at"] == 5
    message, spawn, run = response["output"]
    assert message["type"] == "message" and message["content"][0]["text"] == "Spawning."
    assert (spawn["call_id"], spawn["name"], spawn["namespace"]) == (
        "t0",
        "spawn_agent",
        "multi_agent_v1",
    )
    assert (run["call_id"], run["name"], "namespace" in run) == ("t1", "exec_command", False)
    assert response["usage"]["input_tokens"] == 9000 and response["usage"]["total_tokens"] == 9007


def test_length_stop_is_incomplete() -> None:
    request = tr.Request.of(codex_request())
    answer = {"choices": [{"message": {"content": "x"}, "finish_reason": "length"}]}
    response = tr.from_chat_answer(answer, request)
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}


def test_stream_events_follow_the_responses_protocol() -> None:
    stream = ResponseStream(tr.Request.of(codex_request()))
    chunks = [
        {
            "id": "chatcmpl-s",
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
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
                                "function": {"name": "exec_command", "arguments": ""},
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
                        "tool_calls": [{"index": 0, "function": {"arguments": '{"cmd": "ls"}'}}]
                    },
                }
            ],
        },
        {"id": "chatcmpl-s", "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
        {"id": "chatcmpl-s", "choices": [], "usage": {"prompt_tokens": 50, "completion_tokens": 9}},
    ]
    events = [e for chunk in chunks for e in stream.feed(chunk)]
    assert not any(name == "response.completed" for name, _ in events)  # only after [DONE]
    events += stream.finish()
    assert [name for name, _ in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    assert all(d["type"] == name for name, d in events)
    done = [d["item"] for n, d in events if n == "response.output_item.done"]
    assert done[0]["content"][0]["text"] == "On it."
    assert (done[1]["call_id"], json.loads(done[1]["arguments"])) == ("t0", {"cmd": "ls"})
    final = events[-1][1]["response"]
    assert final["status"] == "completed" and final["output"] == done
    assert final["usage"]["input_tokens"] == 50 and final["usage"]["output_tokens"] == 9


def test_stream_error_is_response_failed() -> None:
    stream = ResponseStream(tr.Request.of(codex_request()))
    events = stream.error({"error": {"message": "engine gone", "type": "upstream_error"}})
    assert [n for n, _ in events][-1] == "response.failed"
    assert events[-1][1]["response"]["error"]["message"] == "engine gone"

"""The proxy's render of the chat template against the real vLLM's (capture_proxy/chat_template.py).

For chat requests of every shape the harnesses send — tools with and without descriptions, tool
calls whose arguments are JSON, not JSON or empty, tool results as text parts, names, non-ASCII
text, and the chat requests the Messages and Responses APIs are translated into — the ids the
proxy renders after a continued reply are the ids after that reply's end-of-turn token in vLLM's
own render of the request (``/v1/chat/completions/render``, the head's and the whole's).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from capture_devkit.engine import VLLMServer
from capture_proxy.chat_template import ChatTemplate, _conversation, _tools
from capture_proxy.translate import messages as tm
from capture_proxy.translate import responses as tr

pytestmark = pytest.mark.vllm

BASH = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Runs a command",
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
    },
}
READ = {"type": "function", "function": {"parameters": {"type": "object"}, "name": "read"}}
STRICT = {"type": "function", "function": {"name": "w", "parameters": {}, "strict": True}}


def _call(arguments: str, name: str = "bash") -> dict[str, Any]:
    return {"id": "c1", "type": "function", "function": {"name": name, "arguments": arguments}}


def _chat(messages: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": messages, **fields}


USER = {"role": "user", "content": "How many files?"}
#: (name, request, index of the continued reply)
CHATS: list[tuple[str, dict[str, Any], int]] = [
    ("text", _chat([USER, {"role": "assistant", "content": "Two."}, USER]), 1),
    (
        "tool-turn",
        _chat(
            [
                {"role": "system", "content": "You are careful."},
                USER,
                {"role": "assistant", "content": None, "tool_calls": [_call('{"cmd": "ls é"}')]},
                {"role": "tool", "tool_call_id": "c1", "content": "a\nb"},
            ],
            tools=[BASH, READ, STRICT],
            tool_choice="auto",
        ),
        2,
    ),
    (
        "odd-arguments-and-parts-appended",
        _chat(
            [
                USER,
                {"role": "assistant", "content": "Let me look."},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "go"}, {"type": "text", "text": ""}],
                },
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [_call("not json"), _call("", "read"), _call('{"b": 1, "a": 2}')],
                },
                {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "x"}]},
                {"role": "tool", "tool_call_id": "c2", "content": ""},
                {"role": "user", "content": [{"type": "text", "text": "a"}, "b"], "name": "ann"},
            ],
            tools=[BASH, READ],
        ),
        1,
    ),
    (
        "second-reply",
        _chat(
            [
                USER,
                {"role": "assistant", "content": "Let me look.", "tool_calls": [_call("{}")]},
                {"role": "tool", "tool_call_id": "c1", "content": "3"},
                {"role": "assistant", "content": 'Three ✓ "quoted"', "tool_calls": []},
                {"role": "user", "content": "And now?"},
            ],
            tools=[BASH],
        ),
        3,
    ),
]


def _translated() -> list[tuple[str, dict[str, Any], int]]:
    """The chat requests of a Messages and a Responses tool turn, as the proxy translates them."""
    schema = {"type": "object", "properties": {"basket": {"type": "string"}}}
    messages = tm.to_chat_request(
        {
            "model": "tiny",
            "max_tokens": 64,
            "system": [{"type": "text", "text": "You count fruit."}],
            "tools": [{"name": "count", "description": "Counts", "input_schema": schema}],
            "messages": [
                {"role": "user", "content": "How many apples?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "tool_use", "id": "t1", "name": "count", "input": {"basket": "A"}}
                    ],
                },
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "3"}],
                },
            ],
        }
    )
    call = {"type": "function_call", "call_id": "f1", "name": "count", "arguments": "{}"}
    responses = tr.to_chat_request(
        {
            "model": "tiny",
            "instructions": "You count fruit.",
            "input": [
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "?"}],
                },
                call,
                {"type": "function_call_output", "call_id": "f1", "output": "3 apples"},
            ],
            "tools": [{"type": "function", "name": "count", "parameters": schema, "strict": False}],
        }
    )
    return [(f"{name}-api", body, _last_reply(body)) for name, body in (("messages", messages),
            ("responses", responses))]  # fmt: skip


def _last_reply(body: dict[str, Any]) -> int:
    roles = [m.get("role") for m in body["messages"]]
    return len(roles) - 1 - roles[::-1].index("assistant")


def _render(vllm: VLLMServer, request: dict[str, Any]) -> list[int]:
    answer = httpx.post(f"{vllm.base_url}/v1/chat/completions/render", json=request, timeout=60)
    assert answer.status_code == 200, answer.text
    ids: list[int] = answer.json()["token_ids"]
    return ids


def _engine_ids(vllm: VLLMServer, body: dict[str, Any], reply: int) -> list[int]:
    """vLLM's ids after the end-of-turn token that ends ``messages[reply]`` in its render."""
    full = _render(vllm, body)
    head = body | {"messages": body["messages"][: reply + 1], "add_generation_prompt": False}
    head_ids = _render(vllm, head)
    assert full[: len(head_ids)] == head_ids
    return full[len(head_ids) - head_ids[::-1].index(_engine_eot(vllm)) :]


def _engine_eot(vllm: VLLMServer) -> int:
    answer = httpx.post(
        f"{vllm.base_url}/tokenize",
        json={"model": "tiny", "prompt": "<|im_end|>", "add_special_tokens": False},
        timeout=30,
    ).json()
    assert len(answer["tokens"]) == 1
    eot: int = answer["tokens"][0]
    return eot


@pytest.mark.parametrize(("body", "reply"), [(b, r) for _, b, r in CHATS + _translated()],
                         ids=[name for name, *_ in CHATS + _translated()])  # fmt: skip
def test_the_proxys_render_is_the_engines(
    vllm_server: VLLMServer, tiny_model_dir: Path, body: dict[str, Any], reply: int
) -> None:
    template = ChatTemplate.load(tiny_model_dir, "<|im_end|>")
    here = template.continuation_ids(body, reply)
    assert here is not None, "rendered by the engine: not a shape this test means to check"
    assert here == _engine_ids(vllm_server, body, reply)
    assert template.end_of_turn_id == _engine_eot(vllm_server)
    # The whole render too (the tools, the earlier messages), encoded at once: vLLM's.
    conversation = _conversation(body["messages"])
    assert conversation is not None
    text = template.render(conversation, _tools(body.get("tools")), generation_prompt=True)
    whole = template._tokenizer.encode(text, add_special_tokens=False).ids
    assert whole == _render(vllm_server, body)

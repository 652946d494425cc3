"""Messages and Responses against the real vLLM: each generation is captured exactly (issue 13).

A two-turn tool conversation per API — a forced tool call, then the tool result and a text
answer — whole and streamed. Each call's recorded prompt ids are compared with the engine's own
render route (``/v1/chat/completions/render``) and ``/tokenize`` of the translated request; the
sampled ids decode (vLLM ``/detokenize``) to the text the harness received; the usage the
harness received is the recorded token counts; in ``stitch`` mode the second turn continues on the
first turn's exact tokens; and so with the engine streaming four tokens a chunk
(``upstream.stream_interval``).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from capture_devkit.engine import VLLMServer
from capture_proxy.translate import messages as tm
from capture_proxy.translate import responses as tr
from tests.fixtures.db import sqlite_url
from tests.fixtures.proxy import ProxyFactory, ProxyServer
from tests.integration.harnesses.script import ScriptedEngine, Step, call, say

pytestmark = pytest.mark.vllm

ANSWER = "There are 3 apples."
SCRIPT: dict[str, list[Step]] = {"parent": [call(("count_fruit", {"basket": "A"})), say(ANSWER)]}
SCHEMA = {"type": "object", "properties": {"basket": {"type": "string"}}, "required": ["basket"]}
HEADERS = {"X-Agent-Id": "solo"}


#: (continuation, upstream.stream_interval): both modes, and the engine's streams four tokens a
#: chunk, which the translated streams must carry as they carry one.
MODES = pytest.mark.parametrize(
    ("continuation", "stream_interval"),
    [("passthrough", None), ("stitch", None), ("stitch", 4)],
    ids=["passthrough", "stitch", "stitch-4-tokens-a-chunk"],
)


def start(
    vllm: VLLMServer,
    factory: ProxyFactory,
    tmp_path: Any,
    continuation: str,
    stream_interval: int | None,
) -> tuple[ProxyServer, str, str]:
    proxy = factory(
        sqlite_url(tmp_path / "capture.db"),
        upstream_url=vllm.base_url,
        upstream={
            "transform": ScriptedEngine(SCRIPT),
            "served_model": vllm.served_model_name,
            "stream_interval": stream_interval,
        },
        continuation=continuation,
    )
    created = httpx.post(f"{proxy.url}/episodes", json={"group_id": "apis"}, timeout=30).json()
    return proxy, created["episode_id"], created["base_url"]


def engine(vllm: VLLMServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    reply = httpx.post(f"{vllm.base_url}{path}", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    payload: dict[str, Any] = reply.json()
    return payload


def sse(text: str) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def calls(proxy: ProxyServer, episode_id: str) -> list[dict[str, Any]]:
    bundle = httpx.get(f"{proxy.url}/episodes/{episode_id}/bundle", timeout=30).json()
    found: list[dict[str, Any]] = bundle["calls"]
    return found


def check_exact(vllm: VLLMServer, chat: dict[str, Any], call: dict[str, Any], text: str) -> None:
    """The recorded prompt is the engine's rendering of the translated request; the recorded
    sample decodes to what the harness received."""
    request = {**chat, "model": vllm.served_model_name}
    request.pop("stream", None)
    request.pop("stream_options", None)
    rendered = engine(vllm, "/v1/chat/completions/render", request)
    tokenized = engine(
        vllm,
        "/tokenize",
        {
            "model": vllm.served_model_name,
            "messages": chat["messages"],
            "tools": chat.get("tools"),
            "add_generation_prompt": True,
        },
    )
    if call["continuation"]["stitched"]:
        # A stitched prompt keeps the earlier turn's sampled tokens; only its length can differ.
        assert call["prompt_token_ids"][-8:] == rendered["token_ids"][-8:]
    else:
        assert call["prompt_token_ids"] == rendered["token_ids"] == tokenized["tokens"]
    ids = call["completion_token_ids"]
    assert len(ids) == len(call["completion_logprobs"]) > 0
    assert all(lp <= 0.0 for lp in call["completion_logprobs"])
    decoded = engine(vllm, "/detokenize", {"model": vllm.served_model_name, "tokens": ids})
    assert text in decoded["prompt"]


@MODES
def test_messages_tool_turn_then_streamed_answer_are_captured_exactly(
    vllm_server: VLLMServer,
    proxy_factory: ProxyFactory,
    tmp_path: Any,
    continuation: str,
    stream_interval: int | None,
) -> None:
    proxy, episode_id, base_url = start(
        vllm_server, proxy_factory, tmp_path, continuation, stream_interval
    )
    url = base_url.removesuffix("/v1") + "/v1/messages?beta=true"
    tools = [{"name": "count_fruit", "description": "Count a basket", "input_schema": SCHEMA}]
    first = {
        "model": "claude-tiny",
        "max_tokens": 256,
        "system": [{"type": "text", "text": "You count fruit."}],
        "messages": [{"role": "user", "content": "How many apples are in basket A?"}],
        "tools": tools,
    }
    reply = httpx.post(url, json=first, headers=HEADERS, timeout=120)
    assert reply.status_code == 200, reply.text
    message = reply.json()
    assert message["stop_reason"] == "tool_use"
    [use] = [b for b in message["content"] if b["type"] == "tool_use"]
    assert use["name"] == "count_fruit" and use["input"] == {"basket": "A"} and use["id"]
    [one] = calls(proxy, episode_id)
    assert message["usage"]["input_tokens"] == len(one["prompt_token_ids"])
    assert message["usage"]["output_tokens"] == len(one["completion_token_ids"])
    check_exact(vllm_server, tm.to_chat_request(first), one, "<tool_call>")
    counted = httpx.post(
        base_url.removesuffix("/v1") + "/v1/messages/count_tokens", json=first, timeout=60
    )
    assert counted.json() == {"input_tokens": len(one["prompt_token_ids"])}

    result = {"type": "tool_result", "tool_use_id": use["id"], "content": "3 apples"}
    second = {
        **first,
        "stream": True,
        "messages": [
            *first["messages"],
            {"role": "assistant", "content": message["content"]},
            {"role": "user", "content": [result]},
        ],
    }
    streamed = httpx.post(url, json=second, headers=HEADERS, timeout=120)
    assert streamed.status_code == 200, streamed.text
    events = sse(streamed.text)
    names = [name for name, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert names[1:-2] == ["content_block_start"] + ["content_block_delta"] * (len(names) - 5) + [
        "content_block_stop"
    ]
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert text == ANSWER
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] == "end_turn"
    one, two = calls(proxy, episode_id)
    assert delta["usage"]["input_tokens"] == len(two["prompt_token_ids"])
    assert delta["usage"]["output_tokens"] == len(two["completion_token_ids"])
    check_exact(vllm_server, tm.to_chat_request(second), two, ANSWER)
    if stream_interval is not None:  # (one token a chunk: 10–11 deltas for 13–14 tokens)
        tokens = len(two["completion_token_ids"])
        assert names.count("content_block_delta") <= tokens / stream_interval + 2
    report = httpx.get(f"{proxy.url}/episodes/{episode_id}", timeout=30).json()["continuation"]
    if continuation == "stitch":
        # The second turn is the first turn's exact prompt + sample + the new messages.
        exact = one["prompt_token_ids"] + one["completion_token_ids"]
        assert two["prompt_token_ids"][: len(exact)] == exact
        assert report["stitched"] == 1 and two["continuation"]["stitched"] is True
    else:
        assert report["stitched"] == 0 and report["fresh"]["passthrough_mode"] == 1


@MODES
def test_responses_streamed_tool_turn_then_whole_answer_are_captured_exactly(
    vllm_server: VLLMServer,
    proxy_factory: ProxyFactory,
    tmp_path: Any,
    continuation: str,
    stream_interval: int | None,
) -> None:
    proxy, episode_id, _ = start(
        vllm_server, proxy_factory, tmp_path, continuation, stream_interval
    )
    url = f"{proxy.url}/v1/responses"  # the header form of the episode
    headers = {**HEADERS, "X-Episode-Id": episode_id}
    tool = {"type": "function", "name": "count_fruit", "parameters": SCHEMA, "strict": False}
    first = {
        "model": "codex-tiny",
        "instructions": "You count fruit.",
        "input": [
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "How many apples in basket A?"}],
            }
        ],
        "tools": [tool],
        "tool_choice": "auto",
        "store": False,
        "stream": True,
    }
    streamed = httpx.post(url, json=first, headers=headers, timeout=120)
    assert streamed.status_code == 200, streamed.text
    events = sse(streamed.text)
    names = [name for name, _ in events]
    assert names[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert names[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    final = events[-1][1]["response"]
    [item] = final["output"]
    assert item["type"] == "function_call" and item["name"] == "count_fruit"
    assert json.loads(item["arguments"]) == {"basket": "A"}
    [one] = calls(proxy, episode_id)
    assert final["usage"]["input_tokens"] == len(one["prompt_token_ids"])
    assert final["usage"]["output_tokens"] == len(one["completion_token_ids"])
    check_exact(vllm_server, tr.to_chat_request(first), one, "<tool_call>")

    output = {"type": "function_call_output", "call_id": item["call_id"], "output": "3 apples"}
    second = {**first, "stream": False, "input": [*first["input"], item, output]}
    whole = httpx.post(url, json=second, headers=headers, timeout=120)
    assert whole.status_code == 200, whole.text
    response = whole.json()
    assert response["status"] == "completed"
    [message] = response["output"]
    assert message["type"] == "message" and message["content"][0]["text"] == ANSWER
    one, two = calls(proxy, episode_id)
    assert response["usage"]["input_tokens"] == len(two["prompt_token_ids"])
    check_exact(vllm_server, tr.to_chat_request(second), two, ANSWER)
    if continuation == "stitch":
        exact = one["prompt_token_ids"] + one["completion_token_ids"]
        assert two["prompt_token_ids"][: len(exact)] == exact
        assert two["continuation"]["stitched"] is True

"""The wire facts the proxy relies on (DESIGN §3, §7), checked against the real vLLM server.

Chat answers carry top-level ``prompt_token_ids`` and ``choices[i].token_ids``; completions carry
``choices[i].prompt_token_ids``; streaming chat carries ``prompt_token_ids`` in the first chunk and
``choices[0].token_ids`` in every chunk that consumed tokens; a per-request ``seed`` reproduces
tokens and logprobs; ``structured_outputs.regex`` forces hermes tool calls that come back as
``tool_calls``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from capture_devkit.engine import VLLMServer

pytestmark = pytest.mark.vllm

MESSAGES = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Say hello to the team."},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command in the workspace.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        },
    }
]
TOOL_CALL_TEXT = (
    '<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la src"}}\n</tool_call>'
)


def literal_regex(text: str) -> str:
    """A regex matching exactly ``text``."""
    special = set(".^$*+?{}[]\\|()")
    return "".join("\\n" if c == "\n" else "\\" + c if c in special else c for c in text)


@pytest.fixture(scope="module")
def client(vllm_server: VLLMServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=vllm_server.base_url, timeout=120) as http:
        yield http


def chat(client: httpx.Client, **body: Any) -> dict[str, Any]:
    payload = {"model": "tiny", "messages": MESSAGES, "return_token_ids": True, "logprobs": True}
    response = client.post("/v1/chat/completions", json=payload | body)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def stream_chat(client: httpx.Client, **body: Any) -> list[dict[str, Any]]:
    payload = {
        "model": "tiny",
        "messages": MESSAGES,
        "return_token_ids": True,
        "logprobs": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chunks: list[dict[str, Any]] = []
    with client.stream("POST", "/v1/chat/completions", json=payload | body) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        assert line.startswith("data: ")
        chunks.append(json.loads(line.removeprefix("data: ")))
    return chunks


def streamed_tokens(chunks: list[dict[str, Any]]) -> tuple[list[int], list[float]]:
    ids: list[int] = []
    logprobs: list[float] = []
    for chunk in chunks:
        for choice in chunk["choices"]:
            ids += choice.get("token_ids") or []
            logprobs += [e["logprob"] for e in (choice.get("logprobs") or {}).get("content", [])]
    return ids, logprobs


def tokenize(client: httpx.Client, **body: Any) -> list[int]:
    payload = {"model": "tiny", "messages": MESSAGES, "add_generation_prompt": True}
    response = client.post("/tokenize", json=payload | body)
    assert response.status_code == 200, response.text
    tokens: list[int] = response.json()["tokens"]
    return tokens


def test_models_lists_the_served_name(client: httpx.Client, vllm_server: VLLMServer) -> None:
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [vllm_server.served_model_name]
    assert models["data"][0]["max_model_len"] == vllm_server.max_model_len


def test_chat_returns_prompt_ids_equal_to_tokenize(client: httpx.Client) -> None:
    answer = chat(client, max_tokens=8, seed=1)
    choice = answer["choices"][0]
    assert answer["prompt_token_ids"] == tokenize(client)
    assert len(choice["token_ids"]) == len(choice["logprobs"]["content"])
    assert all(e["logprob"] <= 0.0 for e in choice["logprobs"]["content"])
    usage = answer["usage"]
    assert usage["prompt_tokens"] == len(answer["prompt_token_ids"])
    assert usage["completion_tokens"] == len(choice["token_ids"])
    assert choice["finish_reason"] in {"stop", "length"}


def test_chat_with_tools_prompt_ids_equal_to_tokenize(client: httpx.Client) -> None:
    answer = chat(client, tools=TOOLS, max_tokens=4)
    assert answer["prompt_token_ids"] == tokenize(client, tools=TOOLS)


def test_free_generation_ends_with_im_end_when_stopped(client: httpx.Client) -> None:
    im_end = client.post("/tokenize", json={"model": "tiny", "prompt": "<|im_end|>"}).json()
    assert len(im_end["tokens"]) == 1
    stopped = [chat(client, max_tokens=400, seed=seed)["choices"][0] for seed in range(4)]
    finished = [c for c in stopped if c["finish_reason"] == "stop"]
    assert finished, "the tiny model should end some turns by itself"
    for choice in finished:
        assert choice["token_ids"][-1] == im_end["tokens"][0]


def test_completions_with_token_prompt(client: httpx.Client) -> None:
    prompt = tokenize(client)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "seed": 5,
            "return_token_ids": True, "logprobs": 1}  # fmt: skip
    answer = client.post("/v1/completions", json=body).json()
    choice = answer["choices"][0]
    assert choice["prompt_token_ids"] == prompt
    assert len(choice["token_ids"]) == len(choice["logprobs"]["token_logprobs"]) == 6
    # the same prompt through chat samples the same tokens with the same seed
    chat_choice = chat(client, max_tokens=6, seed=5)["choices"][0]
    assert chat_choice["token_ids"] == choice["token_ids"]


def test_same_seed_same_tokens_and_logprobs(client: httpx.Client) -> None:
    first, second = (chat(client, max_tokens=24, seed=42)["choices"][0] for _ in range(2))
    assert first["token_ids"] == second["token_ids"]
    assert first["logprobs"] == second["logprobs"]
    other = chat(client, max_tokens=24, seed=43)["choices"][0]
    assert other["token_ids"] != first["token_ids"]


def test_streaming_chat_carries_token_ids_per_chunk(client: httpx.Client) -> None:
    chunks = stream_chat(client, max_tokens=12, seed=9)
    first, last = chunks[0], chunks[-1]
    assert first["prompt_token_ids"] == tokenize(client)
    assert first["choices"][0]["delta"]["role"] == "assistant"
    assert last["choices"] == [] and last["usage"]["completion_tokens"] > 0
    for chunk in chunks[1:-1]:
        (choice,) = chunk["choices"]
        assert len(choice["token_ids"]) == len(choice["logprobs"]["content"]) >= 1
    ids, logprobs = streamed_tokens(chunks)
    reference = chat(client, max_tokens=12, seed=9)["choices"][0]
    assert ids == reference["token_ids"]
    assert logprobs == [e["logprob"] for e in reference["logprobs"]["content"]]
    assert last["usage"]["completion_tokens"] == len(ids)


def test_regex_forces_a_hermes_tool_call(client: httpx.Client) -> None:
    forced = {"structured_outputs": {"regex": literal_regex(TOOL_CALL_TEXT)}}
    answer = chat(client, tools=TOOLS, max_tokens=200, seed=3, **forced)
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "bash"
    assert json.loads(call["function"]["arguments"]) == {"command": "ls -la src"}

    chunks = stream_chat(client, tools=TOOLS, max_tokens=200, seed=3, **forced)
    ids, _ = streamed_tokens(chunks)
    assert ids == choice["token_ids"]  # every sampled token shows up in some chunk
    deltas = [
        tc for c in chunks for ch in c["choices"] for tc in ch["delta"].get("tool_calls") or []
    ]
    assert deltas[0]["function"]["name"] == "bash" and deltas[0]["id"]
    arguments = "".join(d["function"].get("arguments") or "" for d in deltas)
    assert json.loads(arguments) == {"command": "ls -la src"}
    finals = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert finals == ["tool_calls"]


def test_opencode_sized_prompt_fits(client: httpx.Client, vllm_server: VLLMServer) -> None:
    system = " ".join(["You are an interactive coding agent; be concise and careful."] * 160)
    tools = [
        {"type": "function", "function": {
            "name": f"tool_{i}", "description": "Reads, writes or searches files. " * 20,
            "parameters": {"type": "object", "required": ["path"], "properties": {
                "path": {"type": "string", "description": "Absolute path of the file."},
                "limit": {"type": "integer", "description": "How many lines to read."}}}}}
        for i in range(10)
    ]  # fmt: skip
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Go."}]
    answer = chat(client, messages=messages, tools=tools, max_tokens=4)
    assert len(system) > 9500
    assert answer["usage"]["prompt_tokens"] < vllm_server.max_model_len // 2

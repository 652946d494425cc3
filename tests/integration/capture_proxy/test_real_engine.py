"""The capture path against the real vLLM (tiny model): what is recorded is what the engine did.

Each test compares the bundle with an independent source: vLLM's own ``/tokenize`` of the same
messages, and a direct call to vLLM with the same seed (same sampled ids, same logprobs).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

import httpx
import numpy as np
import pytest

from capture_devkit.engine import VLLMServer
from capture_devkit.harness.client import forced_max_tokens, tool_call_text
from tests.fixtures.db import sqlite_url
from tests.fixtures.proxy import ProxyFactory, ProxyServer, hang_up_once_admitted

pytestmark = pytest.mark.vllm

MESSAGES = [
    {"role": "system", "content": "You are a careful assistant."},
    {"role": "user", "content": "Count the files in the repository and report the number."},
]

#: A tool the tests force calls of (their text through ``structured_outputs``).
BASH_TOOL = {
    "type": "function",
    "function": {
        "name": "bash",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
    },
}


@pytest.fixture
def proxy(vllm_server: VLLMServer, proxy_factory: ProxyFactory, tmp_path: Any) -> ProxyServer:
    return proxy_factory(sqlite_url(tmp_path / "capture.db"), upstream_url=vllm_server.base_url)


def _direct(vllm: VLLMServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(f"{vllm.base_url}{path}", json=body, timeout=120)
    assert response.status_code == 200, response.text
    payload: dict[str, Any] = response.json()
    return payload


def _f32(values: list[float]) -> list[float]:
    return np.asarray(values, dtype=np.float32).astype(np.float64).tolist()  # type: ignore[no-any-return]


def _stream_chunks(text: str) -> list[dict[str, Any]]:
    """The JSON chunks of an SSE answer (not its ``[DONE]``)."""
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


async def _new_episode(client: httpx.AsyncClient) -> tuple[str, str]:
    created = (await client.post("/episodes", json={"group_id": "real"})).json()
    return created["episode_id"], created["base_url"]


async def _calls(client: httpx.AsyncClient, episode_id: str) -> list[dict[str, Any]]:
    bundle = (await client.get(f"/episodes/{episode_id}/bundle")).json()
    calls: list[dict[str, Any]] = bundle["calls"]
    return calls


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_capture_equals_engine(
    proxy: ProxyServer, vllm_server: VLLMServer, stream: bool
) -> None:
    request = {
        "model": vllm_server.served_model_name,
        "messages": MESSAGES,
        "max_tokens": 24,
        "seed": 1234,
        "temperature": 1.0,
        "stream": stream,
    }
    async with httpx.AsyncClient(base_url=proxy.url, timeout=120) as client:
        episode_id, base_url = await _new_episode(client)
        response = await client.post(f"{base_url}/chat/completions", json=request)
        assert response.status_code == 200, response.text
        if stream:
            assert response.text.rstrip().endswith("data: [DONE]")
            chunks = _stream_chunks(response.text)
            assert all("token_ids" not in c for ch in chunks for c in ch["choices"])
        else:
            assert "prompt_token_ids" not in response.json()
        [call] = await _calls(client, episode_id)

    tokenized = _direct(
        vllm_server, "/tokenize", {"model": request["model"], "messages": MESSAGES}
    )["tokens"]
    assert call["prompt_token_ids"] == tokenized

    direct = _direct(
        vllm_server,
        "/v1/chat/completions",
        {**request, "stream": False, "return_token_ids": True, "logprobs": True},
    )
    choice = direct["choices"][0]
    assert direct["prompt_token_ids"] == tokenized
    assert call["completion_token_ids"] == choice["token_ids"]
    assert call["completion_logprobs"] == _f32(
        [t["logprob"] for t in choice["logprobs"]["content"]]
    )
    assert call["finish_reason"] == choice["finish_reason"]
    assert call["status"] == "completed"


def _engine_metric(vllm: VLLMServer, name: str) -> float:
    """One of vLLM's Prometheus figures (summed over its label sets)."""
    text = httpx.get(f"{vllm.base_url}/metrics", timeout=30).text
    values = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    assert values, f"vLLM reports no {name}"
    return sum(float(v) for v in values)


async def test_a_client_that_leaves_a_long_generation_stops_the_engine(
    proxy: ProxyServer, vllm_server: VLLMServer
) -> None:
    budget = vllm_server.max_model_len - 100  # seconds of generation on this engine
    request = {
        "model": vllm_server.served_model_name,
        "messages": MESSAGES,
        "max_tokens": budget,
        "min_tokens": budget,
    }
    generated = _engine_metric(vllm_server, "vllm:generation_tokens_total")
    async with httpx.AsyncClient(base_url=proxy.url, timeout=120) as client:
        episode_id, _ = await _new_episode(client)
        path = f"/episodes/{episode_id}/v1/chat/completions"
        await hang_up_once_admitted(
            client, proxy.port, episode_id, path, json.dumps(request).encode()
        )
        left = time.monotonic()
        for _ in range(200):
            [call] = await _calls(client, episode_id)
            if call["status"] != "admitted":
                break
            await asyncio.sleep(0.02)
        assert (call["status"], call["error"]) == ("cancelled", "client_disconnected")
        running = 1.0
        while time.monotonic() - left < 10:
            running = _engine_metric(vllm_server, "vllm:num_requests_running")
            if running == 0:
                break
            await asyncio.sleep(0.05)
        stopped_after = time.monotonic() - left
    assert running == 0
    # the engine stopped well before the end of the generation it was asked for
    tokens = _engine_metric(vllm_server, "vllm:generation_tokens_total") - generated
    assert tokens < budget / 2, (tokens, stopped_after)


async def test_completions_token_prompt_and_n2(proxy: ProxyServer, vllm_server: VLLMServer) -> None:
    prompt = _direct(
        vllm_server,
        "/tokenize",
        {"model": vllm_server.served_model_name, "prompt": "def add(a, b):"},
    )["tokens"]
    request = {
        "model": vllm_server.served_model_name,
        "prompt": prompt,
        "max_tokens": 12,
        "n": 2,
        "seed": 7,
        "temperature": 1.0,
    }
    async with httpx.AsyncClient(base_url=proxy.url, timeout=120) as client:
        episode_id, base_url = await _new_episode(client)
        response = await client.post(f"{base_url}/completions", json=request)
        assert response.status_code == 200, response.text
        answer = response.json()
        assert all("token_ids" not in c and c["logprobs"] is None for c in answer["choices"])
        calls = await _calls(client, episode_id)

    direct = _direct(
        vllm_server, "/v1/completions", {**request, "return_token_ids": True, "logprobs": 1}
    )
    assert len(calls) == 2
    assert [c["call_id"].rsplit("-", 1)[1] for c in calls] == ["0", "1"]
    for call, choice in zip(
        calls, sorted(direct["choices"], key=lambda c: c["index"]), strict=True
    ):
        assert call["prompt_token_ids"] == prompt
        assert call["completion_token_ids"] == choice["token_ids"]
        assert call["completion_logprobs"] == _f32(choice["logprobs"]["token_logprobs"])


async def test_streamed_tool_call_is_passed_through(
    proxy: ProxyServer, vllm_server: VLLMServer
) -> None:
    forced = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'
    request = {
        "model": vllm_server.served_model_name,
        "messages": MESSAGES,
        "tools": [BASH_TOOL],
        "max_tokens": 64,
        "seed": 3,
        "stream": True,
        "structured_outputs": {"regex": forced.replace("{", "\\{").replace("}", "\\}")},
    }
    async with httpx.AsyncClient(base_url=proxy.url, timeout=120) as client:
        episode_id, base_url = await _new_episode(client)
        response = await client.post(f"{base_url}/chat/completions", json=request)
        assert response.status_code == 200, response.text
        deltas = [chunk["choices"] for chunk in _stream_chunks(response.text)]
        names = [
            tc["function"].get("name")
            for choices in deltas
            for c in choices
            for tc in (c.get("delta") or {}).get("tool_calls") or []
        ]
        assert "bash" in names
        [call] = await _calls(client, episode_id)
    assert call["status"] == "completed"
    assert call["finish_reason"] == "tool_calls"
    assert len(call["completion_token_ids"]) == len(call["completion_logprobs"]) > 0


async def test_a_stream_interval_sends_fewer_chunks_and_records_every_token(
    vllm_server: VLLMServer, proxy_factory: ProxyFactory, tmp_path: Any
) -> None:
    """``upstream.stream_interval``: the engine batches tokens into chunks; the harness gets the
    same text and tool calls in fewer chunks, and every token is recorded with its logprob."""
    proxy = proxy_factory(
        sqlite_url(tmp_path / "capture.db"),
        upstream_url=vllm_server.base_url,
        upstream={"stream_interval": 4},
    )
    request = {
        "model": vllm_server.served_model_name,
        "messages": MESSAGES,
        "max_tokens": 24,
        "min_tokens": 24,
        "seed": 1234,
        "temperature": 1.0,
        "stream": True,
    }
    calls = [("bash", {"command": "ls -la"}), ("bash", {"command": "wc -l *.py"})]
    forced = tool_call_text(calls)
    forcing = {
        **request,
        "tools": [BASH_TOOL],
        "max_tokens": forced_max_tokens(forced),
        "min_tokens": 0,
        "structured_outputs": {"regex": re.escape(forced)},
    }
    async with httpx.AsyncClient(base_url=proxy.url, timeout=120) as client:
        episode_id, base_url = await _new_episode(client)
        free = await client.post(f"{base_url}/chat/completions", json=request)
        tool = await client.post(f"{base_url}/chat/completions", json=forcing)
        assert free.status_code == tool.status_code == 200, (free.text, tool.text)
        recorded = await _calls(client, episode_id)
    # 24 tokens, 4 to a chunk: 6 chunks of text and the first (one token a chunk: 21 here)
    text_chunks = _stream_chunks(free.text)
    assert len(text_chunks) <= 8, len(text_chunks)
    direct = _direct(
        vllm_server,
        "/v1/chat/completions",
        {**request, "stream": False, "return_token_ids": True, "logprobs": True},
    )["choices"][0]
    text = "".join(c["delta"].get("content") or "" for ch in text_chunks for c in ch["choices"])
    assert text == direct["message"]["content"]
    assert recorded[0]["completion_token_ids"] == direct["token_ids"]
    assert recorded[0]["completion_logprobs"] == _f32(
        [t["logprob"] for t in direct["logprobs"]["content"]]
    )
    # the forced tool calls reach the harness whole, though their text comes several tokens
    # to a chunk (vLLM's hermes parser reads deltas of several tokens)
    tool_chunks = _stream_chunks(tool.text)
    assembled: dict[int, list[str]] = {}
    for chunk in tool_chunks:
        for choice in chunk["choices"]:
            for delta in (choice.get("delta") or {}).get("tool_calls") or []:
                name_args = assembled.setdefault(delta["index"], ["", ""])
                name_args[0] += delta.get("function", {}).get("name") or ""
                name_args[1] += delta.get("function", {}).get("arguments") or ""
    got = [(name, json.loads(args)) for _, (name, args) in sorted(assembled.items())]
    assert got == calls
    call = recorded[1]
    assert call["status"] == "completed" and call["finish_reason"] == "tool_calls"
    assert len(call["completion_token_ids"]) == len(call["completion_logprobs"])
    assert len(tool_chunks) < len(call["completion_token_ids"]) / 2

"""The acceptance episode as captured: its shape, exact conditioning and exact samples.

Everything here is checked against the real engine: the bundle's prompt ids against vLLM's own
``/tokenize`` of the messages the harness sent, and the captured completion ids/logprobs against
the same request replayed directly on vLLM with the same seed.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import httpx
import pytest

from capture_proxy.engine import VLLMServer
from tests.acceptance.conftest import Captured

pytestmark = pytest.mark.vllm

WORKERS = ("worker-a", "worker-b")


def _overlap(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return bool(a["admitted_seq"] < b["completed_seq"] and b["admitted_seq"] < a["completed_seq"])


def test_every_call_completed_and_labelled(captured: Captured) -> None:
    bundle, trace = captured.bundle, captured.trace
    assert bundle["status"] == "closed"
    assert bundle["reward"] == 1.0
    assert len(bundle["calls"]) == len(trace.calls) == 10
    assert {c["call_id"] for c in bundle["calls"]} == {c.call_id for c in trace.calls}
    for call in trace.calls:
        record = captured.call(call.step)
        assert record["status"] == "completed", call.step
        agent = call.step.split(".")[0]
        assert record["agent_id"] == agent
        assert record["parent_agent_id"] == (None if agent == "parent" else "parent")
        assert record["role"] == ("compaction" if call.step.endswith(".compact") else "policy")
    assert [c.step for c in trace.by_agent("worker-a")] == [
        "worker-a.turn0",
        "worker-a.turn1",
        "worker-a.compact",
        "worker-a.turn2",
        "worker-a.answer",
    ]
    assert [c.step for c in trace.by_agent("worker-b")] == [
        "worker-b.turn0",
        "worker-b.turn1",
        "worker-b.answer",
    ]


def test_episode_shape_overlap_reversal_resumption(captured: Captured) -> None:
    trace = captured.trace
    delegate, final = captured.call("parent.delegate"), captured.call("parent.final")
    a_calls = [captured.call(c.step) for c in trace.by_agent("worker-a")]
    b_calls = [captured.call(c.step) for c in trace.by_agent("worker-b")]
    # Workers start after the delegation completed; the parent resumes after both answered.
    for call in a_calls + b_calls:
        assert call["admitted_seq"] > delegate["completed_seq"]
        assert call["completed_seq"] < final["admitted_seq"]
    # The two workers ran concurrently: some calls of one were in flight during the other's.
    assert any(_overlap(a, b) for a in a_calls for b in b_calls)
    # worker-b started second and finished first.
    assert b_calls[0]["admitted_seq"] > a_calls[0]["admitted_seq"]
    assert b_calls[-1]["completed_seq"] < a_calls[-1]["completed_seq"]
    # The delegation was a real tool call with two invocations, answered in the parent's context.
    assert [t.name for t in trace.step("parent.delegate").tool_calls] == ["task", "task"]
    tool_messages = [m for m in trace.step("parent.final").messages if m["role"] == "tool"]
    answers = [trace.step("worker-a.answer").content, trace.step("worker-b.answer").content]
    assert [m["content"] for m in tool_messages] == answers
    # Each worker turn continues the agent's own history with the assistant message and a result.
    for agent in WORKERS:
        turns = [c for c in trace.by_agent(agent) if ".turn" in c.step]
        for before, after in itertools.pairwise(turns):
            if after.step == "worker-a.turn2":
                continue  # starts a fresh context after compaction
            assert after.messages[: len(before.messages)] == before.messages
            assert after.messages[len(before.messages)] == before.assistant_message()
            assert after.messages[len(before.messages) + 1]["role"] == "tool"


def test_compaction_rewrites_worker_context(captured: Captured) -> None:
    trace = captured.trace
    compact = trace.step("worker-a.compact")
    fresh = trace.step("worker-a.turn2")
    assert compact.role == "compaction"
    assert compact.messages[:-1] == [
        *trace.step("worker-a.turn1").messages,
        trace.step("worker-a.turn1").assistant_message(),
        compact.messages[-2],
    ]
    assert len(fresh.messages) == 2  # system + the task with the summary
    assert (compact.content or "") in fresh.messages[1]["content"]
    # The rewritten context is not a token continuation of anything: it is a new root.
    fresh_prompt = captured.call("worker-a.turn2")["prompt_token_ids"]
    for call in captured.bundle["calls"]:
        if call["call_id"] != fresh.call_id and call["completed_seq"] is not None:
            full = call["prompt_token_ids"] + call["completion_token_ids"]
            assert fresh_prompt[: len(full)] != full


def _tokenize(server: VLLMServer, request: dict[str, Any]) -> list[int]:
    body = {"model": request["model"], "messages": request["messages"]}
    if "tools" in request:
        body["tools"] = request["tools"]
    response = httpx.post(server.base_url + "/tokenize", json=body, timeout=60)
    response.raise_for_status()
    tokens: list[int] = response.json()["tokens"]
    return tokens


def test_prompt_ids_are_vllms_conditioning(captured: Captured, vllm_server: VLLMServer) -> None:
    for call in captured.trace.calls:
        record = captured.call(call.step)
        assert record["prompt_token_ids"] == _tokenize(vllm_server, call.request), call.step


def test_completions_match_a_direct_replay(captured: Captured, vllm_server: VLLMServer) -> None:
    """Same request, same seed, straight to vLLM: same sampled ids, same logprobs."""
    for call in captured.trace.calls:
        record = captured.call(call.step)
        body = {k: v for k, v in call.request.items() if k not in {"stream", "stream_options"}}
        body |= {"return_token_ids": True, "logprobs": True}
        response = httpx.post(vllm_server.base_url + "/v1/chat/completions", json=body, timeout=120)
        response.raise_for_status()
        answer = response.json()
        choice = answer["choices"][0]
        assert answer["prompt_token_ids"] == record["prompt_token_ids"], call.step
        assert choice["token_ids"] == record["completion_token_ids"], call.step
        replayed = [item["logprob"] for item in choice["logprobs"]["content"]]
        assert len(replayed) == len(record["completion_logprobs"])
        for got, want in zip(record["completion_logprobs"], replayed, strict=True):
            assert math.isclose(got, want, rel_tol=1e-4, abs_tol=1e-4), call.step
        if record["finish_reason"] == "stop":
            assert record["completion_token_ids"][-1] == _im_end(vllm_server)


def _im_end(server: VLLMServer) -> int:
    response = httpx.post(
        server.base_url + "/tokenize",
        json={"model": server.served_model_name, "prompt": "<|im_end|>"},
        timeout=30,
    )
    response.raise_for_status()
    tokens: list[int] = response.json()["tokens"]
    assert len(tokens) == 1
    return tokens[0]


def test_seeded_runs_are_reproducible(captured: Captured) -> None:
    """A second run with the same seed samples the same tokens (per-request seeds)."""
    import asyncio

    from capture_proxy.harness import close_episode, fetch_bundle, open_episode, run_episode

    trace = captured.trace
    proxy_url = trace.base_url.split("/episodes/")[0]

    async def again() -> dict[str, Any]:
        episode_id, base_url = await open_episode(proxy_url, "accept-repeat")
        await run_episode(base_url, episode_id=episode_id, group_id="accept-repeat", seed=1)
        closed = await close_episode(proxy_url, episode_id, 0.0, wait_s=5.0)
        assert closed.status_code == 200
        return await fetch_bundle(proxy_url, episode_id)

    repeat = asyncio.run(again())
    by_agent: dict[tuple[str | None, str], list[list[int]]] = {}
    for bundle in (captured.bundle, repeat):
        for call in sorted(bundle["calls"], key=lambda c: c["admitted_seq"]):
            key = (call["agent_id"], call["role"])
            by_agent.setdefault(key, []).append(call["completion_token_ids"])
    for key, completions in by_agent.items():
        half = len(completions) // 2
        assert completions[:half] == completions[half:], key

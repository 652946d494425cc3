"""The acceptance episode as captured: its shape, exact conditioning and exact samples.

Everything here is checked against the real engine. The proxy runs in its default
``continuation: stitch`` mode: a fresh-rendered call's prompt ids are vLLM's own ``/tokenize`` of
the messages the harness sent; a stitched call's are its base call's exact prompt + completion +
vLLM's tokens for the appended messages (computed here from ``/tokenize``, independently of the
proxy). Captured completion ids/logprobs equal a direct seeded replay on vLLM (the chat request,
or the recorded token prompt). A second proxy in ``passthrough`` mode keeps that mode covered.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from typing import Any

import httpx
import pytest

from capture_contracts.bundle import parse_bundle
from capture_contracts.drift import bundle_drift, drift_report
from capture_devkit.engine import VLLMServer
from capture_devkit.harness.trace import CallTrace, EpisodeTrace
from reconstruct import reconstruct_episode
from tests.integration.acceptance.conftest import Captured, EpisodeRunner

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


#: Calls rendered fresh in stitch mode: each agent's first call and worker-a's context after its
#: compaction rewrite. Every other call continues its agent's exact tokens.
FRESH_STEPS = {"parent.delegate", "worker-a.turn0", "worker-b.turn0", "worker-a.turn2"}
#: Contexts of the episode: parent, worker-a before (incl. the summary call) and after its
#: compaction, worker-b.
CONTEXTS = 4
_NOT_SAMPLING = {"model", "messages", "tools", "tool_choice", "stream", "stream_options"}


def _tokenize(
    server: VLLMServer,
    request: dict[str, Any],
    messages: list[dict[str, Any]] | None = None,
    *,
    generation_prompt: bool = True,
) -> list[int]:
    """vLLM's own chat-template tokens for ``messages`` (default: the request's)."""
    body = {
        "model": request["model"],
        "messages": request["messages"] if messages is None else messages,
        "add_generation_prompt": generation_prompt,
    }
    if "tools" in request:
        body["tools"] = request["tools"]
    response = httpx.post(server.base_url + "/tokenize", json=body, timeout=60)
    response.raise_for_status()
    tokens: list[int] = response.json()["tokens"]
    return tokens


def _base_step(trace: EpisodeTrace, call: CallTrace) -> CallTrace | None:
    """The call ``call`` continues, from the harness's trace alone: the latest longest earlier
    call of its agent whose messages plus the assistant message it got back begin ``call``'s."""
    agent = call.step.split(".")[0]
    candidates = [
        base
        for base in trace.by_agent(agent)
        if base.ended_s <= call.started_s
        and call.messages[: len(base.messages) + 1] == [*base.messages, base.assistant_message()]
    ]
    return max(candidates, key=lambda b: (len(b.messages), b.ended_s), default=None)


def _stitched_prompt(
    server: VLLMServer, call: CallTrace, base: CallTrace, base_record: dict[str, Any]
) -> list[int]:
    """Base prompt + base completion (+ end-of-turn) + the tokens vLLM's template gives the
    appended messages: its render of the whole request minus its render of the base's messages
    plus the reply (no generation prompt), with the template's trailer after the end-of-turn."""
    head = _tokenize(
        server, call.request, call.messages[: len(base.messages) + 1], generation_prompt=False
    )
    full = _tokenize(server, call.request)
    assert full[: len(head)] == head, f"{call.step}: the template is not prefix-stable"
    eot = _im_end(server)
    completion = list(base_record["completion_token_ids"])
    if completion[-1] != eot:
        completion.append(eot)
    trailer = head[len(head) - head[::-1].index(eot) :]
    return [*base_record["prompt_token_ids"], *completion, *trailer, *full[len(head) :]]


def test_prompt_ids_are_vllms_conditioning(captured: Captured, vllm_server: VLLMServer) -> None:
    """Fresh renders are vLLM's /tokenize of the messages; continuations are stitched: the base
    call's exact prompt and completion, then vLLM's tokens for the appended messages."""
    trace = captured.trace
    fresh = set()
    for call in trace.calls:
        record = captured.call(call.step)
        info = record["continuation"]
        assert info["mode"] == "stitch"
        base = _base_step(trace, call)
        if base is None:
            fresh.add(call.step)
            assert not info["stitched"], call.step
            assert record["prompt_token_ids"] == _tokenize(vllm_server, call.request), call.step
            continue
        assert info["stitched"], (call.step, info["reason"])
        assert info["base_call_id"] == base.call_id, call.step
        base_record = captured.call(base.step)
        expected = _stitched_prompt(vllm_server, call, base, base_record)
        assert record["prompt_token_ids"] == expected, call.step
        assert info["base_len"] + info["suffix_len"] == len(expected), call.step
    assert fresh == FRESH_STEPS


def _replay_chat(server: VLLMServer, call: CallTrace) -> tuple[list[int], list[int], list[float]]:
    """The same chat request, straight to vLLM: its prompt ids, sampled ids and logprobs."""
    body = {k: v for k, v in call.request.items() if k not in {"stream", "stream_options"}}
    body |= {"return_token_ids": True, "logprobs": True}
    response = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=120)
    response.raise_for_status()
    answer = response.json()
    choice = answer["choices"][0]
    logprobs = [item["logprob"] for item in choice["logprobs"]["content"]]
    return answer["prompt_token_ids"], choice["token_ids"], logprobs


def _replay_tokens(
    server: VLLMServer, call: CallTrace, prompt_ids: list[int]
) -> tuple[list[int], list[int], list[float]]:
    """The recorded token prompt with the call's sampling parameters and seed, straight to vLLM's
    /v1/completions: its prompt ids, sampled ids and logprobs."""
    body = {k: v for k, v in call.request.items() if k not in _NOT_SAMPLING}
    body |= {
        "model": call.request["model"],
        "prompt": prompt_ids,
        "return_token_ids": True,
        "logprobs": 1,
    }
    response = httpx.post(server.base_url + "/v1/completions", json=body, timeout=120)
    response.raise_for_status()
    choice = response.json()["choices"][0]
    return choice["prompt_token_ids"], choice["token_ids"], choice["logprobs"]["token_logprobs"]


def _assert_replayed(
    record: dict[str, Any], replay: tuple[list[int], list[int], list[float]], step: str, eot: int
) -> None:
    prompt, sampled, logprobs = replay
    assert prompt == record["prompt_token_ids"], step
    assert sampled == record["completion_token_ids"], step
    assert len(logprobs) == len(record["completion_logprobs"]), step
    for got, want in zip(record["completion_logprobs"], logprobs, strict=True):
        assert math.isclose(got, want, rel_tol=1e-4, abs_tol=1e-4), step
    if record["finish_reason"] == "stop":
        assert record["completion_token_ids"][-1] == eot, step


def test_completions_match_a_direct_replay(captured: Captured, vllm_server: VLLMServer) -> None:
    """Same conditioning, same sampling parameters, same seed, straight to vLLM: same sampled ids,
    same logprobs — the chat request for fresh renders, the recorded token prompt for stitched
    calls."""
    eot = _im_end(vllm_server)
    for call in captured.trace.calls:
        record = captured.call(call.step)
        if record["continuation"]["stitched"]:
            replay = _replay_tokens(vllm_server, call, record["prompt_token_ids"])
        else:
            replay = _replay_chat(vllm_server, call)
        _assert_replayed(record, replay, call.step, eot)


def test_stitch_mode_gives_one_row_per_context(captured: Captured) -> None:
    """Issue 7: every continuation is stitched (fresh renders: agent roots and the compaction
    rewrite only), every continuation is a token prefix, and rows = contexts."""
    report = captured.info["continuation"]
    assert report == drift_report(bundle_drift(parse_bundle(captured.bundle)))
    assert report["modes"] == {"stitch": len(captured.trace.calls)}
    assert report["stitched"] == len(captured.trace.calls) - len(FRESH_STEPS) == 6
    assert report["fresh"] == {"compaction_rewrite": 1, "no_previous_call": 3}
    assert report["continuations"] == report["token_prefix_continuations"] == 6
    result = reconstruct_episode(captured.bundle)
    assert result.accounting.rows == len(result.rows) == CONTEXTS


def test_passthrough_mode_conditions_on_vllms_render(
    captured: Captured, passthrough_runner: EpisodeRunner, vllm_server: VLLMServer
) -> None:
    """``continuation: passthrough``: every prompt is vLLM's render of the messages as sent and
    replays exactly; the drift report shows the re-tokenisation drift (DESIGN §7)."""
    run = asyncio.run(passthrough_runner.run(group_id="accept-passthrough", seed=1, reward=1.0))
    eot = _im_end(vllm_server)
    for call in run.trace.calls:
        record = run.call(call.step)
        assert record["continuation"]["mode"] == "passthrough"
        assert not record["continuation"]["stitched"], call.step
        assert record["prompt_token_ids"] == _tokenize(vllm_server, call.request), call.step
        _assert_replayed(record, _replay_chat(vllm_server, call), call.step, eot)
    report = run.info["continuation"]
    assert report["stitched"] == 0
    fresh = {"compaction_rewrite": 1, "no_previous_call": 3, "passthrough_mode": 6}
    assert report["fresh"] == fresh
    assert report["continuations"] == 6
    assert report["token_prefix_continuations"] == 0  # drift is total on the tiny model
    assert reconstruct_episode(run.bundle).accounting.rows == len(run.trace.calls)
    # Before any continuation the two modes send the same requests: the same samples.
    for step in ("parent.delegate", "worker-a.turn0", "worker-b.turn0"):
        want = captured.call(step)["completion_token_ids"]
        assert run.call(step)["completion_token_ids"] == want, step


def _im_end(server: VLLMServer) -> int:
    response = httpx.post(
        server.base_url + "/tokenize",
        json={
            "model": server.served_model_name,
            "prompt": "<|im_end|>",
            "add_special_tokens": False,
        },
        timeout=30,
    )
    response.raise_for_status()
    tokens: list[int] = response.json()["tokens"]
    assert len(tokens) == 1
    return tokens[0]


def test_seeded_runs_are_reproducible(captured: Captured) -> None:
    """A second run with the same seed samples the same tokens (per-request seeds)."""
    from capture_devkit.harness import close_episode, fetch_bundle, open_episode, run_episode

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

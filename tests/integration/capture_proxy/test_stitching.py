"""Exact-token continuation on the real vLLM with the controlled acceptance episode.

One episode per mode (module-scoped). Stitch mode: every continuation that extends a recorded call
with the same tools is stitched, its prompt equals token for token the base call's prompt +
completion + the template's suffix (checked against vLLM's own render, independently of the
proxy), and the harness still receives parsed tool calls, whole and streamed (the scripted harness
raises if a forced tool call does not come back as ``tool_calls``). Pass-through mode records the
drift: its continuations are not token prefixes.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from capture_contracts.bundle import parse_bundle
from capture_contracts.drift import bundle_drift, drift_report
from capture_devkit.engine import VLLMServer
from capture_devkit.harness import close_episode, fetch_bundle, open_episode, run_episode
from capture_devkit.harness.trace import EpisodeTrace
from capture_proxy.continuation import Continuations
from capture_proxy.message_chain import chain, tools_hash
from capture_proxy.settings import Settings, StoreSettings, UpstreamSettings
from capture_proxy.stitch import reply_message
from capture_proxy.store.records import Admission, ContinuationRecord, Generation
from capture_proxy.store.repository import Store
from capture_proxy.upstream import Upstream
from reconstruct import reconstruct_episode
from tests.fixtures.db import sqlite_url
from tests.fixtures.proxy import ProxyServer, metric_samples

pytestmark = pytest.mark.vllm

Run = tuple[EpisodeTrace, dict[str, Any], dict[str, Any]]


def _run(
    vllm: VLLMServer, store: Path, mode: str, template_dir: Path | None = None
) -> Iterator[Run]:
    settings = Settings(
        store=StoreSettings(url=sqlite_url(store)),
        upstream=UpstreamSettings(url=vllm.base_url),
        continuation=mode,
        continuation_template_dir=template_dir,
    )
    server = ProxyServer(settings, None).start()

    async def episode() -> Run:
        episode_id, base_url = await open_episode(server.url, f"stitch-{mode}")
        trace = await run_episode(base_url, episode_id=episode_id, group_id="g", seed=3)
        closed = await close_episode(server.url, episode_id, 1.0, wait_s=5.0)
        assert closed.status_code == 200, closed.text
        async with httpx.AsyncClient(base_url=server.url) as client:
            info = (await client.get(f"/episodes/{episode_id}")).json()
            info["metrics"] = (await client.get("/metrics")).text  # (the process's, beside it)
        return trace, await fetch_bundle(server.url, episode_id), info

    try:
        yield asyncio.run(episode())
    finally:
        server.stop()


@pytest.fixture(scope="module")
def stitched(vllm_server: VLLMServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    yield from _run(vllm_server, tmp_path_factory.mktemp("stitch") / "c.db", "stitch")


@pytest.fixture(scope="module")
def stitched_here(
    vllm_server: VLLMServer, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Run]:
    """Stitch mode with the model's chat template in the proxy (``continuation_template_dir``)."""
    where = tmp_path_factory.mktemp("stitch-here") / "c.db"
    yield from _run(vllm_server, where, "stitch", tiny_model_dir)


@pytest.fixture(scope="module")
def passthrough(vllm_server: VLLMServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    yield from _run(vllm_server, tmp_path_factory.mktemp("pass") / "c.db", "passthrough")


def _render(vllm: VLLMServer, body: dict[str, Any]) -> list[int]:
    response = httpx.post(f"{vllm.base_url}/v1/chat/completions/render", json=body, timeout=60)
    assert response.status_code == 200, response.text
    ids: list[int] = response.json()["token_ids"]
    return ids


def test_continuations_are_stitched(stitched: Run) -> None:
    trace, bundle, info = stitched
    report = info["continuation"]
    assert report == drift_report(bundle_drift(parse_bundle(bundle)))
    # 10 calls: 3 agent roots, 1 compaction rewrite, every other continuation is stitched —
    # the compaction call too (same tools, tool_choice "none": the same rendered system turn).
    assert report["stitched"] == 6
    assert report["fresh"] == {"compaction_rewrite": 1, "no_previous_call": 3}
    assert report["token_prefix_continuations"] == 6
    # Every chat call's planning is timed by kind; the stitched ones include the renders.
    samples = metric_samples(info["metrics"])
    assert samples['capture_continuation_plan_seconds_count{kind="stitched"}'] == 6
    assert samples['capture_continuation_plan_seconds_count{kind="fresh"}'] == 4
    assert samples['capture_continuation_plan_seconds_sum{kind="stitched"}'] > 0
    by_step = {c.step: c for c in trace.calls}
    calls = {c["call_id"]: c for c in bundle["calls"]}
    for step in (
        "parent.final",
        "worker-a.turn1",
        "worker-a.compact",
        "worker-a.answer",
        "worker-b.answer",
    ):
        assert calls[by_step[step].call_id]["continuation"]["stitched"], step
    assert not calls[by_step["worker-a.turn2"].call_id]["continuation"]["stitched"]
    # a stitch of a head shape seen before takes the full render alone (checked exact below)
    renders = [c["continuation"].get("renders") for c in calls.values() if c["continuation"]]
    assert sorted(r for r in renders if r) in ([1, 1, 2, 2, 2, 2], [1, 1, 1, 2, 2, 2]), renders
    assert report["stitched_on_one_render"] == renders.count(1)


def test_continuations_of_a_known_shape_are_rendered_in_the_proxy(stitched_here: Run) -> None:
    """With the model's template in the proxy, the stitches are those of the engine's renders
    (the next test checks their ids against vLLM's own render), and a head shape seen before —
    its first stitch having compared the proxy's render with the engine's — takes no render of
    the engine's at all: ``renders`` 0 where the engine-rendered run took its full render alone."""
    _, bundle, info = stitched_here
    report = info["continuation"]
    assert (report["stitched"], report["token_prefix_continuations"]) == (6, 6)
    assert report["fresh"] == {"compaction_rewrite": 1, "no_previous_call": 3}
    renders = [c["continuation"].get("renders") for c in bundle["calls"] if c["continuation"]]
    assert sorted(r for r in renders if r is not None) in ([0, 0, 2, 2, 2, 2], [0, 0, 0, 2, 2, 2])
    assert report["stitched_rendered_here"] == renders.count(0)
    assert report["stitched_on_one_render"] == 0


@pytest.mark.parametrize("run", ["stitched", "stitched_here"])
def test_stitched_prompt_is_base_plus_completion_plus_rendered_suffix(
    run: str, vllm_server: VLLMServer, request: pytest.FixtureRequest
) -> None:
    trace, bundle, _ = request.getfixturevalue(run)
    calls = {c["call_id"]: c for c in bundle["calls"]}
    eot = httpx.post(
        f"{vllm_server.base_url}/tokenize",
        json={"model": "tiny", "prompt": "<|im_end|>", "add_special_tokens": False},
    ).json()["tokens"][0]
    checked = 0
    for call in trace.calls:
        record = calls[call.call_id]
        info = record["continuation"]
        if not info["stitched"]:
            continue
        base = calls[info["base_call_id"]]
        request = {k: v for k, v in call.request.items() if k not in {"stream", "stream_options"}}
        full_ids = _render(vllm_server, request)
        base_messages = base["continuation"]["messages"]
        head = request | {
            "messages": call.messages[: base_messages + 1],
            "add_generation_prompt": False,
        }
        head_ids = _render(vllm_server, head)
        assert full_ids[: len(head_ids)] == head_ids
        completion = base["completion_token_ids"]
        if completion[-1] != eot:
            completion = [*completion, eot]
        trailer = head_ids[len(head_ids) - head_ids[::-1].index(eot) :]
        expected = base["prompt_token_ids"] + completion + trailer + full_ids[len(head_ids) :]
        assert record["prompt_token_ids"] == expected, call.step
        assert record["completion_token_ids"] and len(record["completion_logprobs"]) == len(
            record["completion_token_ids"]
        )
        checked += 1
    assert checked == 6


def test_stitched_episode_merges_into_context_rows(stitched: Run, passthrough: Run) -> None:
    rows = reconstruct_episode(stitched[1]).accounting.rows
    assert rows == 4  # one per context: parent, worker-a before/after compaction, worker-b
    drift = passthrough[2]["continuation"]
    assert drift["stitched"] == 0
    assert drift["continuations"] == 6
    assert drift["token_prefix_continuations"] == 0  # re-tokenisation drift (DESIGN §7)
    assert reconstruct_episode(passthrough[1]).accounting.rows == 10


def test_harness_answers_have_the_passthrough_shape(stitched: Run, passthrough: Run) -> None:
    s_trace, p_trace = stitched[0], passthrough[0]
    assert sorted(c.step for c in s_trace.calls) == sorted(c.step for c in p_trace.calls)
    for s_call in s_trace.calls:
        p_call = p_trace.step(s_call.step)
        assert s_call.stream == p_call.stream
        assert [t.name for t in s_call.tool_calls] == [t.name for t in p_call.tool_calls]
        assert [t.arguments for t in s_call.tool_calls] == [t.arguments for t in p_call.tool_calls]
        assert s_call.finish_reason == p_call.finish_reason, s_call.step
        assert (s_call.content is None) == (p_call.content is None), s_call.step


def test_stitched_answers_carry_no_end_of_turn_text(stitched: Run, passthrough: Run) -> None:
    """The text a harness gets back never contains the end-of-turn token (it is not content)."""
    assert not any("<|im_end|>" in (c.content or "") for c in passthrough[0].calls)
    leaked = [c.step for c in stitched[0].calls if "<|im_end|>" in (c.content or "")]
    assert leaked == []
    # the stitched calls that stopped did sample the end-of-turn token: it is captured
    assert any(c.finish_reason == "stop" for c in stitched[0].calls)


def test_stitched_calls_keep_the_requested_max_tokens(stitched: Run) -> None:
    """A stitched call keeps the harness's ``max_tokens`` (the chat route reads it from the
    request; the stitched ids only replace the rendering)."""
    trace, bundle, _ = stitched
    lengths = {c["call_id"]: len(c["completion_token_ids"]) for c in bundle["calls"]}
    stitched_ids = {
        c["call_id"] for c in bundle["calls"] if (c.get("continuation") or {}).get("stitched")
    }
    free = [c for c in trace.calls if "structured_outputs" not in c.request]
    assert any(c.call_id in stitched_ids for c in free)
    for call in trace.calls:
        assert lengths[call.call_id] <= call.request["max_tokens"], call.step


@dataclass(frozen=True)
class _Continued:
    """A recorded call of agent ``a`` (the real engine's answer) and a request continuing it."""

    continuations: Continuations
    episode: str
    base_call_id: str
    body: dict[str, Any]


@pytest.fixture
async def continued(
    vllm_server: VLLMServer, tmp_path: Path, make_store: Callable[..., Store]
) -> AsyncIterator[_Continued]:
    store = make_store(sqlite_url(tmp_path / "c.db"))
    settings = Settings(upstream=UpstreamSettings(url=vllm_server.base_url), continuation="stitch")
    upstream = Upstream(settings.upstream)
    episode = (await store.create_episode("continued")).episode_id
    task = [{"role": "user", "content": "Name a colour."}]
    first = httpx.post(
        f"{vllm_server.base_url}/v1/chat/completions",
        json={"model": "tiny", "messages": task, "max_tokens": 8, "seed": 0}
        | {"logprobs": True, "return_token_ids": True},
        timeout=60,
    ).json()
    [choice] = first["choices"]
    record = ContinuationRecord(
        stitched=False,
        mode="stitch",
        messages=len(task),
        prefix_hash=chain(task)[-1],
        tools_hash=tools_hash({}),
    )
    [call_id] = await store.admit(
        episode, Admission("chat", False, 1, "policy", "a", continuation=record)
    )
    reply = reply_message(choice)
    generation = Generation(
        first["prompt_token_ids"],
        choice["token_ids"],
        [entry["logprob"] for entry in choice["logprobs"]["content"]],
        choice["finish_reason"],
        reply_hash=chain([*task, reply])[-1],
    )
    assert await store.complete(episode, [call_id], [generation])
    body = {
        "model": "tiny",
        "messages": [*task, reply, {"role": "user", "content": "Another one."}],
        "max_tokens": 24,
        "seed": 1,
    }
    try:
        yield _Continued(Continuations(settings, store, upstream), episode, call_id, body)
    finally:
        await upstream.aclose()


async def _chat(continuations: Continuations, body: dict[str, Any]) -> dict[str, Any]:
    reply = await continuations.upstream.post_json("/v1/chat/completions", body)
    assert reply.status_code == 200, reply.body
    return dict(reply.body)


async def test_a_stitched_call_is_the_chat_route_on_the_stitched_ids_stop_strings_included(
    continued: _Continued,
) -> None:
    """A stitched call is one chat request with the stitched ids forwarded
    (``kv_transfer_params.prompt_token_ids``): the engine generates on exactly those ids (its
    answer's ``prompt_token_ids``) and answers as its chat route does — spelled log-probabilities,
    and stop strings cut inside a token, which the token-in route could not do."""
    continuations, episode = continued.continuations, continued.episode
    body = continued.body | {"logprobs": True, "return_token_ids": True}
    plan = await continuations.plan(episode, "chat", "a", body)
    assert plan.record is not None and plan.record.stitched, plan.record
    assert plan.body is not None and plan.upstream_body(body) is plan.body
    ids = plan.body["kv_transfer_params"]["prompt_token_ids"]
    assert plan.record.base_len is not None and len(ids) > plan.record.base_len
    answer = await _chat(continuations, plan.body)
    assert answer["prompt_token_ids"] == ids
    [out] = answer["choices"]
    assert len(out["token_ids"]) == len(out["logprobs"]["content"]) == 24
    assert not any(e["token"].startswith("token_id:") for e in out["logprobs"]["content"])
    text = out["message"]["content"]
    assert "e" in text, text  # (seeded: the stop string below occurs in the free answer)

    stop = body | {"stop": ["e"]}
    plan = await continuations.plan(episode, "chat", "a", stop)
    assert plan.record is not None and plan.record.stitched and plan.body is not None
    answer = await _chat(continuations, plan.body)
    assert answer["prompt_token_ids"] == ids
    [cut] = answer["choices"]
    assert cut["finish_reason"] == "stop" and cut["message"]["content"] == text[: text.index("e")]


def _two_render_ids(
    vllm: VLLMServer, request: dict[str, Any], base: int, tokens: tuple[list[int], list[int]]
) -> list[int]:
    """The stitched prompt from vLLM's own two renders (the head up to the base's reply, the
    full request), computed here independently of the proxy."""
    eot = httpx.post(
        f"{vllm.base_url}/tokenize",
        json={"model": "tiny", "prompt": "<|im_end|>", "add_special_tokens": False},
    ).json()["tokens"][0]
    whole = {k: v for k, v in request.items() if k not in {"stream", "stream_options"}}
    full_ids = _render(vllm, whole)
    head = whole | {"messages": whole["messages"][: base + 1], "add_generation_prompt": False}
    head_ids = _render(vllm, head)
    assert full_ids[: len(head_ids)] == head_ids
    prompt, completion = tokens
    if completion[-1] != eot:
        completion = [*completion, eot]
    trailer = head_ids[len(head_ids) - head_ids[::-1].index(eot) :]
    return prompt + completion + trailer + full_ids[len(head_ids) :]


async def test_a_known_head_shape_is_stitched_on_one_render_with_the_same_ids(
    continued: _Continued, vllm_server: VLLMServer
) -> None:
    """On the tiny model's Qwen-style template an assistant message with text renders the same
    whether it is the last one or not (one with no text does not: its turn lacks the newline
    the generation prompt ends with, so a full render after it does not begin with the base's
    render, and both renders are taken). The first stitch of a head shape takes both renders
    and learns that; the next of the shape takes the full render alone. Every stitched prompt
    equals what vLLM's own two renders give: from a base rendered fresh (its prompt is its
    render), and from a stitched base, known after a restart by the digest of its render kept
    in its record."""
    continuations, episode = continued.continuations, continued.episode
    store = continuations.store
    body = continued.body | {"logprobs": True, "return_token_ids": True}
    expected = _two_render_ids(
        vllm_server, body, 1, await store.call_tokens(continued.base_call_id)
    )
    plans = [await continuations.plan(episode, "chat", "a", body | {"seed": s}) for s in (1, 2)]
    assert [p.record.renders if p.record else None for p in plans] == [2, 1]
    for plan in plans:
        assert plan.body is not None
        assert plan.body["kv_transfer_params"]["prompt_token_ids"] == expected

    # the second call is recorded (stitched), the agent answers and asks again
    second = plans[1]
    assert second.body is not None and second.record is not None
    words = {"structured_outputs": {"regex": "[a-z]{2,6}( [a-z]{2,6}){1,2}"}}  # (text, not "")
    answer = await _chat(continuations, second.body | words)
    [choice] = answer["choices"]
    reply = reply_message(choice)
    assert reply["content"], choice
    messages = [*body["messages"], reply]
    [call_id] = await store.admit(
        episode, Admission("chat", False, 1, "policy", "a", continuation=second.record)
    )
    generation = Generation(
        answer["prompt_token_ids"],
        choice["token_ids"],
        [entry["logprob"] for entry in choice["logprobs"]["content"]],
        choice["finish_reason"],
        reply_hash=chain(messages)[-1],
    )
    assert await store.complete(episode, [call_id], [generation], continued.base_call_id)
    third = body | {"messages": [*messages, {"role": "user", "content": "And a third?"}]}
    expected = _two_render_ids(
        vllm_server, third, len(messages) - 1, await store.call_tokens(call_id)
    )
    settings = Settings(upstream=UpstreamSettings(url=vllm_server.base_url), continuation="stitch")
    restarted = Continuations(settings, store, continuations.upstream)
    plans = [await restarted.plan(episode, "chat", "a", third | {"seed": s}) for s in (3, 4)]
    assert [p.record.base_call_id if p.record else None for p in plans] == [call_id] * 2
    assert [p.record.renders if p.record else None for p in plans] == [2, 1]
    for plan in plans:
        assert plan.body is not None
        assert plan.body["kv_transfer_params"]["prompt_token_ids"] == expected


async def test_requests_the_engine_renders_itself_are_not_stitched(
    continued: _Continued,
) -> None:
    """vLLM ignores forwarded prompt ids for ``echo`` and for messages with non-text parts (it
    renders those): such a continuation is sent as prepared, and its record says why."""
    continuations, episode, body = continued.continuations, continued.episode, continued.body
    question = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    media = body | {"messages": [*body["messages"][:-1], {"role": "user", "content": [question]}]}
    for request, reason in ((body | {"echo": True}, "echo"), (media, "media_content")):
        plan = await continuations.plan(episode, "chat", "a", request)
        assert plan.body is None and plan.upstream_body(request) is request
        assert plan.record is not None and plan.record.reason == reason
        assert plan.record.base_call_id == continued.base_call_id


async def test_a_stitched_stream_is_the_chat_routes_stream_and_equals_the_whole_answer(
    continued: _Continued,
) -> None:
    """Streamed, a stitched call is the engine's own chat stream (one request; no derender per
    batch): the same text, ids and numbers as the whole stitched answer of the same seed, the
    stitched ids as its prompt, and the usage that ends it."""
    continuations, episode = continued.continuations, continued.episode
    body = continued.body | {"max_tokens": 64, "min_tokens": 64}
    body |= {"logprobs": True, "return_token_ids": True}
    plan = await continuations.plan(episode, "chat", "a", body)
    assert plan.body is not None, plan.record
    [expected] = (await _chat(continuations, plan.body))["choices"]

    streamed = body | {"stream": True, "stream_options": {"include_usage": True}}
    plan = await continuations.plan(episode, "chat", "a", streamed)
    assert plan.body is not None, plan.record
    response = await continuations.upstream.open_stream("/v1/chat/completions", plan.body)
    assert response.status_code == 200
    raw = await response.aread()
    await response.aclose()
    events = [e.removeprefix("data: ") for e in raw.decode().split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    prompts = [c["prompt_token_ids"] for c in chunks if c.get("prompt_token_ids")]
    assert prompts == [plan.body["kv_transfer_params"]["prompt_token_ids"]]
    choices = [c["choices"][0] for c in chunks if c.get("choices")]
    text = "".join(c["delta"].get("content") or "" for c in choices)
    assert text == expected["message"]["content"]
    assert [t for c in choices for t in c.get("token_ids") or []] == expected["token_ids"]
    numbers = [e["logprob"] for c in choices for e in (c.get("logprobs") or {}).get("content", [])]
    assert numbers == [e["logprob"] for e in expected["logprobs"]["content"]]
    assert len(expected["token_ids"]) == 64
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 64

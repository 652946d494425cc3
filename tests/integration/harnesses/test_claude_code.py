"""Claude Code 2.1 through the proxy: the real binary, real proxy, real vLLM (issue 13).

Claude Code speaks the Anthropic Messages API (``POST /v1/messages?beta=true``, always streamed);
the proxy translates each request to a chat call and captures it like any other
(:mod:`capture_proxy.translate.messages`). Attribution comes from Claude Code's own headers — the
main thread is its ``X-Claude-Code-Session-Id``, an ``Agent`` subagent sends
``x-claude-code-agent-id`` — and its compaction call (a summary instruction appended to the
agent's own context) is recognised by the default role rules. Only the text the model emits is
scripted (:mod:`tests.integration.harnesses.script`). Each scenario runs in both
``continuation`` modes; the drift report is printed (``-s``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from capture_devkit.engine import VLLMServer
from tests.fixtures.proxy import ProxyFactory
from tests.integration.harnesses.claude_code_run import run_claude_code
from tests.integration.harnesses.episode import (
    call_infos,
    check_episode,
    close_episode,
    open_episode,
    overlapping,
    row_of,
    trains_only,
)
from tests.integration.harnesses.script import ScriptedEngine, Step, call, say
from tests.integration.harnesses.test_opencode import (
    END_OF_TURN,
    WITH_A_RENDER_HERE,
    check_drift,
    start_proxy,
)

pytestmark = pytest.mark.vllm

TASK = "How many fruits are in basket A and basket B together? Use the tools."
ANSWER = "There are 7 fruits."
#: Claude Code checks a compaction's answer for a <summary> block.
SUMMARY = "<summary>Summary: shelf counted, keep going.</summary>"
#: ~13.5k tiny-model tokens of tool output (27 000 characters: under Claude Code's 30 000-character
#: Bash output limit). Worker A's context grows from ~12.5k to ~26.6k tokens; with an auto-compact
#: window of 100k at 23 % (threshold 23k) it compacts once, while the main thread (≤ ~20k) and
#: worker B (≤ ~13k) never do.
PADDING = "printf 'apple %.0s' $(seq 4500)"
COMPACT_ENV = {"CLAUDE_CODE_AUTO_COMPACT_WINDOW": "100000", "CLAUDE_AUTOCOMPACT_PCT_OVERRIDE": "23"}


def bash(command: str) -> tuple[str, dict[str, Any]]:
    return ("Bash", {"command": command, "description": "Count fruit"})


def agent(marker: str) -> tuple[str, dict[str, Any]]:
    prompt = f"{marker}: count the fruit with bash and answer with the number."
    # Foreground subagents (both in one message run concurrently; their answers come back as
    # the Agent tool results). Claude Code's default is background + a later notification.
    return (
        "Agent",
        {
            "description": f"Count {marker}",
            "prompt": prompt,
            "subagent_type": "general-purpose",
            "run_in_background": False,
        },
    )


PARENT_ONLY: dict[str, list[Step]] = {
    "parent": [call(bash("echo 3 apples")), call(bash("echo 4 pears")), say(ANSWER)],
}
WITH_WORKERS: dict[str, list[Step]] = {
    "parent": [call(agent("BASKET-A"), agent("BASKET-B")), say(ANSWER)],
    "worker-a": [call(bash(PADDING)), call(bash("echo 3 apples")), say("3 apples.")],
    "worker-b": [call(bash("echo 4 pears")), say("4 pears.")],
}


def check_answer(result: dict[str, Any]) -> None:
    assert END_OF_TURN not in result["result"]
    assert result["result"] == ANSWER


@WITH_A_RENDER_HERE
def test_parent_only_multi_turn_with_tools(
    vllm_server: VLLMServer,
    proxy_factory: ProxyFactory,
    tiny_model_dir: Path,
    tmp_path: Path,
    continuation: str,
    rendered_here: bool,
) -> None:
    """``rendered_here``: the proxy renders the stitched calls of a head shape it has checked
    against the engine (``continuation_template_dir``), and the episode is captured the same."""
    started = time.monotonic()
    engine = ScriptedEngine(PARENT_ONLY, summary_text=SUMMARY)
    template = tiny_model_dir if rendered_here else None
    proxy = start_proxy(
        engine, vllm_server, proxy_factory, tmp_path, continuation, template_dir=template
    )
    episode = open_episode(proxy.url, "claude-code-fruit")
    result = run_claude_code(episode.base_url, TASK, tmp_path)

    assert result["num_turns"] == 3 and result["subagent_stats"]["spawned"] == 0
    infos = call_infos(proxy.url, episode)
    assert engine.seen == [("parent", i, "policy") for i in range(3)]
    session = result["session_id"]  # the X-Claude-Code-Session-Id of every call
    assert {(c["agent_id"], c["parent_agent_id"], c["role"], c["stream"]) for c in infos} == {
        (session, None, "policy", True)
    }
    # The tool results came back as tool messages of the next chat requests.
    tools = [m["content"] for _, t, b in engine.requests if t == 2 for m in b["messages"]]
    assert "3 apples" in str(tools) and "4 pears" in str(tools)

    bundle = close_episode(proxy.url, episode, reward=1.0)
    check = check_episode(bundle)
    assert check.accounting.counts["trained"] == 3
    children = {p for p in check.parents.values() if p is not None}
    endpoints = [c for c in check.parents if c not in children]
    assert sorted(row.endpoint_call_id for row in check.rows) == sorted(endpoints)
    if continuation == "stitch":
        assert len(check.rows) == 1  # one context, one row: the turns continue on exact tokens
    check_drift(proxy, episode, bundle, "Claude Code")
    assert time.monotonic() - started < 150
    check_answer(result)


@pytest.mark.parametrize("continuation", ["stitch", "passthrough"])
def test_parent_with_two_concurrent_subagents_one_compacting(
    vllm_server: VLLMServer, proxy_factory: ProxyFactory, tmp_path: Path, continuation: str
) -> None:
    started = time.monotonic()
    engine = ScriptedEngine(
        WITH_WORKERS,
        children={"BASKET-A": "worker-a", "BASKET-B": "worker-b"},
        summary_text=SUMMARY,
    )
    proxy = start_proxy(engine, vllm_server, proxy_factory, tmp_path, continuation)
    episode = open_episode(proxy.url, "claude-code-fruit")
    result = run_claude_code(episode.base_url, TASK, tmp_path, extra_env=COMPACT_ENV)

    stats = result["subagent_stats"]
    assert stats["spawned"] == 2 and stats["completed"] == 2
    infos = call_infos(proxy.url, episode)
    by_key: dict[str, list[dict[str, Any]]] = {}
    for info in infos:
        by_key.setdefault(engine.key_of(info["agent_id"]), []).append(info)
    assert set(by_key) == {"parent", "worker-a", "worker-b"}
    session = result["session_id"]
    assert {(c["agent_id"], c["parent_agent_id"]) for c in by_key["parent"]} == {(session, None)}
    worker_ids = {}
    for key in ("worker-b", "worker-a"):
        policy = [c for c in by_key[key] if c["role"] == "policy"]
        assert len({c["agent_id"] for c in policy}) == 1  # x-claude-code-agent-id
        worker_ids[key] = policy[0]["agent_id"]
        assert {c["parent_agent_id"] for c in policy} == {session}
    assert worker_ids["worker-a"] != worker_ids["worker-b"] != session
    # Worker A compacted once, between its second and third policy turns; the compaction call
    # is a side context of worker A (its own label, worker A as its parent).
    assert [c["role"] for c in by_key["worker-a"]] == ["policy", "policy", "compaction", "policy"]
    compaction = by_key["worker-a"][2]
    assert compaction["agent_id"] == f"{worker_ids['worker-a']}/compaction"
    assert compaction["parent_agent_id"] == worker_ids["worker-a"]
    assert {c["role"] for c in by_key["worker-b"] + by_key["parent"]} == {"policy"}
    # The two workers ran concurrently; the parent resumed after both had answered, with their
    # answers as the Agent tool results.
    assert any(overlapping(a, b) for a in by_key["worker-a"] for b in by_key["worker-b"])
    final = by_key["parent"][-1]
    workers_done = max(c["completed_seq"] for k in ("worker-a", "worker-b") for c in by_key[k])
    assert final["admitted_seq"] > workers_done
    resumed = next(b for k, t, b in engine.requests if k == "parent" and t == 1)
    pasted = " ".join(str(m.get("content")) for m in resumed["messages"] if m["role"] == "tool")
    assert "3 apples." in pasted and "4 pears." in pasted
    # Worker A's resumed context starts from the summary.
    after = next(b for k, t, b in engine.requests if k == "worker-a" and t == 2)
    assert any("Summary: shelf counted" in str(m.get("content")) for m in after["messages"])

    bundle = close_episode(proxy.url, episode, reward=1.0)
    check = check_episode(bundle)
    assert check.accounting.counts["trained"] == len(infos)  # policy + compaction, all kept
    parent_ids = {c["call_id"] for c in by_key["parent"]}
    assert trains_only(row_of(check, final["call_id"]), parent_ids)
    if continuation == "stitch":
        # The compaction call continues worker A's exact tokens (its first turn, the context it
        # summarises): a child in the forest, sharing that row's prefix, not a ~29k-token root.
        assert check.parents[compaction["call_id"]] == by_key["worker-a"][0]["call_id"]
    check_drift(proxy, episode, bundle, "Claude Code")
    assert time.monotonic() - started < 200
    check_answer(result)

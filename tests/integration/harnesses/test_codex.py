"""The Codex CLI 0.169 through the proxy: the real binary, real proxy, real vLLM (issue 13).

Codex speaks the OpenAI Responses API (``POST /v1/responses``, streamed, ``store: false``, the
whole history every turn); the proxy translates each request to a chat call and captures it like
any other (:mod:`capture_proxy.translate.responses`). Attribution comes from Codex's own headers:
the agent is the thread (``thread_id`` of ``x-codex-turn-metadata``), a sub-agent thread names its
parent in ``x-codex-parent-thread-id``; its compaction call (``request_kind: compaction``) gets
the ``compaction`` role by the default rules. Sub-agents are Codex's ``multi_agent_v1`` tools
(``spawn_agent``, ``wait_agent``; a namespace tool, answered with its ``namespace``). Only the text
the model emits is scripted; the parent's waits are chosen from what Codex told it (the agent ids
``spawn_agent`` returned, and which have completed).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from capture_devkit.engine import VLLMServer
from tests.fixtures.proxy import ProxyFactory
from tests.integration.harnesses.codex_run import run_codex
from tests.integration.harnesses.episode import (
    call_infos,
    check_episode,
    close_episode,
    continuation_report,
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
#: Codex keeps ~10k characters of a command's output (~5k tiny-model tokens). Worker A's context
#: grows from ~10.4k tokens to ~15.5k and ~20.7k with two such outputs; with an auto-compact
#: limit of 17k it compacts once, while the parent (≤ ~15k) and worker B (≤ ~10.6k) never do.
COMPACT_LIMIT = ("model_auto_compact_token_limit=17000",)


def shell(command: str) -> tuple[str, dict[str, Any]]:
    return ("exec_command", {"cmd": command})


def spawn(marker: str) -> tuple[str, dict[str, Any]]:
    return ("spawn_agent", {"message": f"{marker}: count the fruit with exec_command, answer."})


def wait_then_answer(body: dict[str, Any]) -> Step:
    """``wait_agent`` on the spawned agents that have not completed yet; then the answer."""
    messages = body["messages"]
    spawned = []
    for index, message in enumerate(messages):
        text = str(message.get("content"))
        if message["role"] == "tool" and '"agent_id"' in text:
            spawned.append((index, json.loads(text)["agent_id"]))
    pending = [
        agent
        for index, agent in spawned
        if not any(
            agent in str(m.get("content")) and "completed" in str(m.get("content"))
            for m in messages[index + 1 :]
        )
    ]
    if pending:
        return call(("wait_agent", {"targets": pending, "timeout_ms": 300000}))
    return say(ANSWER)


PARENT_ONLY: dict[str, list[Step]] = {
    "parent": [call(shell("echo 3 apples")), call(shell("echo 4 pears")), say(ANSWER)],
}
WITH_WORKERS: dict[str, list[Step]] = {
    "parent": [call(spawn("BASKET-A"), spawn("BASKET-B"))] + [Step(dynamic=wait_then_answer)] * 4,
    "worker-a": [
        call(shell("printf 'apple %.0s' $(seq 2700)")),
        call(shell("printf 'pear %.0s' $(seq 2700)")),
        call(shell("echo 3 apples")),
        say("3 apples."),
    ],
    "worker-b": [call(shell("echo 4 pears")), say("4 pears.")],
}


def check_answer(stdout: str) -> None:
    assert END_OF_TURN not in stdout
    assert stdout.strip().splitlines()[-1] == ANSWER


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
    engine = ScriptedEngine(PARENT_ONLY)
    template = tiny_model_dir if rendered_here else None
    proxy = start_proxy(
        engine, vllm_server, proxy_factory, tmp_path, continuation, template_dir=template
    )
    episode = open_episode(proxy.url, "codex-fruit")
    stdout = run_codex(episode.base_url, TASK, tmp_path)

    infos = call_infos(proxy.url, episode)
    assert engine.seen == [("parent", i, "policy") for i in range(3)]
    assert len({c["agent_id"] for c in infos}) == 1  # the thread id
    assert {(c["parent_agent_id"], c["role"], c["stream"]) for c in infos} == {
        (None, "policy", True)
    }
    outputs = [str(m["content"]) for _, t, b in engine.requests if t == 2 for m in b["messages"]]
    assert any("3 apples" in o for o in outputs) and any("4 pears" in o for o in outputs)

    bundle = close_episode(proxy.url, episode, reward=1.0)
    check = check_episode(bundle)
    assert check.accounting.counts["trained"] == 3
    children = {p for p in check.parents.values() if p is not None}
    endpoints = [c for c in check.parents if c not in children]
    assert sorted(row.endpoint_call_id for row in check.rows) == sorted(endpoints)
    if continuation == "stitch":
        assert len(check.rows) == 1
    check_drift(proxy, episode, bundle, "Codex")
    assert time.monotonic() - started < 150
    check_answer(stdout)


@pytest.mark.parametrize("continuation", ["stitch", "passthrough"])
def test_parent_with_two_concurrent_subagents_one_compacting(
    vllm_server: VLLMServer, proxy_factory: ProxyFactory, tmp_path: Path, continuation: str
) -> None:
    started = time.monotonic()
    engine = ScriptedEngine(WITH_WORKERS, children={"BASKET-A": "worker-a", "BASKET-B": "worker-b"})
    proxy = start_proxy(engine, vllm_server, proxy_factory, tmp_path, continuation)
    episode = open_episode(proxy.url, "codex-fruit")
    stdout = run_codex(episode.base_url, TASK, tmp_path, config=COMPACT_LIMIT)

    infos = call_infos(proxy.url, episode)
    by_key: dict[str, list[dict[str, Any]]] = {}
    for info in infos:
        by_key.setdefault(engine.key_of(info["agent_id"]), []).append(info)
    assert set(by_key) == {"parent", "worker-a", "worker-b"}
    root = {c["agent_id"] for c in by_key["parent"]}
    assert len(root) == 1 and {c["parent_agent_id"] for c in by_key["parent"]} == {None}
    for key in ("worker-a", "worker-b"):
        assert len({c["agent_id"] for c in by_key[key]}) == 1  # its thread
        assert {c["parent_agent_id"] for c in by_key[key]} == root  # x-codex-parent-thread-id
    roles = [c["role"] for c in by_key["worker-a"]]
    assert roles == ["policy", "policy", "compaction", "policy", "policy"]
    assert {c["role"] for c in by_key["worker-b"] + by_key["parent"]} == {"policy"}
    assert any(overlapping(a, b) for a in by_key["worker-a"] for b in by_key["worker-b"])
    final = by_key["parent"][-1]
    workers_done = max(c["completed_seq"] for k in ("worker-a", "worker-b") for c in by_key[k])
    assert final["admitted_seq"] > workers_done
    answered = [b for k, _, b in engine.requests if k == "parent"][-1]
    reported = " ".join(str(m.get("content")) for m in answered["messages"])
    assert "3 apples." in reported and "4 pears." in reported  # the workers' answers, pasted
    after = next(b for k, t, b in engine.requests if k == "worker-a" and t == 2)
    assert any("Summary: shelf counted" in str(m.get("content")) for m in after["messages"])

    bundle = close_episode(proxy.url, episode, reward=1.0)
    check = check_episode(bundle)
    assert check.accounting.counts["trained"] == len(infos)
    parent_ids = {c["call_id"] for c in by_key["parent"]}
    assert trains_only(row_of(check, final["call_id"]), parent_ids)
    report = check_drift_codex(proxy, episode, bundle)
    if continuation == "stitch":
        assert report["fresh"].get("compaction_rewrite") == 1  # worker A after its summary
    assert time.monotonic() - started < 240
    check_answer(stdout)


def check_drift_codex(proxy: Any, episode: Any, bundle: dict[str, Any]) -> dict[str, Any]:
    """The OpenCode drift checks hold, except that Codex's compaction call drops the tools (a
    new system turn: ``tools_changed``) — the report is still complete and consistent."""
    report = continuation_report(proxy.url, episode)
    mode = proxy.settings.continuation
    assert report["modes"] == {mode: len(bundle["calls"])}
    assert report["stitched"] + sum(report["fresh"].values()) == len(bundle["calls"])
    if mode == "stitch":
        assert report["stitched"] == report["token_prefix_continuations"] > 0
    print(f"\nCodex drift ({mode}): {json.dumps(report)}")
    return report

"""OpenCode 1.18 through the proxy: the real binary, real proxy, real vLLM (DESIGN §4, §7).

Attribution comes from OpenCode's own ``x-session-id``/``x-parent-session-id`` headers and its
compaction prompt — no harness changes. Only the text the model emits is scripted
(:mod:`tests.integration.harnesses.script`, a request-transform hook forcing
``structured_outputs``). Each scenario runs in both ``continuation`` modes (issue 7); the drift
report is printed (``-s``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from capture_devkit.engine import VLLMServer
from tests.fixtures.db import sqlite_url
from tests.fixtures.proxy import ProxyFactory, ProxyServer
from tests.integration.harnesses.episode import (
    Episode,
    call_infos,
    check_episode,
    close_episode,
    continuation_report,
    open_episode,
    overlapping,
    row_of,
    trains_only,
)
from tests.integration.harnesses.opencode_run import provider_config, run_opencode
from tests.integration.harnesses.script import ScriptedEngine, Step, call, say

pytestmark = pytest.mark.vllm

TASK = "How many fruits are in basket A and basket B together? Use the tools."
ANSWER = "There are 7 fruits."
BIG = {"limit": {"context": 32000, "output": 512}}
# Worker A's prompts are ~5.95k tokens (system prompt + tools); its first turn emits a long
# command (≥ 200 tokens), so its usage crosses 6064 = 6320 - 256 and OpenCode compacts; the
# resumed context (summary, ~6.0k tokens + a short answer) stays under it, so it compacts once.
SMALL = {"limit": {"context": 6320, "output": 256}}
PADDING = "apple " * 200
END_OF_TURN = "<|im_end|>"


def bash(command: str) -> tuple[str, dict[str, Any]]:
    return ("bash", {"command": command, "description": "Count fruit"})


def task(marker: str, agent: str) -> tuple[str, dict[str, Any]]:
    prompt = f"{marker}: count the fruit with bash and answer with the number."
    return ("task", {"description": f"Count {marker}", "prompt": prompt, "subagent_type": agent})


PARENT_ONLY: dict[str, list[Step]] = {
    "parent": [call(bash("echo 3 apples")), call(bash("echo 4 pears")), say(ANSWER)],
}
WITH_WORKERS: dict[str, list[Step]] = {
    "parent": [call(task("BASKET-A", "counter-a"), task("BASKET-B", "counter-b")), say(ANSWER)],
    "worker-a": [call(bash(f"echo 3 apples # {PADDING}")), say("3 apples.")],
    "worker-b": [call(bash("echo 4 pears")), say("4 pears.")],
}
AGENTS = {
    "counter-a": {
        "mode": "subagent",
        "description": "Counts the apples in basket A.",
        "prompt": "You count apples.",
        "model": "capture/tiny-small",  # small limit.context: compacts from real usage
    },
    "counter-b": {
        "mode": "subagent",
        "description": "Counts the pears in basket B.",
        "prompt": "You count pears.",
    },
}


#: Both continuation modes, and stitching with the chat template rendered in the proxy
#: (``continuation_template_dir``: ``rendered_here``), for harnesses' parent-only scenarios.
WITH_A_RENDER_HERE = pytest.mark.parametrize(
    ("continuation", "rendered_here"),
    [("stitch", False), ("passthrough", False), ("stitch", True)],
    ids=["stitch", "passthrough", "stitch-rendered-in-the-proxy"],
)


def start_proxy(
    engine: ScriptedEngine,
    vllm: VLLMServer,
    factory: ProxyFactory,
    tmp_path: Path,
    continuation: str,
    stream_interval: int | None = None,
    template_dir: Path | None = None,
) -> ProxyServer:
    return factory(
        sqlite_url(tmp_path / "capture.db"),
        upstream_url=vllm.base_url,
        upstream={
            "transform": engine,
            "served_model": vllm.served_model_name,
            "stream_interval": stream_interval,
        },
        continuation=continuation,
        continuation_template_dir=template_dir,
    )


def check_answer(events: list[dict[str, Any]], continuation: str) -> None:
    """OpenCode's last text is the scripted answer (checked last: everything else is enforced)."""
    answer = texts(events)[-1]
    assert END_OF_TURN not in answer, f"the end-of-turn token leaked into the text ({continuation})"
    assert answer == ANSWER


def check_drift(
    proxy: ProxyServer, episode: Episode, bundle: dict[str, Any], harness: str = "OpenCode"
) -> None:
    """The drift report covers every call in the proxy's mode; printed for the record."""
    report = continuation_report(proxy.url, episode)
    infos = bundle["calls"]
    print(f"\n{harness} drift ({proxy.settings.continuation}): {json.dumps(report)}")
    for record in sorted(infos, key=lambda c: c["admitted_seq"]):
        info = record["continuation"] or {}
        print(
            f"  {record['agent_id']} {record['role']} prompt={len(record['prompt_token_ids'])} "
            f"stitched={info.get('stitched')} reason={info.get('reason')}"
            f" renders={info.get('renders')}"
        )
    mode = proxy.settings.continuation
    assert report["modes"] == {mode: len(infos)}
    assert report["stitched"] + sum(report["fresh"].values()) == len(infos)
    if mode == "passthrough":
        assert report["stitched"] == 0
    else:
        # Every call that extends an earlier one of its agent is stitched (observed: 2 of 2 in
        # each scenario; OpenCode's compaction call has its own system prompt, a new context).
        assert report["stitched"] == report["continuations"] == report["token_prefix_continuations"]
    if proxy.settings.continuation_template_dir is not None:
        # The first stitch of a head shape compares the proxy's render with the engine's two;
        # the next of the same shape is rendered in the proxy alone.
        renders = [(c["continuation"] or {}).get("renders") for c in infos]
        assert {r for r in renders if r is not None} == {0, 2}, renders
        assert report["stitched_rendered_here"] == renders.count(0)


def texts(events: list[dict[str, Any]]) -> list[str]:
    return [e["part"]["text"] for e in events if e.get("type") == "text"]


def tool_outputs(events: list[dict[str, Any]], tool: str) -> list[str]:
    parts = [e["part"] for e in events if e.get("type") == "tool_use"]
    return [str(p["state"].get("output", "")) for p in parts if p.get("tool") == tool]


@pytest.mark.parametrize(
    ("continuation", "stream_interval", "rendered_here"),
    [
        ("stitch", None, False),
        ("passthrough", None, False),
        ("stitch", 8, False),
        ("stitch", None, True),
    ],
    ids=["stitch", "passthrough", "stitch-8-tokens-a-chunk", "stitch-rendered-in-the-proxy"],
)
def test_parent_only_multi_turn_with_tools(
    vllm_server: VLLMServer,
    proxy_factory: ProxyFactory,
    tiny_model_dir: Path,
    tmp_path: Path,
    continuation: str,
    stream_interval: int | None,
    rendered_here: bool,
) -> None:
    """``stream_interval`` 8 (``upstream.stream_interval``): OpenCode reads the engine's tool
    calls and text from deltas of up to 8 tokens, and the episode is captured the same.
    ``rendered_here`` (``continuation_template_dir``): the first stitched call checks the
    proxy's render of the model's template against the engine's, the second (same head shape)
    is rendered in the proxy alone — and the episode is captured the same."""
    started = time.monotonic()
    engine = ScriptedEngine(PARENT_ONLY)
    template = tiny_model_dir if rendered_here else None
    proxy = start_proxy(
        engine, vllm_server, proxy_factory, tmp_path, continuation, stream_interval, template
    )
    episode = open_episode(proxy.url, "opencode-fruit")
    config = provider_config({"tiny": BIG})
    events = run_opencode(episode.base_url, TASK, config, tmp_path)
    assert [o.strip() for o in tool_outputs(events, "bash")] == ["3 apples", "4 pears"]

    infos = call_infos(proxy.url, episode)
    assert [(k, t, r) for k, t, r in engine.seen] == [("parent", i, "policy") for i in range(3)]
    assert len({c["agent_id"] for c in infos}) == 1 and infos[0]["agent_id"].startswith("ses_")
    assert {(c["parent_agent_id"], c["role"], c["stream"]) for c in infos} == {
        (None, "policy", True)
    }
    bundle = close_episode(proxy.url, episode, reward=1.0)
    result = check_episode(bundle)
    assert result.accounting.counts["trained"] == 3
    # One row per context: one per endpoint of the forest (a continuation shares its row).
    children = {p for p in result.parents.values() if p is not None}
    endpoints = [c for c in result.parents if c not in children]
    assert sorted(row.endpoint_call_id for row in result.rows) == sorted(endpoints)
    check_drift(proxy, episode, bundle)
    assert time.monotonic() - started < 120
    check_answer(events, continuation)


@pytest.mark.parametrize("continuation", ["stitch", "passthrough"])
def test_parent_with_two_concurrent_subagents_one_compacting(
    vllm_server: VLLMServer, proxy_factory: ProxyFactory, tmp_path: Path, continuation: str
) -> None:
    started = time.monotonic()
    engine = ScriptedEngine(WITH_WORKERS, children={"BASKET-A": "worker-a", "BASKET-B": "worker-b"})
    proxy = start_proxy(engine, vllm_server, proxy_factory, tmp_path, continuation)
    episode = open_episode(proxy.url, "opencode-fruit")
    config = provider_config({"tiny": BIG, "tiny-small": SMALL}, AGENTS)
    events = run_opencode(episode.base_url, TASK, config, tmp_path)

    infos = call_infos(proxy.url, episode)
    by_key: dict[str, list[dict[str, Any]]] = {}
    for info in infos:
        by_key.setdefault(engine.key_of(info["agent_id"]), []).append(info)
    assert set(by_key) == {"parent", "worker-a", "worker-b"}
    # Attribution from OpenCode's session headers; roles from its compaction prompt.
    root = {c["agent_id"] for c in by_key["parent"]}
    assert len(root) == 1 and {c["parent_agent_id"] for c in by_key["parent"]} == {None}
    for key in ("worker-a", "worker-b"):
        assert len({c["agent_id"] for c in by_key[key]}) == 1
        assert {c["parent_agent_id"] for c in by_key[key]} == root
    assert [c["role"] for c in by_key["worker-a"]] == ["policy", "compaction", "policy"]
    assert {c["role"] for c in by_key["worker-b"] + by_key["parent"]} == {"policy"}
    # The two workers ran concurrently; the parent resumed after both had answered.
    assert any(overlapping(a, b) for a in by_key["worker-a"] for b in by_key["worker-b"])
    final = by_key["parent"][-1]
    workers_done = max(c["completed_seq"] for k in ("worker-a", "worker-b") for c in by_key[k])
    assert final["admitted_seq"] > workers_done
    resumed = next(b for k, t, b in engine.requests if k == "parent" and t == 1)
    pasted = " ".join(str(m.get("content")) for m in resumed["messages"] if m["role"] == "tool")
    assert "3 apples." in pasted and "4 pears." in pasted

    bundle = close_episode(proxy.url, episode, reward=1.0)
    result = check_episode(bundle)
    assert result.accounting.counts["trained"] == len(infos)  # policy + compaction, no failures
    # The workers' answers are prompt tokens of the parent's resumed call: masked there.
    parent_ids = {c["call_id"] for c in by_key["parent"]}
    assert trains_only(row_of(result, final["call_id"]), parent_ids)
    check_drift(proxy, episode, bundle)
    assert time.monotonic() - started < 120
    check_answer(events, continuation)

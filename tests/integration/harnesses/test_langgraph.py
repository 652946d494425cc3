"""LangGraph through the proxy (DESIGN §4, §7): a supervisor fans out to two workers with ``Send``.

Real LangGraph, real ``ChatOpenAI`` (``base_url`` at the episode), real proxy, real vLLM. Workers
are tagged per node with ``default_headers``; ``invoke`` sends ``stream: false`` and
``stream(stream_mode="messages")`` sends ``stream: true``. The two workers run concurrently, and
the supervisor's final call pastes their answers into its own context (masked there). Runs in
both ``continuation`` modes (issue 7): in ``stitch`` mode the supervisor's final call continues its
plan call's exact tokens, so the supervisor's context is one row.
"""

from __future__ import annotations

import operator
import threading
from pathlib import Path
from typing import Annotated, Any, TypedDict

import pytest
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph
from langgraph.types import Send

from capture_devkit.engine import VLLMServer
from tests.fixtures.db import sqlite_url
from tests.fixtures.proxy import ProxyFactory, ProxyServer
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

pytestmark = pytest.mark.vllm

SUPERVISOR_SYSTEM = "You are the supervisor. Split the task between two workers, then answer."
WORKER_SYSTEM = "You are a worker. Answer your sub-task in one sentence."
TASK = "How many fruits are in basket A and basket B together?"
WORKERS = {"worker-a": "Count the apples in basket A.", "worker-b": "Count the pears in basket B."}


class State(TypedDict, total=False):
    task: str
    plan: list[BaseMessage]
    results: Annotated[list[str], operator.add]
    answer: str


class WorkerInput(TypedDict):
    name: str
    subtask: str


def chat_model(base_url: str, model: str, agent: str, parent: str | None, seed: int) -> ChatOpenAI:
    """One ChatOpenAI per node: the node's agent id rides on its default headers."""
    headers = {"X-Agent-Id": agent}
    if parent is not None:
        headers["X-Parent-Agent-Id"] = parent
    return ChatOpenAI(
        base_url=base_url,
        api_key="episode-key",
        model=model,
        temperature=1.0,
        max_tokens=24,
        seed=seed,
        default_headers=headers,
        extra_body={"min_tokens": 16},
        max_retries=0,
    )


def build_graph(base_url: str, model: str) -> Any:
    supervisor = chat_model(base_url, model, "supervisor", None, seed=1)
    workers = {
        name: chat_model(base_url, model, name, "supervisor", seed=10 + i)
        for i, name in enumerate(WORKERS)
    }
    both_started = threading.Barrier(len(WORKERS), timeout=30)

    def plan(state: State) -> State:
        messages: list[BaseMessage] = [
            SystemMessage(SUPERVISOR_SYSTEM),
            HumanMessage(state["task"]),
        ]
        reply = supervisor.invoke(messages)
        return {"plan": [*messages, reply]}

    def fan_out(state: State) -> list[Send]:
        return [Send("worker", {"name": n, "subtask": t}) for n, t in WORKERS.items()]

    def worker(state: WorkerInput) -> State:
        both_started.wait()  # LangGraph runs the Send branches concurrently: prove it
        reply = workers[state["name"]].invoke(
            [SystemMessage(WORKER_SYSTEM), HumanMessage(state["subtask"])]
        )
        return {"results": [f"{state['name']}: {reply.content}"]}

    def final(state: State) -> State:
        pasted = "\n".join(sorted(state["results"]))
        messages = [*state["plan"], HumanMessage(f"The workers answered:\n{pasted}\nAnswer now.")]
        reply = supervisor.invoke(messages)
        assert isinstance(reply, AIMessage)
        return {"answer": str(reply.content)}

    graph = StateGraph(State)
    graph.add_node("plan", plan)
    graph.add_node("worker", worker, input_schema=WorkerInput)
    graph.add_node("final", final)
    graph.add_edge(START, "plan")
    graph.add_conditional_edges("plan", fan_out, ["worker"])
    graph.add_edge("worker", "final")
    graph.add_edge("final", END)
    return graph.compile()


@pytest.fixture(params=["stitch", "passthrough"])
def proxy(
    vllm_server: VLLMServer,
    proxy_factory: ProxyFactory,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> ProxyServer:
    return proxy_factory(
        sqlite_url(tmp_path / "capture.db"),
        upstream_url=vllm_server.base_url,
        continuation=request.param,
    )


@pytest.mark.parametrize("mode", ["invoke", "stream"])
def test_supervisor_and_two_concurrent_workers(
    proxy: ProxyServer, vllm_server: VLLMServer, mode: str
) -> None:
    episode = open_episode(proxy.url, "langgraph-fruit")
    graph = build_graph(episode.base_url, vllm_server.served_model_name)
    if mode == "invoke":
        final_state = graph.invoke({"task": TASK})
        assert final_state["answer"]
    else:
        chunks = list(graph.stream({"task": TASK}, stream_mode="messages"))
        streamed_nodes = {meta["langgraph_node"] for _chunk, meta in chunks}
        assert streamed_nodes == {"plan", "worker", "final"}

    infos = call_infos(proxy.url, episode)
    assert [c["stream"] for c in infos] == [mode == "stream"] * 4
    by_agent: dict[str, list[dict[str, Any]]] = {}
    for info in infos:
        by_agent.setdefault(info["agent_id"], []).append(info)
    assert {a: len(c) for a, c in by_agent.items()} == {
        "supervisor": 2,
        "worker-a": 1,
        "worker-b": 1,
    }
    assert {c["parent_agent_id"] for c in by_agent["supervisor"]} == {None}
    assert all(c["parent_agent_id"] == "supervisor" for c in infos if c["agent_id"] != "supervisor")
    assert {c["role"] for c in infos} == {"policy"}
    worker_a, worker_b = by_agent["worker-a"][0], by_agent["worker-b"][0]
    assert overlapping(worker_a, worker_b), "the Send branches ran concurrently"
    plan_call, final_call = sorted(by_agent["supervisor"], key=lambda c: c["admitted_seq"])
    assert final_call["admitted_seq"] > max(worker_a["completed_seq"], worker_b["completed_seq"])

    bundle = close_episode(proxy.url, episode, reward=1.0)
    result = check_episode(bundle)
    assert result.accounting.counts["trained"] == 4
    # The workers' answers are prompt tokens of the supervisor's final call: masked there.
    final_row = row_of(result, final_call["call_id"])
    assert final_call["call_id"] in {s.call_id for s in final_row.spans if s.owned}
    assert trains_only(final_row, {plan_call["call_id"], final_call["call_id"]})
    for worker_call in (worker_a, worker_b):
        assert row_of(result, worker_call["call_id"]) is not final_row

    # The drift report: only the supervisor's final call continues an earlier call.
    report = continuation_report(proxy.url, episode)
    if proxy.settings.continuation == "stitch":
        assert report["stitched"] == 1 and report["fresh"] == {"no_previous_call": 3}
        assert report["token_prefix_continuations"] == 1
        assert row_of(result, plan_call["call_id"]) is final_row  # one row per context
        assert len(result.rows) == 3
    else:
        assert report["stitched"] == 0
        assert report["fresh"] == {"no_previous_call": 3, "passthrough_mode": 1}
    assert report["continuations"] == 1

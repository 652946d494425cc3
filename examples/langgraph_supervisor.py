"""The smallest LangGraph run through the capture proxy: a supervisor and two `Send` workers.

capture-proxy serve --upstream http://127.0.0.1:8000   # vLLM serving the model as "tiny"
python examples/langgraph_supervisor.py http://127.0.0.1:8100
"""

from __future__ import annotations

import operator
import sys
from typing import Annotated, TypedDict

import httpx
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph
from langgraph.types import Send


class Job(TypedDict):
    name: str
    task: str


class State(TypedDict, total=False):
    task: str
    results: Annotated[list[str], operator.add]
    answer: str


def main(proxy: str, model: str = "tiny") -> None:
    episode = httpx.post(f"{proxy}/episodes", json={"group_id": "example"}).json()

    def llm(agent: str, parent: str | None = None) -> ChatOpenAI:
        headers = {"X-Agent-Id": agent} | ({"X-Parent-Agent-Id": parent} if parent else {})
        return ChatOpenAI(
            base_url=episode["base_url"],
            api_key="unused",
            model=model,
            default_headers=headers,
            max_tokens=32,
        )

    supervisor = llm("supervisor")
    workers = {name: llm(name, "supervisor") for name in ("worker-a", "worker-b")}

    def fan_out(state: State) -> list[Send]:
        return [Send("worker", {"name": n, "task": state["task"]}) for n in workers]

    def worker(state: Job) -> State:
        reply = workers[state["name"]].invoke(f"{state['name']}, do your half of: {state['task']}")
        return {"results": [str(reply.content)]}

    def final(state: State) -> State:
        reply = supervisor.invoke(f"{state['task']}\nWorkers said: {state['results']}")
        return {"answer": str(reply.content)}

    graph = StateGraph(State)
    graph.add_node("worker", worker, input_schema=Job)
    graph.add_node("final", final)
    graph.add_conditional_edges(START, fan_out, ["worker"])
    graph.add_edge("worker", "final")
    graph.add_edge("final", END)
    print(graph.compile().invoke({"task": "Count the fruit in baskets A and B."})["answer"])
    closed = httpx.post(
        f"{proxy}/episodes/{episode['episode_id']}/close", json={"reward": 1.0, "wait_s": 30}
    )
    print(closed.json()["calls"])


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8100")

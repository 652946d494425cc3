"""The controlled episode (MISSION acceptance), driven through the proxy by a script.

Workers mode::

    parent.delegate   forced tool calls: task(worker-a), task(worker-b)
    ├─ worker-a  turn0, turn1 (forced `look` calls + tool results), compact (X-Call-Role:
    │            compaction; same tools, tool_choice "none": it continues worker-a's history),
    │            turn2 in a fresh context that starts from the summary,
    │            answer — only after worker-b has answered
    └─ worker-b  (starts once the proxy has admitted worker-a's first call; streamed) turn0,
                 turn1, answer
    parent.final      history + both answers pasted as tool results (in delegation order)

The schedule is fixed by the proxy's own order, not by timing: worker-b's first request is sent
only once ``GET /episodes/{id}`` counts worker-a's first call as admitted, and worker-a's answer
only once worker-b's answer has been received (the proxy commits a completion before the harness
gets its last byte). So worker-a is admitted first and worker-b finishes first, however loaded
the machine is.

Parent-only mode (the single-agent baseline) does the same counting itself: ``parent.look0`` …,
then ``parent.final``. ``labelled=False`` sends no agent headers at all.

The script never follows the model's text: tool calls are forced through vLLM's
``structured_outputs`` regex, free-text answers are seeded (``seed`` per request), so a run with
the same seed sends the same requests and vLLM samples the same tokens.
"""

from __future__ import annotations

import asyncio
import json
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from capture_contracts.vocabulary import Role
from capture_devkit.harness.client import AgentClient, tool_call_text
from capture_devkit.harness.trace import CallTrace, EpisodeTrace, Mode

PARENT_SYSTEM = "You are the lead agent. Delegate the counting, then report the total."
WORKER_SYSTEM = "You are a worker agent. Look at every shelf, then answer with the count."
COMPACTION_PROMPT = "Summarise the conversation so far in one short paragraph."
TASK = "How many fruits are in basket A and basket B together?"

TASK_TOOL = {
    "type": "function",
    "function": {
        "name": "task",
        "description": "Start a worker agent on a sub-task and return its answer.",
        "parameters": {
            "type": "object",
            "properties": {"worker": {"type": "string"}, "prompt": {"type": "string"}},
            "required": ["worker", "prompt"],
        },
    },
}
LOOK_TOOL = {
    "type": "function",
    "function": {
        "name": "look",
        "description": "Count the fruit on one shelf of a basket.",
        "parameters": {
            "type": "object",
            "properties": {"basket": {"type": "string"}, "shelf": {"type": "integer"}},
            "required": ["basket", "shelf"],
        },
    },
}


@dataclass(frozen=True, slots=True)
class WorkerScript:
    name: str  # the agent id, e.g. "worker-a"
    basket: str
    prompt: str
    turns: int  # forced `look` turns before the answer
    compact_before: int | None = None  # compact before this turn (a fresh context follows)
    stream: bool = False


@dataclass(frozen=True, slots=True)
class EpisodeScript:
    task: str = TASK
    first: WorkerScript = WorkerScript(
        "worker-a", "A", "Count the apples in basket A.", turns=3, compact_before=2
    )
    second: WorkerScript = WorkerScript(
        "worker-b", "B", "Count the pears in basket B.", turns=2, stream=True
    )
    parent_only_looks: int = 2


DEFAULT_SCRIPT = EpisodeScript()


def step_seed(seed: int, step: str) -> int:
    """A per-request seed: fixed by the episode seed and the script position."""
    return seed * 1000 + zlib.crc32(step.encode()) % 997


def shelf_count(seed: int, basket: str, shelf: int) -> int:
    return (seed * 7 + ord(basket) * 3 + shelf * 5) % 9 + 1


def _look_result(seed: int, basket: str, shelf: int) -> str:
    return f"basket {basket} shelf {shelf}: {shelf_count(seed, basket, shelf)} fruits"


class _Run:
    """One episode in progress: the agents' clients and their traces."""

    def __init__(
        self,
        base_url: str,
        model: str,
        seed: int,
        labelled: bool,
        admin_key: str | None = None,
        free_max_tokens: int | None = None,
        worker_role: Role | None = None,
    ) -> None:
        self.base_url = base_url
        self.model = model
        self.seed = seed
        self.labelled = labelled
        self.admin_key = admin_key
        self.free_max_tokens = free_max_tokens
        self.worker_role = worker_role  # overrides the workers' roles (parent-only training)
        self.agents: list[AgentClient] = []

    async def wait_admitted(self, count: int, timeout_s: float = 120.0) -> None:
        """Block until the proxy has admitted ``count`` calls of this episode (its REST API)."""
        proxy_url, _, rest = self.base_url.rstrip("/").rpartition("/episodes/")
        episode_id = rest.split("/", 1)[0]
        headers = {"Authorization": f"Bearer {self.admin_key}"} if self.admin_key else {}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        async with httpx.AsyncClient(base_url=proxy_url, headers=headers, timeout=30) as client:
            while True:
                try:
                    response = await client.get(f"/episodes/{episode_id}")
                    response.raise_for_status()
                    if int(response.json()["calls"]["admitted"]) >= count:
                        return
                except httpx.TransportError:  # a kept-alive connection closed under us: again
                    pass
                if loop.time() > deadline:
                    raise RuntimeError(f"{count} admitted calls not seen in {timeout_s:.0f} s")
                await asyncio.sleep(0.01)

    def agent(self, name: str, parent: str | None = None) -> AgentClient:
        client = AgentClient(
            self.base_url,
            name=name,
            model=self.model,
            agent_id=name if self.labelled else None,
            parent_agent_id=parent if self.labelled else None,
            free_max_tokens=self.free_max_tokens,
        )
        self.agents.append(client)
        return client

    async def close(self) -> None:
        for client in self.agents:
            await client.close()

    def traces(self) -> tuple[CallTrace, ...]:
        calls = [trace for client in self.agents for trace in client.traces]
        return tuple(sorted(calls, key=lambda c: c.started_s))

    async def look_turn(
        self,
        client: AgentClient,
        step: str,
        messages: list[dict[str, Any]],
        basket: str,
        shelf: int,
        *,
        stream: bool = False,
        role: Role = "policy",
    ) -> list[dict[str, Any]]:
        """A forced `look` tool call, then the history continued with its tool result."""
        forced = tool_call_text([("look", {"basket": basket, "shelf": shelf})])
        trace = await client.call(
            step,
            messages,
            seed=step_seed(self.seed, step),
            tools=[LOOK_TOOL],
            forced=forced,
            stream=stream,
            role=role,
        )
        result = {
            "role": "tool",
            "tool_call_id": trace.tool_calls[0].id,
            "content": _look_result(self.seed, basket, shelf),
        }
        return [*messages, trace.assistant_message(), result]


async def _worker(
    run: _Run,
    script: WorkerScript,
    *,
    start_after: int | None = None,
    answer_after: asyncio.Event | None = None,
    done: asyncio.Event | None = None,
) -> str:
    if start_after is not None:  # the other worker's first call is admitted (and generating)
        await run.wait_admitted(start_after)
    client = run.agent(script.name, parent="parent")
    opening = [
        {"role": "system", "content": WORKER_SYSTEM},
        {"role": "user", "content": script.prompt},
    ]
    messages = list(opening)
    for turn in range(script.turns):
        if script.compact_before == turn:
            step = f"{script.name}.compact"
            summary = await client.call(
                step,
                [*messages, {"role": "user", "content": COMPACTION_PROMPT}],
                seed=step_seed(run.seed, step),
                tools=[LOOK_TOOL],  # kept, as harnesses do for prompt-cache reuse: it extends
                tool_choice="none",  # the worker's exact tokens, but may not call a tool
                role=run.worker_role or "compaction",
                stream=script.stream,
            )
            fresh = f"{script.prompt}\n\nSummary of the work so far: {summary.content or ''}"
            messages = [opening[0], {"role": "user", "content": fresh}]
        step = f"{script.name}.turn{turn}"
        messages = await run.look_turn(
            client,
            step,
            messages,
            script.basket,
            turn,
            stream=script.stream,
            role=run.worker_role or "policy",
        )
    if answer_after is not None:
        await answer_after.wait()
    step = f"{script.name}.answer"
    answer = await client.call(
        step,
        messages,
        seed=step_seed(run.seed, step),
        tools=[LOOK_TOOL],
        stream=script.stream,
        role=run.worker_role or "policy",
    )
    if done is not None:
        done.set()
    return answer.content or ""


async def _parent_with_workers(run: _Run, script: EpisodeScript) -> None:
    parent = run.agent("parent")
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": PARENT_SYSTEM},
        {"role": "user", "content": script.task},
    ]
    workers = (script.first, script.second)
    forced = tool_call_text([("task", {"worker": w.name, "prompt": w.prompt}) for w in workers])
    step = "parent.delegate"
    delegate = await parent.call(
        step, messages, seed=step_seed(run.seed, step), tools=[TASK_TOOL], forced=forced
    )
    second_done = asyncio.Event()
    first_admitted = 2  # the delegation, then worker-a's first call
    answers = await asyncio.gather(
        _worker(run, script.first, answer_after=second_done),
        _worker(run, script.second, start_after=first_admitted, done=second_done),
    )
    results = [
        {"role": "tool", "tool_call_id": call.id, "content": answer}
        for call, answer in zip(delegate.tool_calls, answers, strict=True)
    ]
    messages = [*messages, delegate.assistant_message(), *results]
    step = "parent.final"
    await parent.call(step, messages, seed=step_seed(run.seed, step), tools=[TASK_TOOL])


async def _parent_only(run: _Run, script: EpisodeScript) -> None:
    parent = run.agent("parent")
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": PARENT_SYSTEM},
        {"role": "user", "content": script.task},
    ]
    baskets = [script.first.basket, script.second.basket]
    for i in range(script.parent_only_looks):
        messages = await run.look_turn(parent, f"parent.look{i}", messages, baskets[i % 2], i)
    step = "parent.final"
    await parent.call(step, messages, seed=step_seed(run.seed, step), tools=[LOOK_TOOL])


async def run_episode(
    base_url: str,
    *,
    episode_id: str,
    group_id: str,
    seed: int,
    mode: Mode = "workers",
    model: str = "tiny",
    labelled: bool = True,
    script: EpisodeScript = DEFAULT_SCRIPT,
    admin_key: str | None = None,
    free_max_tokens: int | None = None,
    worker_role: Role | None = None,
) -> EpisodeTrace:
    """Run the controlled episode against an open episode's ``base_url`` (…/episodes/{id}/v1).

    ``admin_key`` is the proxy's, if it has one (the schedule reads the episode's admissions);
    ``free_max_tokens`` bounds the free-text answers (default ``client.FREE_MAX_TOKENS``);
    ``worker_role`` sends every worker call with that role (``auxiliary``: the workers' calls
    are conditioning only, for parent-only training).
    """
    run = _Run(base_url, model, seed, labelled, admin_key, free_max_tokens, worker_role)
    try:
        if mode == "workers":
            await _parent_with_workers(run, script)
        else:
            await _parent_only(run, script)
    finally:
        await run.close()
    return EpisodeTrace(
        episode_id=episode_id,
        group_id=group_id,
        base_url=base_url,
        mode=mode,
        seed=seed,
        labelled=labelled,
        calls=run.traces(),
    )


# -- the episode REST API (plain httpx: not part of the OpenAI surface) -----------------------


async def open_episode(
    proxy_url: str, group_id: str, episode_id: str | None = None, **metadata: Any
) -> tuple[str, str]:
    """Create an episode; returns ``(episode_id, base_url)``."""
    body: dict[str, Any] = {"group_id": group_id, "metadata": metadata}
    if episode_id is not None:
        body["episode_id"] = episode_id
    async with httpx.AsyncClient(base_url=proxy_url, timeout=30) as client:
        response = await client.post("/episodes", json=body)
        response.raise_for_status()
        data = response.json()
    return str(data["episode_id"]), str(data["base_url"])


async def close_episode(
    proxy_url: str,
    episode_id: str,
    reward: float,
    *,
    wait_s: float = 0.0,
    cancel_outstanding: bool = False,
    discarded_calls: Sequence[str] = (),
) -> httpx.Response:
    """Close an episode with its reward; the raw response (200, or 409 with outstanding calls)."""
    body = {
        "reward": reward,
        "wait_s": wait_s,
        "cancel_outstanding": cancel_outstanding,
        "discarded_calls": list(discarded_calls),
    }
    async with httpx.AsyncClient(base_url=proxy_url, timeout=60) as client:
        return await client.post(f"/episodes/{episode_id}/close", json=body)


async def fetch_bundle(proxy_url: str, episode_id: str) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=proxy_url, timeout=60) as client:
        response = await client.get(f"/episodes/{episode_id}/bundle")
        response.raise_for_status()
        bundle: dict[str, Any] = response.json()
    return bundle


def dumps_trace(trace: EpisodeTrace) -> str:
    """The trace as JSON (for files next to the bundles)."""
    return json.dumps(
        {
            "episode_id": trace.episode_id,
            "group_id": trace.group_id,
            "mode": trace.mode,
            "seed": trace.seed,
            "labelled": trace.labelled,
            "calls": [
                {
                    "step": c.step,
                    "call_id": c.call_id,
                    "agent_id": c.agent_id,
                    "role": c.role,
                    "stream": c.stream,
                    "content": c.content,
                    "tool_calls": [t.to_message() for t in c.tool_calls],
                    "finish_reason": c.finish_reason,
                    "request": c.request,
                }
                for c in trace.calls
            ],
        },
        indent=1,
    )

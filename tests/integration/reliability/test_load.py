"""Load with real processes (issue 12, part 5): nothing lost, nothing duplicated, exact accounting.

500 concurrent calls — half streamed, chat and completions — across 100 episodes of three agents
each (``X-Agent-Id`` / ``X-Parent-Agent-Id``), through ``capture-proxy serve`` as a real process
in front of the stub engine as a real server: on a real SQLite file, on the real PostgreSQL, and
with two proxy processes sharing one PostgreSQL store (each episode's calls alternate between
them, so every agent's calls land on both). Afterwards the store is read directly:

* every call id a client was answered with (``X-Capture-Call-Id``) is in the store exactly once,
  ``completed``, with the agent, endpoint, stream flag and (two proxies) instance it was sent
  with, and the store holds no call the clients were not answered with;
* the tokens recorded for each call are the ones its client sent and received (no crossed wires);
* per episode the admission and completion numbers are unique: together exactly 1 … 2n;
* every streamed reply ended with ``[DONE]``; no status but 200;
* every episode closes, and the reconstruction job trains every call (the accounting adds up).

The proxy's peak RSS, the wall time and the rate are printed (``pytest -s``) and recorded in
docs/reliability.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pyarrow.parquet as pq
from sqlalchemy import select
from sqlalchemy.ext.asyncio import create_async_engine

from capture_proxy.store.models import Call, Instance
from tests.fixtures.db import sqlite_url
from tests.support import processes
from tests.support.processes import Process

EPISODES = 100
#: One episode's calls, in the order they are sent: (agent, parent agent, endpoint).
SCRIPT: tuple[tuple[str, str | None, str], ...] = (
    ("planner", None, "chat"),
    ("worker-a", "planner", "chat"),
    ("worker-a", "planner", "completions"),
    ("worker-b", "planner", "chat"),
    ("worker-b", "planner", "chat"),
)
CALLS = EPISODES * len(SCRIPT)
#: The stub engine's model that takes its time, as a real engine does: a token every 0.2 s.
MODEL = "fake-slow"
#: Connections the clients may hold at once: that many calls in flight at the proxy (or proxies).
CONNECTIONS = 250
#: A generous ceiling on one proxy's peak RSS (measured: see docs/reliability.md).
RSS_CEILING_MB = 400.0
#: The whole load, from the first request to the last byte (measured: a few seconds).
WALL_CEILING_S = 60.0


@dataclass(frozen=True, slots=True)
class Planned:
    """One call a harness makes: its episode, agent, endpoint, and a tag unique to it."""

    episode_id: str
    index: int  # in the episode, 0 … len(SCRIPT) - 1
    agent_id: str
    parent_agent_id: str | None
    endpoint: str  # chat | completions
    stream: bool

    @property
    def tag(self) -> str:
        return f"{self.episode_id}/call-{self.index}"

    @property
    def path(self) -> str:
        route = "chat/completions" if self.endpoint == "chat" else "completions"
        return f"/episodes/{self.episode_id}/v1/{route}"

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"model": MODEL, "stream": self.stream}
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": f"{self.agent_id}: do {self.tag}"}]
        else:
            body["prompt"] = f"{self.agent_id}: complete {self.tag}"
        return body

    def headers(self) -> dict[str, str]:
        headers = {"X-Agent-Id": self.agent_id}
        if self.parent_agent_id is not None:
            headers["X-Parent-Agent-Id"] = self.parent_agent_id
        return headers


@dataclass(frozen=True, slots=True)
class Received:
    """What the client got back."""

    planned: Planned
    proxy: Process
    status: int
    call_id: str | None
    text: str  # the completion text, joined from the stream's deltas when streamed
    ended_with_done: bool  # streamed: the last event was [DONE]
    errors: tuple[Any, ...]  # error events in the stream, or the error body of a whole answer


@dataclass(frozen=True, slots=True)
class Figures:
    wall_s: float
    calls_per_s: float
    peak_rss_mb: tuple[float, ...]  # per proxy process
    max_in_flight: int  # most calls admitted and not yet completed at once (the store's clocks)


class OnTheWire:
    """Requests sent and not yet fully answered, at most, counted by httpcore's trace events."""

    def __init__(self) -> None:
        self.now = self.most = 0
        self.gate = asyncio.Semaphore(CONNECTIONS)  # the clients' connections, all together

    async def __call__(self, event: str, info: dict[str, Any]) -> None:
        if event == "http11.send_request_headers.started":
            self.now += 1
            self.most = max(self.most, self.now)
        elif event == "http11.response_closed.started":
            self.now -= 1


def plan_calls() -> list[Planned]:
    calls = []
    for e in range(EPISODES):
        for i, (agent, parent, endpoint) in enumerate(SCRIPT):
            stream = (e * len(SCRIPT) + i) % 2 == 0  # half of every kind streamed
            calls.append(Planned(f"ep-load-{e:03d}", i, agent, parent, endpoint, stream))
    return calls


def _text_of(endpoint: str, choice: dict[str, Any], *, delta: bool) -> str:
    if endpoint == "completions":
        return str(choice.get("text") or "")
    message = choice.get("delta" if delta else "message") or {}
    return str(message.get("content") or "")


def _read_stream(endpoint: str, raw: bytes) -> tuple[str, bool, list[Any]]:
    """The completion text, whether the last event was [DONE], and any error events."""
    datas = [e.removeprefix("data: ") for e in raw.decode().split("\n\n") if e.strip()]
    chunks = [json.loads(data) for data in datas if data != "[DONE]"]
    errors = [chunk["error"] for chunk in chunks if "error" in chunk]
    text = "".join(
        _text_of(endpoint, choice, delta=True)
        for chunk in chunks
        for choice in chunk.get("choices", ())
    )
    return text, bool(datas) and datas[-1] == "[DONE]", errors


async def _send(
    client: httpx.AsyncClient, proxy: Process, call: Planned, wire: OnTheWire
) -> Received:
    async with wire.gate:
        return await _send_now(client, proxy, call, wire)


async def _send_now(
    client: httpx.AsyncClient, proxy: Process, call: Planned, wire: OnTheWire
) -> Received:
    request = client.build_request(
        "POST",
        proxy.url + call.path,
        json=call.body(),
        headers=call.headers(),
        extensions={"trace": wire},
    )
    reply = await client.send(request, stream=True)
    try:
        raw = await reply.aread()
    finally:
        await reply.aclose()
    text, done, errors = "", False, []
    if reply.status_code == 200 and call.stream:
        text, done, errors = _read_stream(call.endpoint, raw)
    elif reply.status_code == 200:
        [choice] = json.loads(raw)["choices"]
        text = _text_of(call.endpoint, choice, delta=False)
    else:
        errors = [raw.decode(errors="replace")[:500]]
    call_id = reply.headers.get("x-capture-call-id")
    return Received(call, proxy, reply.status_code, call_id, text, done, tuple(errors))


async def _load(
    proxies: Sequence[Process], calls: Sequence[Planned]
) -> tuple[list[Received], float, int]:
    """Open the episodes, then send every call at once (index i of an episode to proxy i % k).

    Each episode's harness has its own client, as separate harness processes would (one pool of
    hundreds of connections costs httpx a poll of every idle one per request). Answers the
    replies, the wall time of the calls, and the most requests on the wire at once.
    """
    limits = httpx.Limits(max_connections=len(SCRIPT))
    tls = ssl.create_default_context()  # unused on http://, but built per client unless given
    async with contextlib.AsyncExitStack() as stack:
        clients = {
            f"ep-load-{e:03d}": await stack.enter_async_context(
                httpx.AsyncClient(limits=limits, timeout=120, verify=tls)
            )
            for e in range(EPISODES)
        }

        async def open_episode(e: int, episode_id: str) -> None:
            created = await clients[episode_id].post(
                f"{proxies[e % len(proxies)].url}/episodes",
                json={"group_id": f"g-{e % 10}", "episode_id": episode_id},
            )
            assert created.status_code == 201, created.text

        await asyncio.gather(*(open_episode(e, ep) for e, ep in enumerate(clients)))
        wire = OnTheWire()
        start = time.perf_counter()
        received = await asyncio.gather(
            *(_send(clients[c.episode_id], proxies[c.index % len(proxies)], c, wire) for c in calls)
        )
        return list(received), time.perf_counter() - start, wire.most


def _max_overlap(intervals: Sequence[tuple[datetime, datetime]]) -> int:
    edges = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    level = most = 0
    for _, step in edges:
        level += step
        most = max(most, level)
    return most


async def _stored_calls(db_url: str) -> list[Any]:
    engine = create_async_engine(db_url)
    try:
        async with engine.connect() as conn:
            rows = await conn.execute(
                select(
                    Call.call_id,
                    Call.episode_id,
                    Call.status,
                    Call.agent_id,
                    Call.parent_agent_id,
                    Call.endpoint,
                    Call.stream,
                    Call.admitted_seq,
                    Call.completed_seq,
                    Call.admitted_at,
                    Call.completed_at,
                    Instance.name,
                ).outerjoin(Instance, Instance.instance_id == Call.instance_id)
            )
            return list(rows)
    finally:
        await engine.dispose()


def _assert_replies(received: Sequence[Received]) -> dict[str, Received]:
    """Every call answered 200 with its own call id; every stream ended with [DONE]."""
    statuses = Counter(r.status for r in received)
    errors = [(r.planned.tag, r.status, r.errors) for r in received if r.errors]
    assert statuses == {200: CALLS} and not errors, (statuses, errors[:5])
    ids = [r.call_id for r in received]
    assert None not in ids and len(set(ids)) == CALLS, "a call id missing or answered twice"
    unfinished = [r.planned.tag for r in received if r.planned.stream and not r.ended_with_done]
    assert not unfinished, f"streams that did not end with [DONE]: {unfinished[:5]}"
    assert all(r.text for r in received)
    return {r.call_id: r for r in received if r.call_id is not None}


def _assert_store(stored: Sequence[Any], by_id: dict[str, Received]) -> int:
    """Exactly the answered calls, once each, completed, as sent; sequence numbers unique."""
    stored_ids = [row.call_id for row in stored]
    assert len(stored_ids) == len(set(stored_ids))
    assert set(stored_ids) == set(by_id), (
        f"lost: {sorted(set(by_id) - set(stored_ids))[:5]}, "
        f"unknown to the clients: {sorted(set(stored_ids) - set(by_id))[:5]}"
    )
    seqs: dict[str, list[int]] = {}
    for row in stored:
        sent = by_id[row.call_id].planned
        assert row.status == "completed", (row.call_id, row.status)
        assert (row.episode_id, row.agent_id, row.parent_agent_id) == (
            sent.episode_id,
            sent.agent_id,
            sent.parent_agent_id,
        )
        assert (row.endpoint, row.stream) == (sent.endpoint, sent.stream)
        assert row.name.endswith(f":{by_id[row.call_id].proxy.port}"), "recorded by another proxy"
        assert row.admitted_seq < row.completed_seq
        seqs.setdefault(row.episode_id, []).extend([row.admitted_seq, row.completed_seq])
    assert len(seqs) == EPISODES
    for episode_id, numbers in seqs.items():
        assert sorted(numbers) == list(range(1, 2 * len(SCRIPT) + 1)), (episode_id, numbers)
    return _max_overlap([(row.admitted_at, row.completed_at) for row in stored])


def _assert_tokens(bundle: dict[str, Any], by_id: dict[str, Received]) -> None:
    """Each call's recorded prompt holds its own tag, its completion is what its client got."""
    assert len(bundle["calls"]) == len(SCRIPT)
    for record in bundle["calls"]:
        got = by_id[record["call_id"]]
        prompt = bytes(t - 3 for t in record["prompt_token_ids"]).decode()  # the stub's ids
        assert got.planned.tag in prompt
        completion = "".join(chr(97 + t % 26) for t in record["completion_token_ids"])
        assert completion == got.text, (got.planned.tag, completion, got.text)


async def _check_and_close(proxies: Sequence[Process], by_id: dict[str, Received]) -> None:
    """Per episode, concurrently: its bundle, its accounting, then its close (with two proxies,
    by the one that did not open it)."""
    limits = httpx.Limits(max_connections=20)
    async with httpx.AsyncClient(limits=limits, timeout=120) as client:

        async def one(e: int) -> None:
            episode_id = f"ep-load-{e:03d}"
            url = f"{proxies[(e + 1) % len(proxies)].url}/episodes/{episode_id}"
            _assert_tokens((await client.get(f"{url}/bundle")).json(), by_id)
            info = (await client.get(url)).json()
            assert info["calls"] == {
                "admitted": len(SCRIPT),
                "completed": len(SCRIPT),
                "failed": 0,
                "cancelled": 0,
                "in_flight": 0,
            }, info["calls"]
            closed = await client.post(f"{url}/close", json={"reward": 1.0})
            assert closed.status_code == 200 and closed.json()["status"] == "closed", closed.text

        await asyncio.gather(*(one(e) for e in range(EPISODES)))


def _reconstruct(db_url: str, out: Path, by_id: dict[str, Received]) -> None:
    """The reconstruction job exports every episode and trains every call, one row each."""
    argv = [sys.executable, "-m", "capture_proxy.cli", "reconstruct", "--db", db_url]
    job = subprocess.run(
        [*argv, "--out", str(out)], capture_output=True, text=True, timeout=300, check=False
    )
    assert job.returncode == 0, job.stderr
    summary = json.loads(job.stdout)
    assert summary["exported_episodes"] == EPISODES and not summary["refused"], summary
    episodes: dict[str, Any] = {}
    for report in out.glob("report-*.json"):
        episodes |= json.loads(report.read_text())["episodes"]
    assert len(episodes) == EPISODES
    trained = set()
    for episode_id, accounting in episodes.items():
        counts = accounting["counts"]
        assert sum(counts.values()) == accounting["n_calls"] == len(SCRIPT), (episode_id, counts)
        assert counts["trained"] == len(SCRIPT), (episode_id, counts)
        trained |= set(accounting["classification"])
        assert {by_id[c].planned.episode_id for c in accounting["classification"]} == {episode_id}
    assert trained == set(by_id)
    rows = [r for p in out.glob("rows-*.parquet") for r in pq.read_table(p).to_pylist()]
    assert Counter(r["episode_id"] for r in rows) == {
        f"ep-load-{e:03d}": len(SCRIPT) for e in range(EPISODES)
    }  # no prompt extends another: one row per call


def run_load_case(name: str, proxies: Sequence[Process], db_url: str, out: Path) -> Figures:
    began = time.perf_counter()
    received, wall_s, on_the_wire = asyncio.run(_load(proxies, plan_calls()))
    peaks = tuple(p.peak_rss_mb() for p in proxies)
    by_id = _assert_replies(received)
    max_in_flight = _assert_store(asyncio.run(_stored_calls(db_url)), by_id)
    checked = time.perf_counter()
    asyncio.run(_check_and_close(proxies, by_id))
    closed = time.perf_counter()
    _reconstruct(db_url, out, by_id)
    figures = Figures(wall_s, CALLS / wall_s, peaks, max_in_flight)
    print(
        f"\nload[{name}]: {CALLS} calls in {wall_s:.2f} s = {figures.calls_per_s:.0f} calls/s; "
        f"peak RSS {', '.join(f'{mb:.0f}' for mb in peaks)} MB; "
        f"at most {on_the_wire} requests on the wire, {max_in_flight} calls admitted at once; "
        f"opening and store checks {checked - began - wall_s:.1f} s, bundles and closes "
        f"{closed - checked:.1f} s, reconstruction {time.perf_counter() - closed:.1f} s"
    )
    assert wall_s < WALL_CEILING_S
    assert all(mb < RSS_CEILING_MB for mb in peaks), peaks
    assert on_the_wire >= 100 and max_in_flight >= 100, "the load was not concurrent"
    return figures


@contextmanager
def _serve(tmp_path: Path, db_url: str, engine: Process, count: int) -> Iterator[list[Process]]:
    proxies = []
    try:
        for _ in range(count):
            proxies.append(processes.proxy(tmp_path, db_url, engine.url).start())
        yield proxies
    finally:
        for proxy in proxies:
            proxy.stop()


def test_load_on_sqlite(tmp_path: Path, engine: Process) -> None:
    db = sqlite_url(tmp_path / "capture.db")
    with _serve(tmp_path, db, engine, 1) as proxies:
        run_load_case("sqlite", proxies, db, tmp_path / "rows")


def test_load_on_postgres(tmp_path: Path, engine: Process, postgres_store: str) -> None:
    with _serve(tmp_path, postgres_store, engine, 1) as proxies:
        run_load_case("postgres", proxies, postgres_store, tmp_path / "rows")


def test_load_on_two_proxies_sharing_postgres(
    tmp_path: Path, engine: Process, postgres_store: str
) -> None:
    with _serve(tmp_path, postgres_store, engine, 2) as proxies:
        run_load_case("postgres, 2 proxies", proxies, postgres_store, tmp_path / "rows")

"""The benchmarks' processes under test and how a load on them is measured (issue 11).

``process`` starts a server in its own process group and stops the group; ``measure`` runs one
load (benchmarks/loadkit.py) against a port and reads the requests/s, p50/p99 latency and — given
a process — its CPU per call and RSS; ``interleaved`` loads several targets in slices taken in
turn, so that all of them see the same drift of the machine.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from loadkit import process_cpu_s, process_rss_mb, run_load

CHAT = json.dumps(
    {"model": "stub", "messages": [{"role": "user", "content": "What is two plus two?"}]}
).encode()


STREAM = json.dumps(
    {
        "model": "stub",
        "stream": True,
        "messages": [{"role": "user", "content": "What is two plus two?"}],
    }
).encode()


def _wait_http(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.TransportError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} not up in {timeout_s} s")


@contextmanager
def process(args: Sequence[str], url: str, env: dict[str, str] | None = None) -> Iterator[int]:
    """A server started in its own process group, once ``url`` answers; its pid."""
    proc = subprocess.Popen(list(args), env=env, start_new_session=True)
    try:
        _wait_http(url, proc)
        yield proc.pid
    finally:
        stop_group(proc)


def stop_group(proc: subprocess.Popen[Any]) -> None:
    """Stop a process started in its own group, and the group: SIGTERM, SIGKILL after 20 s."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def new_episodes(proxy_url: str, n: int) -> list[str]:
    episodes = []
    for _ in range(n):
        answer = httpx.post(f"{proxy_url}/episodes", json={"group_id": "bench"})
        if answer.status_code >= 300:  # (say what answered, not a KeyError)
            raise SystemExit(f"POST {proxy_url}/episodes: {answer.status_code} {answer.text[:300]}")
        episodes.append(answer.json()["episode_id"])
    return episodes


def store_url(kind: str, tmp: Path) -> str:
    if kind == "sqlite":
        return f"sqlite+aiosqlite:///{tmp / 'bench.db'}"
    import asyncpg

    name = f"bench_{os.getpid()}"

    async def create() -> None:
        conn = await asyncpg.connect(host="127.0.0.1", user="postgres", database="test")
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        await conn.execute(f'CREATE DATABASE "{name}"')
        await conn.close()

    asyncio.run(create())
    return f"postgresql+asyncpg://postgres@127.0.0.1:5432/{name}"


def measure_slice(
    port: int,
    paths: Sequence[str],
    body: bytes,
    concurrency: int,
    duration: float,
    pid: int | None,
    headers: Sequence[tuple[str, str]] = (),
) -> dict[str, Any]:
    """One slice of load, raw: its latencies, time and the process's CPU (``combine`` them)."""
    cpu0 = process_cpu_s(pid) if pid else 0.0
    loop0 = process_cpu_s(pid, pid) if pid else 0.0
    result, elapsed = asyncio.run(
        run_load("127.0.0.1", port, paths, body, concurrency, duration, headers)
    )
    raw: dict[str, Any] = {
        "latencies": result.latencies,
        "seconds": elapsed,
        "errors": result.errors,
        "statuses": result.statuses,
    }
    if pid:
        raw["cpu_s"] = process_cpu_s(pid) - cpu0
        # The event loop's thread; the rest is the store's writer thread (and any helper).
        raw["loop_cpu_s"] = process_cpu_s(pid, pid) - loop0
        raw["rss_mb"] = process_rss_mb(pid)
    return raw


def combine(slices: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Slices of one target as one measurement: calls, time and CPU added up, percentiles over
    all the slices' latencies."""
    latencies = [x for raw in slices for x in raw["latencies"]]
    calls = len(latencies)
    statuses: dict[int, int] = {}
    for raw in slices:
        for status, count in raw["statuses"].items():
            statuses[status] = statuses.get(status, 0) + count
    out: dict[str, Any] = {
        "calls": calls,
        "errors": sum(raw["errors"] for raw in slices),
        "statuses": statuses,
        "rps": calls / sum(raw["seconds"] for raw in slices),
        "p50_ms": 1000 * _percentile(latencies, 0.5),
        "p99_ms": 1000 * _percentile(latencies, 0.99),
    }
    if "cpu_s" in slices[0]:
        out["cpu_ms_per_call"] = 1000 * sum(raw["cpu_s"] for raw in slices) / max(calls, 1)
        out["loop_cpu_ms_per_call"] = (
            1000 * sum(raw["loop_cpu_s"] for raw in slices) / max(calls, 1)
        )
        out["rss_mb"] = slices[-1]["rss_mb"]
    return out


def measure(
    port: int,
    paths: Sequence[str],
    body: bytes,
    concurrency: int,
    duration: float,
    pid: int | None,
    headers: Sequence[tuple[str, str]] = (),
) -> dict[str, Any]:
    """Requests/s, p50/p99 and (with ``pid``) the process's CPU per call under this load."""
    return combine([measure_slice(port, paths, body, concurrency, duration, pid, headers)])


@dataclass(frozen=True)
class Target:
    """One thing loaded in an interleaved run: a port, its paths and body, whose CPU is read."""

    port: int
    paths: Sequence[str]
    body: bytes
    pid: int | None = None
    headers: Sequence[tuple[str, str]] = ()


def interleaved(
    targets: dict[str, Target], concurrency: int, duration: float, slices: int
) -> dict[str, dict[str, Any]]:
    """Each target loaded for ``duration`` in all, in ``slices`` slices taken in turn (the order
    rotating each time), so all of them see the same drift of the machine — which here reaches
    2× over minutes — and their ratios hold; one measurement per target."""
    raw: dict[str, list[dict[str, Any]]] = {name: [] for name in targets}
    names = list(targets)
    for i in range(slices):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            t = targets[name]
            raw[name].append(
                measure_slice(
                    t.port, t.paths, t.body, concurrency, duration / slices, t.pid, t.headers
                )
            )
    return {name: combine(slices_) for name, slices_ in raw.items()}

"""The acceptance episode's schedule holds on a loaded machine (issue 16 item 4).

Worker-b's first request is sent only once the proxy counts worker-a's first call as admitted,
and worker-a's answer only once worker-b's answer came back; so worker-a is admitted first and
worker-b finishes first whatever the timing. Here the episode runs while CPU hogs (one per core,
plus one) compete with vLLM, the proxy and the harness: the order must still be the scripted one.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration.acceptance.conftest import EpisodeRunner

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _spin() -> None:  # pragma: no cover - runs in a child process
    while True:
        pass


@pytest.fixture
def loaded_machine() -> Iterator[None]:
    hogs = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(os.cpu_count() or 2)]
    hogs.append(multiprocessing.Process(target=_spin, daemon=True))
    for hog in hogs:
        hog.start()
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.join(timeout=10)


def _first(calls: list[dict[str, Any]], agent: str) -> dict[str, Any]:
    return min((c for c in calls if c["agent_id"] == agent), key=lambda c: c["admitted_seq"])


def _last(calls: list[dict[str, Any]], agent: str) -> dict[str, Any]:
    return max((c for c in calls if c["agent_id"] == agent), key=lambda c: c["completed_seq"])


@pytest.mark.parametrize("seed", [11, 12])
def test_worker_a_admitted_first_worker_b_finishes_first_under_load(
    episode_runner: EpisodeRunner, loaded_machine: None, seed: int
) -> None:
    captured = asyncio.run(episode_runner.run(group_id="loaded", seed=seed, reward=0.0))
    calls = captured.bundle["calls"]
    a_first, b_first = _first(calls, "worker-a"), _first(calls, "worker-b")
    assert a_first["admitted_seq"] < b_first["admitted_seq"]
    assert _last(calls, "worker-b")["completed_seq"] < _last(calls, "worker-a")["completed_seq"]
    # worker-b was sent only after worker-a's first call was admitted (the harness's trace).
    assert (
        captured.trace.step("worker-b.turn0").started_s
        > captured.trace.step("worker-a.turn0").started_s
    )

"""The controlled episode, captured once per test module on the real vLLM and the real proxy.

``captured`` runs the MISSION episode (parent, two overlapping workers, compaction in one, reversed
completion order, parent resumption) through the proxy on SQLite, closes it, and hands tests the
harness's trace, the episode bundle and the episode's REST view (with its drift report). The proxy
runs with the default settings — ``continuation: stitch`` (issue 7). Further episodes
(parent-only, unlabelled, a GRPO group) are run with ``episode_runner``; ``passthrough_runner``
runs episodes through a second proxy in ``continuation: passthrough`` mode.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from capture_devkit.engine import VLLMServer
from capture_devkit.harness import close_episode, fetch_bundle, open_episode, run_episode
from capture_devkit.harness.trace import EpisodeTrace, Mode
from capture_proxy.settings import Settings, StoreSettings, UpstreamSettings
from tests.fixtures.db import sqlite_url
from tests.fixtures.proxy import ProxyServer


@dataclass(frozen=True)
class Captured:
    trace: EpisodeTrace
    bundle: dict[str, Any]
    info: dict[str, Any]  # GET /episodes/{id}: status, accounting, the drift report

    def call(self, step: str) -> dict[str, Any]:
        """The bundle's record of one script step."""
        call_id = self.trace.step(step).call_id
        return next(c for c in self.bundle["calls"] if c["call_id"] == call_id)


class EpisodeRunner:
    def __init__(self, proxy: ProxyServer) -> None:
        self.proxy = proxy

    async def run(
        self,
        *,
        group_id: str,
        seed: int,
        reward: float,
        mode: Mode = "workers",
        labelled: bool = True,
    ) -> Captured:
        episode_id, base_url = await open_episode(self.proxy.url, group_id)
        trace = await run_episode(
            base_url,
            episode_id=episode_id,
            group_id=group_id,
            seed=seed,
            mode=mode,
            labelled=labelled,
        )
        closed = await close_episode(self.proxy.url, episode_id, reward, wait_s=5.0)
        assert closed.status_code == 200, closed.text
        async with httpx.AsyncClient(base_url=self.proxy.url, timeout=60) as client:
            response = await client.get(f"/episodes/{episode_id}")
        response.raise_for_status()
        bundle = await fetch_bundle(self.proxy.url, episode_id)
        return Captured(trace, bundle, response.json())


def _proxy(vllm: VLLMServer, store: Path, **settings: Any) -> ProxyServer:
    config = Settings(
        store=StoreSettings(url=sqlite_url(store)),
        upstream=UpstreamSettings(url=vllm.base_url),
        **settings,
    )
    return ProxyServer(config, None).start()


@pytest.fixture(scope="module")
def acceptance_proxy(
    vllm_server: VLLMServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ProxyServer]:
    """The proxy with its default settings (``continuation: stitch``)."""
    server = _proxy(vllm_server, tmp_path_factory.mktemp("acceptance") / "capture.db")
    assert server.settings.continuation == "stitch"
    yield server
    server.stop()


@pytest.fixture(scope="module")
def episode_runner(acceptance_proxy: ProxyServer) -> EpisodeRunner:
    return EpisodeRunner(acceptance_proxy)


@pytest.fixture(scope="module")
def passthrough_runner(
    vllm_server: VLLMServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EpisodeRunner]:
    """A second proxy on the same engine, forwarding chat requests as sent."""
    store = tmp_path_factory.mktemp("acceptance-passthrough") / "capture.db"
    server = _proxy(vllm_server, store, continuation="passthrough")
    yield EpisodeRunner(server)
    server.stop()


@pytest.fixture(scope="module")
def captured(episode_runner: EpisodeRunner) -> Captured:
    """The acceptance episode (workers mode, seed 1, reward 1.0), closed."""
    return asyncio.run(episode_runner.run(group_id="accept", seed=1, reward=1.0))


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Path) -> Path:
    return tiny_model_dir

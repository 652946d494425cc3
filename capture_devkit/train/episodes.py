"""One iteration's group: G attempts of the controlled episode through the proxy, closed with
their rewards, and their bundles (every call with the ``weight_version`` that served it)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from capture_contracts.vocabulary import Role
from capture_devkit.harness import close_episode, fetch_bundle, open_episode, run_episode
from capture_devkit.harness.trace import EpisodeTrace
from capture_devkit.train.config import TrainConfig
from capture_devkit.train.reward import episode_reward


@dataclass(frozen=True, slots=True)
class Attempt:
    trace: EpisodeTrace
    reward: float
    bundle: dict[str, Any]


def episode_id(iteration: int, index: int, run: int) -> str:
    """Unique per iteration, attempt and process run (a resumed iteration uses fresh ids)."""
    return f"it{iteration:04d}-r{run}-ep{index:02d}"


def episode_seed(config: TrainConfig, iteration: int, index: int) -> int:
    return 1 + config.seed * 1_000_003 + iteration * config.group_size + index


async def run_group(proxy_url: str, config: TrainConfig, iteration: int, run: int) -> list[Attempt]:
    group_id = f"iter-{iteration:04d}"
    worker_role: Role | None = "auxiliary" if config.training == "parent_only" else None

    async def attempt(index: int) -> Attempt:
        wanted = episode_id(iteration, index, run)
        eid, base_url = await open_episode(proxy_url, group_id, wanted, iteration=iteration)
        trace = await run_episode(
            base_url,
            episode_id=eid,
            group_id=group_id,
            seed=episode_seed(config, iteration, index),
            mode=config.harness_mode,
            free_max_tokens=config.free_max_tokens,
            worker_role=worker_role,
        )
        reward = episode_reward(trace, config.reward)
        closed = await close_episode(proxy_url, eid, reward, wait_s=30.0)
        closed.raise_for_status()
        return Attempt(trace, reward, await fetch_bundle(proxy_url, eid))

    return list(await asyncio.gather(*(attempt(i) for i in range(config.group_size))))

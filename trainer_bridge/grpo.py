"""GRPO over logical rollouts: one advantage per episode, broadcast to its owned tokens.

An episode (one task attempt) may be spread over many rows (one per context endpoint: parent,
workers, compaction rewrites). Its single reward enters its group's baseline exactly once,
whatever its number of rows:

    advantage(e) = reward(e) − mean_{e' in group(e)} reward(e')
    advantage(e) /= std_{e' in group(e)} reward(e') + eps        (only with ``normalize_std``)

``std`` is the population standard deviation of the group's episode rewards (divide by n). A group
with a single episode, or whose rewards are all equal, carries no learning signal: its advantage is
exactly 0 (not eps-noise), with or without ``normalize_std``.

Rows of one episode that disagree on reward or group are rejected with ``InconsistentRows``.
Arithmetic is done in float64 on Python floats, then cast to float32 for the loss.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from trainer_bridge.batch import TrainBatch
from trainer_bridge.errors import InconsistentRows


@dataclass(frozen=True, slots=True)
class EpisodeReward:
    episode_id: str
    group_id: str
    reward: float


def episode_rewards(rows: Iterable[tuple[str, str, float]]) -> dict[str, EpisodeReward]:
    """Collapse ``(episode_id, group_id, reward)`` of every row to one entry per episode.

    Raises ``InconsistentRows`` when two rows of one episode name different groups or rewards.
    """
    episodes: dict[str, EpisodeReward] = {}
    for episode_id, group_id, reward in rows:
        seen = episodes.get(episode_id)
        if seen is None:
            episodes[episode_id] = EpisodeReward(episode_id, group_id, float(reward))
            continue
        if seen.group_id != group_id:
            raise InconsistentRows(
                f"episode {episode_id!r} has rows in two groups: {seen.group_id!r} and "
                f"{group_id!r}; every row of an episode must carry the same group_id",
                param="group_id",
            )
        if seen.reward != float(reward):
            raise InconsistentRows(
                f"episode {episode_id!r} has rows with two rewards: {seen.reward!r} and "
                f"{float(reward)!r}; an episode has exactly one reward",
                param="reward",
            )
    return episodes


def episode_advantages(
    episodes: Mapping[str, EpisodeReward], *, normalize_std: bool = False, eps: float = 1e-6
) -> dict[str, float]:
    """One advantage per episode: reward minus its group's mean (optionally over std + eps)."""
    groups: dict[str, list[EpisodeReward]] = {}
    for episode in episodes.values():
        groups.setdefault(episode.group_id, []).append(episode)

    advantages: dict[str, float] = {}
    for members in groups.values():
        rewards = [e.reward for e in members]
        n = len(rewards)
        mean = math.fsum(rewards) / n
        std = math.sqrt(math.fsum((r - mean) ** 2 for r in rewards) / n)
        degenerate = n == 1 or all(r == rewards[0] for r in rewards)
        for episode in members:
            if degenerate:
                advantages[episode.episode_id] = 0.0
                continue
            advantage = episode.reward - mean
            if normalize_std:
                advantage /= std + eps
            advantages[episode.episode_id] = advantage
    return advantages


def batch_episode_rewards(batch: TrainBatch) -> dict[str, EpisodeReward]:
    """The per-episode table of a batch, checked for consistency."""
    rows = (
        (
            batch.episode_ids[int(e)],
            batch.group_ids[int(g)],
            float(r),
        )
        for e, g, r in zip(
            batch.episode_index.tolist(),
            batch.group_index.tolist(),
            batch.rewards.tolist(),
            strict=True,
        )
    )
    return episode_rewards(rows)


def row_advantages(
    batch: TrainBatch, *, normalize_std: bool = False, eps: float = 1e-6
) -> torch.Tensor:
    """Per-row advantage ``[B]`` (float32): each row gets its episode's advantage."""
    per_episode = episode_advantages(
        batch_episode_rewards(batch), normalize_std=normalize_std, eps=eps
    )
    values = [per_episode[batch.episode_ids[int(e)]] for e in batch.episode_index.tolist()]
    return torch.tensor(values, dtype=torch.float32)  # [B]


def with_advantages(
    batch: TrainBatch, *, normalize_std: bool = False, eps: float = 1e-6
) -> TrainBatch:
    """The batch with ``advantages [B, T]``: the episode advantage on owned tokens, 0 elsewhere."""
    per_row = row_advantages(batch, normalize_std=normalize_std, eps=eps)  # [B]
    advantages = per_row[:, None] * batch.loss_mask  # [B, T]
    return dataclasses.replace(batch, advantages=advantages)

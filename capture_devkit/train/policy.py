"""The learner of the loop: one model and optimizer that stay alive across iterations.

``LocalPolicy`` runs ``trainer_bridge.learner.Learner`` in this process; ``RayPolicy``
(``trainer_bridge.ray_session``) keeps one Ray Train run for the whole loop. Both take an
iteration's rows, run the configured steps, count policy versions (one per optimizer step) and
save weights for the engine; the optimizer state is saved next to the weights so a killed run
resumes where it stopped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from capture_contracts.rows import Row
from capture_devkit.train.config import TrainConfig


@dataclass(frozen=True, slots=True)
class IterationStats:
    steps: list[dict[str, Any]]  # StepStats.as_dict() of each step, + staleness
    version: int  # the learner's version after the steps


class Policy(Protocol):
    version: int

    def train(self, rows: Sequence[Row]) -> IterationStats: ...

    def save(self, out_dir: str | Path) -> Path: ...

    def close(self) -> None: ...


def learner_config(config: TrainConfig) -> Any:
    from trainer_bridge.learner import LearnerConfig
    from trainer_bridge.loss import LossConfig

    return LearnerConfig(
        lr=config.lr,
        max_grad_norm=config.max_grad_norm,
        loss=LossConfig(clip_eps=config.clip_eps),
    )


def prepare_batch(rows: Sequence[Row], config: TrainConfig, learner_version: int) -> Any:
    """Rows → batch with GRPO advantages, staleness limited; and its staleness stats."""
    from trainer_bridge.batch import collate
    from trainer_bridge.grpo import with_advantages
    from trainer_bridge.staleness import limit_staleness, staleness_stats

    batch = collate(rows, constrained=config.constrained)
    batch = with_advantages(batch, normalize_std=config.normalize_std)
    stats = staleness_stats(batch, learner_version, config.max_staleness)
    batch = limit_staleness(batch, learner_version, config.max_staleness, config.staleness_policy)
    return batch, stats


class LocalPolicy:
    def __init__(
        self, weights: Path, tokenizer_dir: Path, config: TrainConfig, version: int
    ) -> None:
        import torch

        from trainer_bridge.learner import Learner

        torch.manual_seed(config.seed)
        torch.set_num_threads(config.torch_threads)
        self.config = config
        self.version = version
        self.learner = Learner.from_dir(weights, learner_config(config))
        self.learner.source_dir = tokenizer_dir  # tokenizer files for every saved version
        self.learner.load_optimizer(weights)

    def train(self, rows: Sequence[Row]) -> IterationStats:
        steps = []
        for _ in range(self.config.steps_per_iteration):
            batch, staleness = prepare_batch(rows, self.config, self.version)
            stats = self.learner.step(batch).as_dict()
            stats["staleness"] = staleness.as_dict()
            steps.append(stats)
            self.version += 1
        return IterationStats(steps, self.version)

    def save(self, out_dir: str | Path) -> Path:
        return Path(self.learner.save(out_dir, optimizer=True))

    def close(self) -> None:
        pass

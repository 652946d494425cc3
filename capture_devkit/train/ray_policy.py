"""The loop's learner on Ray Train: one session (trainer_bridge.ray_session) for all iterations."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from capture_contracts.rows import Row
from capture_devkit.train.config import TrainConfig
from capture_devkit.train.policy import IterationStats, learner_config


class RayPolicy:
    def __init__(
        self, weights: Path, tokenizer_dir: Path, config: TrainConfig, version: int
    ) -> None:
        from trainer_bridge.ray_session import RaySession, SessionConfig

        self.config = config
        self.version = version
        self.session = RaySession(
            weights,
            tokenizer_dir,
            SessionConfig(
                num_workers=config.ray_workers,
                torch_threads=config.torch_threads,
                normalize_std=config.normalize_std,
                constrained=config.constrained,
                max_staleness=config.max_staleness,
                staleness_policy=config.staleness_policy,
                seed=config.seed,
                learner=learner_config(config),
            ),
        )

    def train(self, rows: Sequence[Row]) -> IterationStats:
        steps = []
        for _ in range(self.config.steps_per_iteration):
            reply = self.session.step(rows, self.version)
            steps.append({k: v for k, v in reply.items() if k not in ("rank", "op")})
            self.version += 1
        return IterationStats(steps, self.version)

    def save(self, out_dir: str | Path) -> Path:
        return self.session.save(out_dir)

    def close(self) -> None:
        self.session.close()

